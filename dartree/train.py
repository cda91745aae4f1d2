"""Training a DFlash drafter with a Domino head for any target (research/ALGORITHMS.md §1-2).

The target is frozen; the drafter reuses its input embedding and LM head and reads the outputs
of ``target_layer_ids`` (transformers' ``hidden_states[l + 1]``) as context features.

Objective (DFlash): for each training sequence of L tokens, pick A random anchor positions a;
each anchor opens a block ``[x_a, MASK x (B-1)]`` at positions a .. a+B-1 whose queries see the
target features of positions ``< a`` plus their own block (bidirectional inside the block). The
drafter's k used slots predict ``x_{a+1} .. x_{a+k}`` (slot m predicts position a+1+m; with
``shift_label`` k = B and slot 0 is the first block row, otherwise k = B-1 and the first row is
not read out), and their cross-entropy is weighted ``exp(-m / gamma)``.

Domino head, trained jointly with teacher forcing: a GRU runs over the true tokens
``x_a .. x_{a+k-1}`` (the state at slot m has read the root and m true tokens, as at inference)
and corrects slots m >= P: ``l'_m = l_m + W_2 SiLU(W_z h_m + W_s g_m)``. The loss is
``(1 - lam) CE(l') + lam CE(l)`` with lam falling linearly from 1 to 0 over the first
``curriculum`` fraction of the steps (slots m < P have no correction: l' = l there).

Self-distillation (``self_distill``) replaces each training window by a prompt from the corpus
followed by the target's own greedy continuation, and anchors only inside the continuation.

Example::

    from dartree.train import TrainOptions, load_corpus, train_drafter
    ids = load_corpus(["src/"], tokenizer)
    drafter, info = train_drafter(target, ids, TrainOptions(steps=2000), output="my-drafter")

The command line is ``dartree train-drafter`` (:func:`add_train_parser`).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn.functional as F

from .drafter import (Drafter, config_for_target, default_target_layer_ids, load_drafter,
                      save_drafter, target_io)
from .prompts import jsonl_rows

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "train_state.pt"
IGNORE = -100  # label of a slot past the end of its sequence
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".cpp", ".js", ".ts", ".java", ".go",
                 ".rs", ".sh", ".json", ".toml", ".yaml", ".yml", ".html", ".css")
_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # DFlash loss-decay constants per block size


def default_gamma(block_size: int) -> float:
    """DFlash's gamma: 7 for B = 16, 5 for B = 10, 4 for B = 8, else 7 B / 16."""
    return _GAMMA.get(block_size, max(1.0, 7.0 * block_size / 16))


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainOptions:
    """Drafter shape and training settings.

    Shape: ``num_layers`` drafter layers, ``block_size`` B, ``target_layer_ids`` (None: the
    DFlash default for the target's depth), ``domino`` (add the head), ``emb_dim`` r and
    ``gru_hidden_dim`` G (None: min(256, H) and min(1024, H)), ``shift_label`` and
    ``prefix_len`` P, ``mask_token_id`` (None: V - 1), ``intermediate_size`` (None: the
    target's).
    Training: ``steps`` optimizer steps of ``batch_size`` windows of ``seq_len`` tokens with
    ``anchors`` blocks each; AdamW with ``lr`` (linear warmup over ``warmup`` of the steps, then
    cosine to ``min_lr`` x lr), ``weight_decay``, ``grad_clip``; ``gamma`` (None: the DFlash
    value for B); ``curriculum``: fraction of steps over which lam falls from 1 to 0.
    Self-distillation: ``self_distill``, with ``distill_new_tokens`` generated tokens per window
    (the rest of ``seq_len`` is the prompt), generated ``distill_batches`` steps' worth at a
    time (one batched decode amortises the per-token overhead of the target's forward).
    Checkpoints: every ``checkpoint_every`` steps into ``checkpoint_dir`` (None: no
    checkpoints); ``resume`` continues from one found there.
    """

    num_layers: int = 1
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    domino: bool = True
    emb_dim: int | None = None
    gru_hidden_dim: int | None = None
    shift_label: bool = True
    prefix_len: int = 1
    mask_token_id: int | None = None
    intermediate_size: int | None = None
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    anchors: int = 16
    lr: float = 6e-4
    warmup: float = 0.04
    min_lr: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None
    curriculum: float = 0.5
    self_distill: bool = False
    distill_new_tokens: int = 128
    distill_batches: int = 8
    bf16: bool = False
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    resume: bool = True

    @property
    def num_slots(self) -> int:
        return self.block_size if self.shift_label else self.block_size - 1

    def validate(self) -> None:
        """Raise ValueError naming the first bad option."""
        def positive(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

        for name in ("num_layers", "steps", "batch_size", "seq_len", "anchors",
                     "checkpoint_every", "distill_batches"):
            positive(name)
        for name in ("emb_dim", "gru_hidden_dim", "intermediate_size"):
            if getattr(self, name) is not None:
                positive(name)
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not 0 <= self.prefix_len <= self.num_slots:
            raise ValueError(f"prefix_len must be in [0, {self.num_slots}], got {self.prefix_len}")
        if self.target_layer_ids is not None and not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be > 0, got {self.lr}")
        for name in ("warmup", "min_lr", "curriculum"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be > 0, got {self.grad_clip}")
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        # the first anchor needs one context token, the last label must lie in the window
        if self.seq_len < self.num_slots + 2:
            raise ValueError(f"seq_len must be >= {self.num_slots + 2} (a block of "
                             f"{self.num_slots} labels after one context token), got "
                             f"{self.seq_len}")
        if self.self_distill and not self.num_slots + 1 <= self.distill_new_tokens \
                <= self.seq_len - 1:
            raise ValueError(f"distill_new_tokens must be in [{self.num_slots + 1}, "
                             f"{self.seq_len - 1}] (one block of labels, one prompt token), "
                             f"got {self.distill_new_tokens}")

    def shape_dict(self) -> dict[str, Any]:
        """The fields a resumed run must share with its checkpoint."""
        keep = ("num_layers", "block_size", "target_layer_ids", "domino", "emb_dim",
                "gru_hidden_dim", "shift_label", "prefix_len", "mask_token_id",
                "intermediate_size", "steps", "batch_size", "seq_len", "anchors", "lr", "warmup",
                "min_lr", "weight_decay", "grad_clip", "gamma", "curriculum", "self_distill",
                "distill_new_tokens", "distill_batches", "seed")
        return {k: getattr(self, k) for k in keep}


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def _jsonl_texts(path: Path) -> Iterable[str]:
    """Texts of a JSONL file: ``text``, or ``prompt`` + ``completion``/``response``, or
    ``messages`` (contents joined)."""
    for number, _, row in jsonl_rows(path):
        if isinstance(row, str):
            yield row
        elif isinstance(row, dict) and isinstance(row.get("text"), str):
            yield row["text"]
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            yield row["prompt"] + str(row.get("completion", row.get("response", "")))
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            yield "\n".join(str(m.get("content", "")) for m in row["messages"]
                            if isinstance(m, dict))
        else:
            raise ValueError(f"{path}:{number}: a JSONL row needs a 'text', 'prompt' or "
                             f"'messages' field")


def corpus_texts(paths: Iterable[str | Path], suffixes: tuple[str, ...] = TEXT_SUFFIXES
                 ) -> Iterable[str]:
    """Documents of files, folders (walked recursively, files ending in ``suffixes``, sorted)
    and ``.jsonl`` files (one document per row)."""
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and
                           (p.suffix in suffixes or p.suffix == ".jsonl"))
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"corpus path {path} does not exist")
        for file in files:
            if file.suffix == ".jsonl":
                yield from _jsonl_texts(file)
            else:
                yield file.read_text(encoding="utf-8", errors="replace")


