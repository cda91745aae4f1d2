"""Reproduce dartree's bundled default models from scratch: tokenizer, target, drafter.

    python scripts/make_default_models.py                      # everything, into dartree/models/
    python scripts/make_default_models.py --stage target       # tokenizer + target only
    python scripts/make_default_models.py --stage drafter      # drafter for an existing target

The corpus is the CPython standard library's ``.py`` sources of the running interpreter
(``sysconfig.get_paths()['stdlib']``, site-packages excluded). Test folders (``test/``,
``tests/``, ``idle_test/`` ...) are held out: never seen by the tokenizer, the target or the
drafter, and used to measure held-out losses. Every stage uses fixed seeds; ``metadata.json`` in
the output folder records the losses, steps, sizes and times.

1. tokenizer: byte-level BPE (``tokenizers``), 4096 ids; ``<|endoftext|>`` (id 0) separates files
   and is the EOS/BOS/pad token, ``<|mask|>`` (id 1) is the drafter's mask token.
2. target: a Qwen3-style causal LM (hidden 192, 4 layers, tied embeddings) trained with AdamW on
   random 512-token windows of the concatenated training files; saved with ``save_pretrained``.
3. drafter: a DFlash drafter + Domino head trained with ``dartree.train`` (block 16,
   shift_label, P = 1), saved with ``dartree.save_drafter``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "dartree" / "models"
HELD_OUT_DIRS = {"test", "tests", "idle_test"}
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>"]

TARGET_CONFIG = dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=48, intermediate_size=512,
                     max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=True)
TARGET_TRAIN = dict(steps=3000, batch=4, seq_len=512, lr=3e-3, warmup=30, min_lr_frac=0.05,
                    decay_frac=0.2, weight_decay=0.1, seed=0, eval_windows=64)

# drafter training: see dartree/train/options.py for the meaning of every field. curriculum=1.0:
# λ falls over the whole run, not the first half, so the base marginals stay anchored -- DARTree
# expands only the top-C tokens of the base logits (with 0.5 the base drifts and the Domino chain
# wins).
DRAFTER_TRAIN = dict(num_layers=1, block_size=16, target_layer_ids=[1, 2, 3], emb_dim=128,
                     gru_hidden_dim=256, steps=1500, batch=4, seq_len=256, anchors=16, lr=1.5e-3,
                     gamma=7.0, self_distill=True, distill_new_tokens=160, distill_batches=8, seed=0,
                     eval_windows=16, curriculum=1.0)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def stdlib_files(stdlib: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): every stdlib ``.py`` file, sorted, split on test dirs."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts[:-1]
        if any(p in SKIP_DIRS for p in parts):
            continue
        (held if any(p in HELD_OUT_DIRS for p in parts) else train).append(path)
    if not train:
        raise SystemExit(f"no .py files found under {root}")
    return train, held


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


# --------------------------------------------------------------------------------------------
# 1. Tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer(files: list[Path], out: Path):
    """Byte-level BPE over ``files``; saved as a transformers fast tokenizer in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator((read_text(f) for f in files), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   mask_token="<|mask|>", model_max_length=2048)
    fast.save_pretrained(out)
    return fast


