"""The training loop: a new drafter (or one to fine-tune), AdamW with warmup and cosine decay,
the lambda curriculum, checkpoints to resume from, and train_drafter tying them together."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..drafter import (Drafter, config_for_target, default_target_layer_ids, load_drafter,
                       save_drafter, target_io)
from .batches import CachedBatches, WindowBatches
from .corpus import TokenStream
from .feature_shards import FeatureShards
from .features import FeatureCache, decoder_layers
from .objective import loss_terms
from .options import TrainOptions, default_gamma
from .progress import Progress


logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "train_state.pt"


def _lr_at(options: TrainOptions, step: int) -> float:
    warm = max(1, int(round(options.warmup * options.steps)))
    if step < warm:
        return options.lr * (step + 1) / warm
    frac = min(1.0, (step - warm) / max(1, options.steps - warm))
    return options.lr * (options.min_lr + (1 - options.min_lr) * 0.5 *
                         (1 + math.cos(math.pi * frac)))


def _lambda_at(options: TrainOptions, step: int) -> float:
    span = options.curriculum * options.steps
    return 0.0 if span <= 0 else max(0.0, 1.0 - step / span)


def _objective(terms: dict[str, torch.Tensor], name: str, soft_weight: float) -> torch.Tensor:
    """(1 - w) CE + w KL of the base or corrected logits (CE alone without soft labels)."""
    if soft_weight == 0:
        return terms[f"ce_{name}"]
    return (1 - soft_weight) * terms[f"ce_{name}"] + soft_weight * terms[f"kl_{name}"]


def new_drafter(target: Any, options: TrainOptions) -> Drafter:
    """A randomly initialised drafter shaped by ``options`` for ``target`` (float32, train mode)."""
    embed, _, target_config = target_io(target)
    vocab, hidden = embed.weight.shape
    cfg: dict[str, Any] = dict(shift_label=options.shift_label,
                               pure_draft_prefix_len=options.prefix_len)
    if options.target_layer_ids is not None:
        cfg["target_layer_ids"] = list(options.target_layer_ids)
    if options.mask_token_id is not None:
        if not 0 <= options.mask_token_id < vocab:
            raise ValueError(f"mask_token_id must be in [0, {vocab}), got "
                             f"{options.mask_token_id}")
        cfg["mask_token_id"] = options.mask_token_id
    if options.intermediate_size is not None:
        cfg["intermediate_size"] = options.intermediate_size
    if options.domino:
        cfg["emb_dim"] = options.emb_dim or min(256, hidden)
        cfg["gru_hidden_dim"] = options.gru_hidden_dim or min(1024, hidden)
    elif options.prefix_len:
        cfg["pure_draft_prefix_len"] = 0  # P only means something with a head
    num_target_layers = target_config.num_hidden_layers
    layer_ids = cfg.get("target_layer_ids",
                        default_target_layer_ids(num_target_layers, options.num_layers))
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} are out of range for a target with "
                         f"{num_target_layers} layers")
    config = config_for_target(target, num_layers=options.num_layers,
                               block_size=options.block_size, domino=options.domino, **cfg)
    with torch.device("cpu"):
        drafter = Drafter(config, target)
    # the init is drawn in the target's dtype, then widened to float32 (a bfloat16 target's
    # drafter starts from bfloat16-rounded weights): a seed keeps giving the weights it gave
    drafter.to(device=embed.weight.device, dtype=embed.weight.dtype)
    _init_for_training(drafter, options.seed)
    return drafter.float().train()


@torch.no_grad()
def _init_for_training(drafter: Drafter, seed: int) -> None:
    """Fan-in scaled init (std 1/sqrt(fan_in)) for every matrix, W_2 = 0, norms 1.

    An N(0, 0.02²) init (dartree.testing.random_drafter's) suits 4096-wide drafters; at small
    widths it leaves the residual stream equal to the block's token embeddings, so with a tied
    target the untrained drafter confidently predicts its own input (CE far above log V) and
    spends its first hundreds of steps unlearning that. With fan-in scaling the layers dominate
    from step 0. W_2 = 0 starts the Domino correction at Δ = 0 (the base-anchored start of the
    curriculum).
    """
    generator = torch.Generator().manual_seed(seed)
    w2 = drafter.head.W_2 if drafter.head is not None else None
    for name, param in drafter.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif param is w2:
            param.zero_()
        elif param.dim() == 2:
            param.copy_(torch.randn(param.shape, generator=generator) * param.shape[1] ** -0.5)
        else:
            param.zero_()
    drafter.refresh_input_table()


def _check_target(target: Any) -> None:
    target_io(target)
    decoder_layers(target)


def _save_checkpoint(folder: Path, drafter: Drafter, optimizer: torch.optim.Optimizer,
                     batches: WindowBatches | CachedBatches, step: int, options: TrainOptions,
                     info: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    state = {"drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(),
             "generator": batches.generator.get_state(), "pool": batches.pool, "step": step,
             "options": options.shape_dict(), "info": info}
    tmp = folder / (CHECKPOINT_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, folder / CHECKPOINT_FILE)


def _load_checkpoint(folder: Path, options: TrainOptions) -> dict[str, Any] | None:
    file = folder / CHECKPOINT_FILE
    if not file.is_file():
        return None
    state = torch.load(file, map_location="cpu", weights_only=False)
    saved = state.get("options", {})
    diff = {k: (saved.get(k), v) for k, v in options.shape_dict().items() if saved.get(k) != v}
    if diff:
        shown = ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"checkpoint {file} was made with other options ({shown}); use the "
                         f"same options, another checkpoint folder, or resume=False")
    return state


def _check_stream(data: TokenStream, options: TrainOptions, vocab: int) -> None:
    if len(data) and (int(data.ids.min()) < 0 or int(data.ids.max()) >= vocab):
        raise ValueError(f"corpus token ids must be in [0, {vocab}), got "
                         f"[{int(data.ids.min())}, {int(data.ids.max())}]")
    needed = options.seq_len - options.distill_new_tokens if options.self_distill \
        else options.seq_len
    if len(data) < needed:
        raise ValueError(f"the corpus has {len(data)} tokens, fewer than one window ({needed})")


def _check_cache(cache: FeatureCache | FeatureShards, options: TrainOptions, vocab: int) -> None:
    if not len(cache):
        raise ValueError("the feature cache holds no sequences")
    if options.self_distill:
        raise ValueError("self_distill generates its data: it cannot train on a feature cache "
                         "(distil when building the cache instead)")
    wanted = options.target_layer_ids
    if wanted is not None and list(wanted) != list(cache.layer_ids):
        raise ValueError(f"target_layer_ids {wanted} differ from the cache's {cache.layer_ids}")
    if int(cache.tokens.min()) < 0 or int(cache.tokens.max()) >= vocab:
        raise ValueError(f"cached token ids must be in [0, {vocab})")
    if options.soft_weight > 0 and not cache.topk:
        raise ValueError("soft_weight > 0 needs soft labels: build the feature cache with "
                         "topk > 0")


def _load_init(drafter: Drafter, init: str | Path, target: Any) -> None:
    """Start from the drafter in ``init``. It may have fewer layers than ``drafter`` (growing
    a drafter): its layers become the first ones, and each new layer starts as the identity
    (its attention output and MLP down projections zero, the residual stream passes through),
    so training starts from the init drafter's outputs."""
    start = load_drafter(init, target)

    def same(a: Any, b: Any) -> bool:  # a saved float (rms_norm_eps) went through float32
        return math.isclose(a, b, rel_tol=1e-6) if isinstance(a, float) else a == b

    mismatched = [f.name for f in dataclasses.fields(drafter.config) if f.name != "num_layers"
                  and not same(getattr(start.config, f.name), getattr(drafter.config, f.name))]
    have, want = start.config.num_layers, drafter.config.num_layers
    if have > want:
        mismatched.append("num_layers")
    if mismatched:
        raise ValueError(f"init drafter {init} does not have the shape the options give: "
                         f"{', '.join(mismatched)} differ")
    with torch.no_grad():
        drafter.load_state_dict({k: v.float() for k, v in start.state_dict().items()},
                                strict=have == want)
        for layer in drafter.layers[have:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            if layer.self_attn.o_proj.bias is not None:
                layer.self_attn.o_proj.bias.zero_()
    drafter.refresh_input_table()


def train_drafter(target: Any, data: TokenStream | torch.Tensor, options: TrainOptions,
                  output: str | Path | None = None, progress: bool = True,
                  init: str | Path | None = None, draft_vocab: Any = None
                  ) -> tuple[Drafter, dict[str, Any]]:
    """Train a drafter (+ Domino head) for the frozen ``target`` on ``data``.

    target: a transformers causal LM (decoder layers at ``model.model.layers``), any device;
    data: a TokenStream or a 1-D LongTensor of token ids in the target's vocabulary, or a
    FeatureCache or FeatureShards (sequences with precomputed target features: the target is
    never run).
    Writes the drafter with :func:`dartree.save_drafter` into ``output`` when given.
    ``init``: a drafter folder to start from instead of a random init (fine-tuning on new data;
    its shape must be the one ``options`` gives, or the same with fewer layers: the drafter grows,
    its new layers starting as the identity); a resumed checkpoint takes precedence.
    ``draft_vocab``: token ids (dartree.drafter.vocab) to train over, as the drafter will draft
    over them (dartree.train.objective), saved with it; None: the whole vocabulary.
    Returns (drafter in eval mode, info: ``step``, ``loss`` (last), ``losses`` (one per step),
    ``smoothed`` (running means of every loss term), ``tokens``, ``seconds``,
    ``tokens_per_second``).
    """
    options.validate()
    _check_target(target)
    vocab = target_io(target)[0].weight.shape[0]
    if isinstance(data, (FeatureCache, FeatureShards)):
        _check_cache(data, options, vocab)
    else:
        if options.soft_weight > 0:
            raise ValueError("soft_weight > 0 needs soft labels, which only a FeatureCache "
                             "built with topk > 0 holds")
        data = data if isinstance(data, TokenStream) else TokenStream(data)
        _check_stream(data, options, vocab)
    device = target_io(target)[0].weight.device
    was_training = target.training
    grad_flags = [(p, p.requires_grad) for p in target.parameters()]
    target.eval()
    target.requires_grad_(False)

    drafter = new_drafter(target, options).to(device)
    if init is not None:
        _load_init(drafter, init, target)
    drafter.set_draft_vocab(draft_vocab)
    gamma = options.gamma or default_gamma(options.block_size)
    params = [p for p in drafter.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": options.weight_decay},
                                   {"params": other, "weight_decay": 0.0}],
                                  lr=options.lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(options.seed)
    batches = (CachedBatches(data, options, generator, device, soft=options.soft_weight > 0)
               if isinstance(data, (FeatureCache, FeatureShards))
               else WindowBatches(target, data, options, generator, device))
    step = 0
    info: dict[str, Any] = {"seconds": 0.0, "tokens": 0, "losses": []}
    ckpt = Path(options.checkpoint_dir) if options.checkpoint_dir else None
    if ckpt is not None and options.resume:
        state = _load_checkpoint(ckpt, options)
        if state is not None:
            drafter.load_state_dict(state["drafter"])
            optimizer.load_state_dict(state["optimizer"])
            generator.set_state(state["generator"])
            batches.pool = state.get("pool")
            step, info = state["step"], state["info"]
            logger.info("resumed drafter training from %s at step %d", ckpt, step)

    bar = Progress(options.steps, progress)
    smooth: dict[str, float] = dict(info.get("smoothed", {}))
    tick = time.perf_counter()
    try:
        while step < options.steps:
            batch = batches.next()
            tokens = batch.tokens
            lam = _lambda_at(options, step)
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(options, step)
            with torch.autocast(tokens.device.type, torch.bfloat16, enabled=options.bf16):
                terms = loss_terms(drafter, target, tokens, batch.anchors, gamma, batch.features,
                                   batch.lengths, batch.soft)
            loss = _objective(terms, "base", options.soft_weight)
            if "ce_corrected" in terms:
                loss = (1 - lam) * _objective(terms, "corrected", options.soft_weight) + lam * loss
            if not torch.isfinite(loss):
                raise FloatingPointError(f"drafter loss is {loss.item()} at step {step}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, options.grad_clip)
            optimizer.step()
            step += 1
            now = time.perf_counter()
            info["seconds"] += now - tick
            tick = now
            info["tokens"] += tokens.numel()
            values = {"loss": loss.item(), **{k: v.item() for k, v in terms.items()}}
            for key, value in values.items():
                smooth[key] = value if key not in smooth else 0.9 * smooth[key] + 0.1 * value
            info.update(step=step, smoothed=dict(smooth), loss=values["loss"])
            info["losses"].append(values["loss"])
            rate = info["tokens"] / max(info["seconds"], 1e-9)
            text = f"loss {smooth['loss']:.3f} base {smooth['ce_base']:.3f}"
            if "ce_corrected" in smooth:
                text += (f" corr {smooth['ce_corrected']:.3f} acc {smooth['accept_base']:.2f}/"
                         f"{smooth['accept_corrected']:.2f}")
            bar.update(step, f"{text} lam {lam:.2f} {rate:.0f} tok/s")
            if ckpt is not None and (step % options.checkpoint_every == 0
                                     or step == options.steps):
                _save_checkpoint(ckpt, drafter, optimizer, batches, step, options, info)
    finally:
        bar.close()
        target.train(was_training)
        for param, flag in grad_flags:
            param.requires_grad_(flag)

    drafter.eval()
    drafter.refresh_input_table()
    info["tokens_per_second"] = info["tokens"] / max(info["seconds"], 1e-9)
    if output is not None:
        save_drafter(drafter, output)
        drafter.path = Path(output)
    return drafter, info