def load_corpus(paths: Iterable[str | Path], tokenizer: Any) -> torch.Tensor:
    """Tokenize a corpus into one LongTensor stream, each document followed by EOS (if any)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    docs = 0
    for text in corpus_texts(paths):
        ids.extend(tokenizer(text, add_special_tokens=False).input_ids)
        if eos is not None:
            ids.append(eos)
        docs += 1
    if not docs:
        raise ValueError("the corpus has no documents (no matching files)")
    return torch.tensor(ids, dtype=torch.long)


class TokenStream:
    """Random windows of one token stream (a 1-D integer tensor)."""

    def __init__(self, ids: torch.Tensor):
        ids = torch.as_tensor(ids)
        if ids.dim() != 1 or ids.is_floating_point():
            raise ValueError(f"token stream must be a 1-D integer tensor, got {ids.dtype} "
                             f"{list(ids.shape)}")
        self.ids = ids.long()

    def __len__(self) -> int:
        return len(self.ids)

    def sample(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """[batch, length] windows at uniform random offsets."""
        if len(self.ids) < length:
            raise ValueError(f"the corpus has {len(self.ids)} tokens, fewer than one window "
                             f"(seq_len {length})")
        starts = torch.randint(0, len(self.ids) - length + 1, (batch,), generator=generator)
        return torch.stack([self.ids[s:s + length] for s in starts.tolist()])


# --------------------------------------------------------------------------------------------
# Target side: features and self-distillation
# --------------------------------------------------------------------------------------------


def _decoder_layers(target: Any) -> Any:
    layers = getattr(getattr(target, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"target {type(target).__name__} has no decoder layers at "
                         f"model.model.layers")
    return layers


@torch.no_grad()
def target_features(target: Any, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """ids [N, L] -> features [N, L, n*H]: outputs of decoder layers ``layer_ids``, concatenated
    (transformers' ``hidden_states[l + 1]``; for the last layer, before the final norm)."""
    layers = _decoder_layers(target)
    captured: dict[int, torch.Tensor] = {}

    def hook(index: int):
        def save(module, args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output
        return save

    handles = [layers[i].register_forward_hook(hook(i)) for i in set(layer_ids)]
    try:
        backbone = getattr(target, "model", target)  # skip the LM head
        backbone(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat([captured[i] for i in layer_ids], dim=-1)


@torch.no_grad()
def greedy_continue(target: Any, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """prompts [N, P] -> [N, P + new_tokens]: the target's greedy continuations (EOS ignored)."""
    # transformers 5 names the cache `cache`; older versions `past_key_values`
    name = "cache" if "cache" in inspect.signature(target.forward).parameters \
        else "past_key_values"
    out = target(input_ids=prompts, use_cache=True)
    past, tokens = getattr(out, name), [out.logits[:, -1].argmax(-1)]
    for _ in range(new_tokens - 1):
        out = target(input_ids=tokens[-1][:, None], use_cache=True, **{name: past})
        past = getattr(out, name)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.cat([prompts, torch.stack(tokens, dim=1)], dim=1)


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, num_slots: int,
                 lengths: torch.Tensor | None = None) -> torch.Tensor:
    """[N, A, k]: slot m of the block at a predicts tokens[a + 1 + m]; with ``lengths`` [N],
    labels at or past a row's length are IGNORE (padding: no loss, end of accepted run)."""
    offsets = anchors[:, :, None] + 1 + torch.arange(num_slots, device=tokens.device)
    labels = tokens.gather(1, offsets.clamp_max(tokens.shape[1] - 1).flatten(1)).view(offsets.shape)
    if lengths is not None:
        labels = labels.masked_fill(offsets >= lengths.to(tokens.device)[:, None, None], IGNORE)
    return labels


def block_logits(drafter: Drafter, h: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(base logits, corrected logits or None) [N, A, k, V] with teacher forcing.

    The head's GRU reads the true tokens tokens[a .. a+k-1] (root first) through
    ``prefix_gru`` on target embeddings, so W_ih gets gradients; slot m >= P is corrected with
    the state after a + m, as ``tree.py`` does at inference.
    """
    base = drafter.base_logits(h).to(h.dtype)
    head = drafter.head
    if head is None:
        return base, None
    N, A, k, H = h.shape
    offsets = anchors[:, :, None] + torch.arange(k, device=tokens.device)
    # past a row's end (cached rows) the GRU reads padding: only ignored slots depend on it
    inputs = tokens.gather(1, offsets.clamp_max(tokens.shape[1] - 1).flatten(1)).view(N * A, k)
    emb = drafter.embed(inputs).to(h.dtype)
    g, _ = head.prefix_gru(emb)  # [N*A, k, G]: state after the root and m true tokens
    P = drafter.config.pure_draft_prefix_len
    delta = head.embed_proj(torch.cat([h.reshape(N * A, k, H)[:, P:], g[:, P:]], dim=-1))
    corrected = torch.cat([base[:, :, :P], base[:, :, P:] + delta.view(N, A, k - P, -1)], dim=2)
    return base, corrected


def _weighted_ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
                 ) -> torch.Tensor:
    """Mean over labelled slots of CE x weight, normalised by the weights of those slots."""
    ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten(), reduction="none",
                         ignore_index=IGNORE)
    w = weights.expand(labels.shape) * (labels != IGNORE)
    return (ce.view(labels.shape) * w).sum() / w.sum().clamp_min(1e-9)


def _accept_length(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean number of leading slots whose argmax equals the label (teacher forced); an ignored
    label ends the run."""
    hits = (logits.argmax(-1) == labels).long()
    return hits.cumprod(-1).sum(-1).float().mean()


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


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
    spends its first hundreds of steps unlearning that. With fan-in scaling the layers dominate from step 0.
    W_2 = 0 starts the Domino correction at Δ = 0 (the base-anchored start of the curriculum).
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


class _Progress:
    """One stderr line, rewritten in place on a terminal, else printed every ``every`` steps."""

    def __init__(self, total: int, enabled: bool, every: int = 10):
        self.total, self.enabled, self.every = total, enabled, every
        self.tty = enabled and sys.stderr.isatty()

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        filled = int(30 * step / self.total)
        line = f"[{'#' * filled}{'.' * (30 - filled)}] {step}/{self.total} {text}"
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif step % self.every == 0 or step == self.total:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)


class _Batches:
    """(tokens [N, L], anchors [N, A]) for each step, drawn from ``generator``.

    With self-distillation, windows come from a pool of ``distill_batches * N`` prompts
    continued by the target in one batched greedy decode; the pool is part of the checkpoint
    state so that a resumed run sees the same windows.
    """

    def __init__(self, target: Any, data: TokenStream, options: TrainOptions,
                 generator: torch.Generator, device: torch.device):
        self.target, self.data, self.options = target, data, options
        self.generator, self.device = generator, device
        self.pool: torch.Tensor | None = None

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        opts = self.options
        N, L, A, k = opts.batch_size, opts.seq_len, opts.anchors, opts.num_slots
        if opts.self_distill:
            prompt_len = L - opts.distill_new_tokens
            if self.pool is None or len(self.pool) == 0:
                prompts = self.data.sample(N * opts.distill_batches, prompt_len, self.generator)
                self.pool = greedy_continue(self.target, prompts.to(self.device),
                                            opts.distill_new_tokens).cpu()
            tokens, self.pool = self.pool[:N].to(self.device), self.pool[N:]
            low = prompt_len - 1  # the last prompt token opens the first block of target tokens
        else:
            tokens = self.data.sample(N, L, self.generator).to(self.device)
            low = 1
        high = L - 1 - k  # the last label a + k must lie in the window
        choices = high - low + 1
        anchors = torch.stack([
            torch.randperm(choices, generator=self.generator)[:A] if A <= choices
            else torch.randint(0, choices, (A,), generator=self.generator)
            for _ in range(N)]) + low
        return tokens, anchors.to(self.device), None, None


@dataclasses.dataclass
class FeatureCache:
    """Sequences with their target features, computed once (training never runs the target).

    tokens   int64 [total]: every sequence's tokens, concatenated
    features bfloat16 [total, n*H]: the target features of those tokens (``target_features``)
    offsets  int64 [n + 1]: sequence i is rows offsets[i] .. offsets[i+1]
    starts   int64 [n]: first position of sequence i whose token is a label (its answer)
    layer_ids: the target layers the features come from
    """

    tokens: torch.Tensor
    features: torch.Tensor
    offsets: torch.Tensor
    starts: torch.Tensor
    layer_ids: list[int]

    def __len__(self) -> int:
        return len(self.starts)

    @classmethod
    @torch.no_grad()
    def build(cls, target: Any, sequences: list[tuple[list[int], int]], layer_ids: list[int],
              progress: bool = True, batch_size: int = 8) -> FeatureCache:
        """Features of ``sequences`` [(token ids, answer start)]: target forwards over batches of
        similar lengths, right-padded (causal attention: padding after a row's end cannot change
        its features)."""
        device = target_io(target)[0].weight.device
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))
        feats: list[torch.Tensor | None] = [None] * len(sequences)
        bar = _Progress(len(sequences), progress, every=max(1, batch_size))
        for lo in range(0, len(order), batch_size):
            picks = order[lo:lo + batch_size]
            width = max(len(sequences[i][0]) for i in picks)
            rows = torch.zeros(len(picks), width, dtype=torch.long)
            for r, i in enumerate(picks):
                rows[r, :len(sequences[i][0])] = torch.tensor(sequences[i][0])
            out = target_features(target, rows.to(device), layer_ids).to("cpu", torch.bfloat16)
            for r, i in enumerate(picks):
                feats[i] = out[r, :len(sequences[i][0])]
            bar.update(min(lo + batch_size, len(order)), f"batch width {width}")
        bar.close()
        lengths = [len(ids) for ids, _ in sequences]
        offsets = torch.tensor([0] + lengths).cumsum(0)
        return cls(torch.tensor([t for ids, _ in sequences for t in ids], dtype=torch.long),
                   torch.cat(feats), offsets, torch.tensor([s for _, s in sequences]),
                   list(layer_ids))

    def save(self, file: str | Path) -> None:
        torch.save(dataclasses.asdict(self), str(file) + ".tmp")
        os.replace(str(file) + ".tmp", file)

    @classmethod
    def load(cls, file: str | Path) -> FeatureCache:
        return cls(**torch.load(file, weights_only=False))

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[lo:hi], self.features[lo:hi], int(self.starts[i])


class _CachedBatches:
    """(tokens [N, L], anchors [N, A], features [N, L, n*H], lengths [N]) from a FeatureCache.

    Each row is one whole sequence (cut to L, padded after its end); anchors lie in its
    answer, a block's root at or after the last prompt token, labels past the end ignored."""

    def __init__(self, cache: FeatureCache, options: TrainOptions, generator: torch.Generator,
                 device: torch.device):
        self.cache, self.options, self.generator, self.device = cache, options, generator, device
        self.pool = None  # checkpoint compatibility with _Batches

    def rows(self, picks: list[int], anchor_generator: torch.Generator):
        opts = self.options
        L, A = opts.seq_len, opts.anchors
        width = self.cache.features.shape[1]
        tokens = torch.full((len(picks), L), 0, dtype=torch.long)
        feats = torch.zeros(len(picks), L, width, dtype=torch.bfloat16)
        lengths = torch.zeros(len(picks), dtype=torch.long)
        anchors = torch.zeros(len(picks), A, dtype=torch.long)
        for r, i in enumerate(picks):
            ids, f, start = self.cache.sequence(i)
            n = min(len(ids), L)
            tokens[r, :n], feats[r, :n], lengths[r] = ids[:n], f[:n], n
            low, high = max(1, start - 1), n - 2  # root a >= 1 has context; one label inside
            choices = max(1, high - low + 1)
            pick = (torch.randperm(choices, generator=anchor_generator)[:A] if A <= choices
                    else torch.randint(0, choices, (A,), generator=anchor_generator))
            anchors[r] = (pick + low).clamp_max(max(low, high))
        return (tokens.to(self.device), anchors.to(self.device), feats.to(self.device),
                lengths.to(self.device))

    def next(self):
        picks = torch.randint(0, len(self.cache), (self.options.batch_size,),
                              generator=self.generator).tolist()
        return self.rows(picks, self.generator)


def loss_terms(drafter: Drafter, target: Any, tokens: torch.Tensor, anchors: torch.Tensor,
               gamma: float, features: torch.Tensor | None = None,
               lengths: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Weighted CE of the base and corrected logits, and teacher-forced accept lengths.

    features: cached target features [N, L, n*H] (None: run the target on tokens);
    lengths: [N] valid tokens per row (None: every row is full)."""
    if features is None:
        features = target_features(target, tokens, drafter.config.target_layer_ids)
    h = drafter(features, tokens.gather(1, anchors), anchors)
    base, corrected = block_logits(drafter, h, tokens, anchors)
    labels = block_labels(tokens, anchors, drafter.num_slots, lengths)
    weights = torch.exp(-torch.arange(drafter.num_slots, dtype=torch.float32,
                                      device=tokens.device) / gamma)
    out = {"ce_base": _weighted_ce(base, labels, weights)}
    with torch.no_grad():
        out["accept_base"] = _accept_length(base, labels)
    if corrected is not None:
        out["ce_corrected"] = _weighted_ce(corrected, labels, weights)
        with torch.no_grad():
            out["accept_corrected"] = _accept_length(corrected, labels)
    return out


def _check_target(target: Any) -> None:
    target_io(target)
    _decoder_layers(target)


def _save_checkpoint(folder: Path, drafter: Drafter, optimizer: torch.optim.Optimizer,
                     batches: _Batches, step: int, options: TrainOptions,
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


def _check_cache(cache: FeatureCache, options: TrainOptions, vocab: int) -> None:
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


def _load_init(drafter: Drafter, init: str | Path, target: Any) -> None:
    start = load_drafter(init, target)

    def same(a: Any, b: Any) -> bool:  # a saved float (rms_norm_eps) went through float32
        return math.isclose(a, b, rel_tol=1e-6) if isinstance(a, float) else a == b

    mismatched = [f.name for f in dataclasses.fields(drafter.config)
                  if not same(getattr(start.config, f.name), getattr(drafter.config, f.name))]
    if mismatched:
        raise ValueError(f"init drafter {init} does not have the shape the options give: "
                         f"{', '.join(mismatched)} differ")
    with torch.no_grad():
        drafter.load_state_dict({k: v.float() for k, v in start.state_dict().items()})
    drafter.refresh_input_table()


def train_drafter(target: Any, data: TokenStream | torch.Tensor, options: TrainOptions,
                  output: str | Path | None = None, progress: bool = True,
                  init: str | Path | None = None) -> tuple[Drafter, dict[str, Any]]:
    """Train a drafter (+ Domino head) for the frozen ``target`` on ``data``.

    target: a transformers causal LM (decoder layers at ``model.model.layers``), any device;
    data: a TokenStream or a 1-D LongTensor of token ids in the target's vocabulary, or a
    FeatureCache (sequences with precomputed target features: the target is never run).
    Writes the drafter with :func:`dartree.save_drafter` into ``output`` when given.
    ``init``: a drafter folder to start from instead of a random init (fine-tuning on new data;
    its shape must be the one ``options`` gives); a resumed checkpoint takes precedence.
    Returns (drafter in eval mode, info: ``step``, ``loss`` (last), ``losses`` (one per step),
    ``smoothed`` (running means of every loss term), ``tokens``, ``seconds``,
    ``tokens_per_second``).
    """
    options.validate()
    _check_target(target)
    vocab = target_io(target)[0].weight.shape[0]
    if isinstance(data, FeatureCache):
        _check_cache(data, options, vocab)
    else:
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
    gamma = options.gamma or default_gamma(options.block_size)
    params = [p for p in drafter.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": options.weight_decay},
                                   {"params": other, "weight_decay": 0.0}],
                                  lr=options.lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(options.seed)
    batches = (_CachedBatches(data, options, generator, device) if isinstance(data, FeatureCache)
               else _Batches(target, data, options, generator, device))
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

    bar = _Progress(options.steps, progress)
    smooth: dict[str, float] = dict(info.get("smoothed", {}))
    tick = time.perf_counter()
    try:
        while step < options.steps:
            tokens, anchors, features, lengths = batches.next()
            lam = _lambda_at(options, step)
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(options, step)
            with torch.autocast(tokens.device.type, torch.bfloat16, enabled=options.bf16):
                terms = loss_terms(drafter, target, tokens, anchors, gamma, features, lengths)
            loss = terms["ce_base"]
            if "ce_corrected" in terms:
                loss = (1 - lam) * terms["ce_corrected"] + lam * terms["ce_base"]
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


@torch.no_grad()
def evaluate(drafter: Drafter, target: Any, windows: torch.Tensor, options: TrainOptions,
             batch_size: int = 8, seed: int = 1234) -> dict[str, float]:
    """Mean weighted CE and teacher-forced accept lengths on ``windows`` [M, L] (fixed anchors).

    With ``options.self_distill`` each window's tail is replaced by the target's greedy
    continuation first (what the drafter must predict at temperature 0).
    """
    gamma = options.gamma or default_gamma(drafter.block_size)
    device = drafter.device
    generator = torch.Generator().manual_seed(seed)
    k, L = drafter.num_slots, windows.shape[1]
    totals: dict[str, float] = {}
    count = 0
    drafter.eval()
    for i in range(0, len(windows), batch_size):
        tokens = windows[i:i + batch_size].to(device).long()
        low = 1
        if options.self_distill:
            prompt = L - options.distill_new_tokens
            tokens = greedy_continue(target, tokens[:, :prompt], options.distill_new_tokens)
            low = prompt - 1
        choices = L - 1 - k - low + 1
        anchors = torch.stack([torch.randperm(choices, generator=generator)[:options.anchors]
                               for _ in range(len(tokens))]) + low
        terms = loss_terms(drafter, target, tokens, anchors.to(device), gamma)
        for key, value in terms.items():
            totals[key] = totals.get(key, 0.0) + value.item() * len(tokens)
        count += len(tokens)
    return {key: round(value / count, 4) for key, value in totals.items()}


@torch.no_grad()
def evaluate_cached(drafter: Drafter, target: Any, cache: FeatureCache, options: TrainOptions,
                    batch_size: int = 8, seed: int = 1234) -> dict[str, float]:
    """Mean weighted CE and teacher-forced accept lengths over every sequence of ``cache``
    (anchors drawn with a fixed seed inside each answer)."""
    gamma = options.gamma or default_gamma(drafter.block_size)
    batches = _CachedBatches(cache, options, torch.Generator(), drafter.device)
    anchor_generator = torch.Generator().manual_seed(seed)
    totals: dict[str, float] = {}
    drafter.eval()
    for i in range(0, len(cache), batch_size):
        picks = list(range(i, min(i + batch_size, len(cache))))
        tokens, anchors, features, lengths = batches.rows(picks, anchor_generator)
        terms = loss_terms(drafter, target, tokens, anchors, gamma, features, lengths)
        for key, value in terms.items():
            totals[key] = totals.get(key, 0.0) + value.item() * len(picks)
    return {key: round(value / len(cache), 4) for key, value in totals.items()}


# --------------------------------------------------------------------------------------------
# Command line: `dartree train-drafter`
# --------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one layer id")
    return values


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``train-drafter`` on an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "train-drafter", help="train a DFlash drafter + Domino head for a target",
        description="Train a DFlash block-diffusion drafter with a Domino head for a frozen "
                    "transformers causal LM, and write it as a dartree drafter folder.")
    p.add_argument("--target", required=True, help="target model folder (transformers layout)")
    p.add_argument("--corpus", required=True, nargs="+",
                   help="text/code files, folders (walked recursively) or .jsonl files")
    p.add_argument("--output", required=True, help="drafter folder to write")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the target folder)")
    p.add_argument("--layers", type=int, default=1, help="drafter decoder layers")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--target-layer-ids", type=_int_list, default=None,
                   help="target layers read as features, e.g. 1,9,17 (default: DFlash's)")
    p.add_argument("--no-domino", dest="domino", action="store_false",
                   help="plain DFlash drafter without the Domino head")
    p.add_argument("--emb-dim", type=int, default=None, help="Domino rank r (default min(256, H))")
    p.add_argument("--gru-hidden-dim", type=int, default=None,
                   help="Domino GRU width G (default min(1024, H))")
    p.add_argument("--no-shift-label", dest="shift_label", action="store_false",
                   help="read slots 1..B-1 (plain DFlash) instead of 0..B-1")
    p.add_argument("--prefix-len", type=int, default=1, help="Domino P: uncorrected first slots")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="default: the tokenizer's mask token, else V - 1")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--anchors", type=int, default=16, help="blocks per sequence")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--gamma", type=float, default=None, help="slot loss decay (default DFlash's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--self-distill", action="store_true",
                   help="train on the target's greedy continuations of corpus prompts")
    p.add_argument("--distill-new-tokens", type=int, default=128)
    p.add_argument("--distill-batches", type=int, default=8,
                   help="self-distill: steps' worth of continuations generated at once")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where to checkpoint and resume (default: OUTPUT/checkpoint)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--no-resume", dest="resume", action="store_false")
    p.add_argument("--init", default=None,
                   help="a drafter folder to start from (fine-tuning) instead of a random init")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(run=run_train_command)
    return p


def run_train_command(args: argparse.Namespace) -> int:
    """Entry point of ``dartree train-drafter`` (args from :func:`add_train_parser`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    if not Path(args.target).is_dir():
        raise ValueError(f"--target {args.target} is not a folder")
    missing = [c for c in args.corpus if not Path(c).exists()]
    if missing:
        raise ValueError(f"--corpus path(s) not found: {', '.join(missing)}")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
    mask = args.mask_token_id
    if mask is None:
        mask = getattr(tokenizer, "mask_token_id", None)
    options = TrainOptions(
        num_layers=args.layers, block_size=args.block_size,
        target_layer_ids=args.target_layer_ids, domino=args.domino, emb_dim=args.emb_dim,
        gru_hidden_dim=args.gru_hidden_dim, shift_label=args.shift_label,
        prefix_len=args.prefix_len if args.domino else 0, mask_token_id=mask,
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        anchors=args.anchors, lr=args.lr, gamma=args.gamma, seed=args.seed,
        self_distill=args.self_distill, distill_new_tokens=args.distill_new_tokens,
        distill_batches=args.distill_batches,
        checkpoint_dir=args.checkpoint_dir or str(Path(args.output) / "checkpoint"),
        checkpoint_every=args.checkpoint_every, resume=args.resume)
    options.validate()
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    target = target.to(args.device).eval()
    ids = load_corpus(args.corpus, tokenizer)
    print(f"corpus: {len(ids)} tokens; target: {sum(p.numel() for p in target.parameters())} "
          f"parameters", file=sys.stderr)
    _, info = train_drafter(target, ids, options, output=args.output, init=args.init)
    print(f"wrote {args.output}: {info['step']} steps, loss {info['loss']:.4f}, "
          f"{info['tokens_per_second']:.0f} tokens/s, {info['seconds']:.0f}s", file=sys.stderr)
    return 0