def encode_files(tokenizer, files: list[Path]) -> torch.Tensor:
    """All files as one int32 stream, each file followed by EOS."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    texts = [read_text(f) for f in files]
    for chunk in range(0, len(texts), 64):
        for enc in tokenizer(texts[chunk:chunk + 64], add_special_tokens=False).input_ids:
            ids.extend(enc)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


# --------------------------------------------------------------------------------------------
# 2. Target
# --------------------------------------------------------------------------------------------


def build_target(tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB_SIZE, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **TARGET_CONFIG)
    return Qwen3ForCausalLM(config)


def eval_windows(stream: torch.Tensor, count: int, seq_len: int) -> torch.Tensor:
    """``count`` evenly spaced windows [count, seq_len + 1] of ``stream`` (deterministic)."""
    starts = torch.linspace(0, len(stream) - seq_len - 2, count).long()
    return torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()]).long()


@torch.no_grad()
def lm_loss(model, windows: torch.Tensor, batch: int = 8) -> float:
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        logits = model(input_ids=w[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 w[:, 1:].flatten(), reduction="sum")
        total, n = total + loss.item(), n + w[:, 1:].numel()
    model.train()
    return total / n


def decay_start(steps: int) -> int:
    return int(round(steps * (1 - TARGET_TRAIN["decay_frac"])))


def train_target(out: Path, stdlib: Path | None, ckpt: Path, steps: int | None) -> dict:
    from transformers import AutoTokenizer

    cfg = dict(TARGET_TRAIN)
    if steps is not None:
        cfg["steps"] = steps
    t0 = time.time()
    train_files, held_files = stdlib_files(stdlib)
    log(f"corpus: {len(train_files)} training files, {len(held_files)} held-out files")
    ckpt.mkdir(parents=True, exist_ok=True)
    if (ckpt / "tokens.pt").is_file():  # a resumed run: the same tokenizer and streams
        tokenizer = AutoTokenizer.from_pretrained(ckpt / "tokenizer")
        train_ids, held_ids = torch.load(ckpt / "tokens.pt").values()
    else:
        tokenizer = train_tokenizer(train_files, ckpt / "tokenizer")
        log(f"tokenizer: {len(tokenizer)} ids ({time.time() - t0:.0f}s)")
        train_ids = encode_files(tokenizer, train_files)
        held_ids = encode_files(tokenizer, held_files)
        torch.save({"train": train_ids, "held": held_ids}, ckpt / "tokens.pt")
    log(f"tokens: {len(train_ids)} training, {len(held_ids)} held out ({time.time() - t0:.0f}s)")

    torch.manual_seed(cfg["seed"])
    model = build_target(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: {n_params / 1e6:.2f}M parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                             {"params": other, "weight_decay": 0.0}],
                            lr=cfg["lr"], betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    step, train_time = 0, 0.0
    if (ckpt / "target.pt").is_file():
        state = torch.load(ckpt / "target.pt", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step, train_time = state["step"], state["train_time"]
        if state["steps"] != cfg["steps"] and step > min(decay_start(state["steps"]),
                                                         decay_start(cfg["steps"])):
            raise SystemExit(f"cannot resume at step {step} with {cfg['steps']} steps: the "
                             f"checkpoint ({state['steps']} steps) has started its decay")
        log(f"resumed target training at step {step}")

    def lr_at(i: int) -> float:
        """Warmup-stable-decay: linear warmup, constant, linear decay over the last
        ``decay_frac`` of the steps. The stable phase does not depend on the step count, so a
        run resumed with more or fewer steps (before the decay starts) equals a fresh run."""
        if i < cfg["warmup"]:
            return cfg["lr"] * (i + 1) / cfg["warmup"]
        start = decay_start(cfg["steps"])
        if i < start:
            return cfg["lr"]
        frac = (i - start) / max(1, cfg["steps"] - start)
        lo = cfg["min_lr_frac"]
        return cfg["lr"] * (1 - (1 - lo) * frac)

    L, B = cfg["seq_len"], cfg["batch"]
    model.train()
    ema, tick = None, time.time()
    while step < cfg["steps"]:
        starts = torch.randint(0, len(train_ids) - L - 1, (B,), generator=gen)
        batch = torch.stack([train_ids[s:s + L + 1] for s in starts.tolist()]).long()
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        now = time.time()
        train_time += now - tick
        tick = now
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 10 == 0 or step == cfg["steps"]:
            rate = step * B * L / max(train_time, 1e-9)
            log(f"target step {step}/{cfg['steps']} loss {ema:.3f} lr {lr_at(step - 1):.2e} "
                f"{rate:.0f} tok/s elapsed {train_time / 60:.1f} min")
        if step % 20 == 0 or step == cfg["steps"]:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "gen": gen.get_state(), "step": step, "train_time": train_time,
                        "steps": cfg["steps"]},
                       ckpt / "target.tmp")
            os.replace(ckpt / "target.tmp", ckpt / "target.pt")

    n_eval = cfg["eval_windows"]
    held_loss = lm_loss(model, eval_windows(held_ids, n_eval, L))
    train_loss = lm_loss(model, eval_windows(train_ids, n_eval, L))
    log(f"target: held-out loss {held_loss:.4f} (train windows {train_loss:.4f})")
    model.config.use_cache = True
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {
        "parameters": n_params,
        "config": TARGET_CONFIG,
        "train": cfg,
        "corpus": {"train_files": len(train_files), "held_out_files": len(held_files),
                   "train_tokens": len(train_ids), "held_out_tokens": len(held_ids),
                   "held_out_dirs": sorted(HELD_OUT_DIRS),
                   "python": sys.version.split()[0]},
        "held_out_loss": round(held_loss, 4),
        "train_loss": round(train_loss, 4),
        "train_seconds": round(train_time, 1),
        "tokens_seen": cfg["steps"] * B * L,
    }


# --------------------------------------------------------------------------------------------
# 3. Drafter
# --------------------------------------------------------------------------------------------


def train_default_drafter(target_dir: Path, out: Path, stdlib: Path | None, ckpt: Path,
                          steps: int | None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dartree import train as dtrain

    cfg = dict(DRAFTER_TRAIN)
    if steps is not None:
        cfg["steps"] = steps
    train_files, held_files = stdlib_files(stdlib)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokens = ckpt / "tokens.pt"
    if tokens.is_file():  # cached by the target stage (same tokenizer)
        train_ids, held_ids = torch.load(tokens).values()
    else:
        train_ids = encode_files(tokenizer, train_files)
        held_ids = encode_files(tokenizer, held_files)
    options = dtrain.TrainOptions(
        num_layers=cfg["num_layers"], block_size=cfg["block_size"],
        target_layer_ids=cfg["target_layer_ids"], emb_dim=cfg["emb_dim"],
        gru_hidden_dim=cfg["gru_hidden_dim"], steps=cfg["steps"], batch_size=cfg["batch"],
        seq_len=cfg["seq_len"], anchors=cfg["anchors"], lr=cfg["lr"], gamma=cfg["gamma"],
        self_distill=cfg["self_distill"], distill_new_tokens=cfg["distill_new_tokens"],
        seed=cfg["seed"], mask_token_id=tokenizer.mask_token_id, shift_label=True,
        distill_batches=cfg["distill_batches"], prefix_len=1, curriculum=cfg["curriculum"],
        checkpoint_dir=str(ckpt / "drafter"), checkpoint_every=20)
    t0 = time.time()
    drafter, info = dtrain.train_drafter(target, dtrain.TokenStream(train_ids), options,
                                         output=out)
    seconds = time.time() - t0
    windows = eval_windows(held_ids, cfg["eval_windows"], cfg["seq_len"])[:, :-1]
    held = {"greedy_continuations": dtrain.evaluate(drafter, target, windows, options,
                                                    batch_size=len(windows)),
            "corpus_text": dtrain.evaluate(drafter, target, windows,
                                           dataclasses.replace(options, self_distill=False))}
    log(f"drafter: held-out {held}")
    n_params = sum(p.numel() for p in drafter.parameters())
    return {"parameters": n_params, "train": cfg, "held_out": held,
            "final_train_loss": round(info["smoothed"]["loss"], 4),
            "train_seconds": round(info["seconds"], 1), "wall_seconds": round(seconds, 1),
            "tokens_per_second": round(info["tokens_per_second"], 1)}


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--stage", choices=["all", "target", "drafter"], default="all")
    parser.add_argument("--stdlib", type=Path, default=None, help="corpus root (default: stdlib)")
    parser.add_argument("--checkpoints", type=Path, default=Path("/tmp/dartree_default_ckpt"))
    parser.add_argument("--target-steps", type=int, default=None)
    parser.add_argument("--drafter-steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    meta_file = args.out / "metadata.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    target_dir, drafter_dir = args.out / "target", args.out / "drafter"
    if args.stage in ("all", "target"):
        meta["target"] = train_target(target_dir, args.stdlib, args.checkpoints,
                                      args.target_steps)
        meta["tokenizer"] = {"type": "byte-level BPE", "vocab_size": VOCAB_SIZE,
                             "special_tokens": SPECIAL_TOKENS}
        args.out.mkdir(parents=True, exist_ok=True)
        meta_file.write_text(json.dumps(meta, indent=2) + "\n")
    if args.stage in ("all", "drafter"):
        meta["drafter"] = train_default_drafter(target_dir, drafter_dir, args.stdlib,
                                                args.checkpoints, args.drafter_steps)
        meta_file.write_text(json.dumps(meta, indent=2) + "\n")
    for file in args.out.rglob("*"):  # safetensors writes 0600; installed data must be readable
        if file.is_file():
            file.chmod(0o644)
    log(f"wrote {meta_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
