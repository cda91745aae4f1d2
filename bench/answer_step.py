#!/usr/bin/env python3
"""Where one decode step of the answer generator (dartree.train.answers) goes, and whether its
attention has a faster torch form.

    python bench/answer_step.py --threads 2 --slots 128 --span 160

Step: `_Stack.decode` of SmolLM2-135M-Instruct in bfloat16 for `--slots` slots whose cache holds
a seeded random number of rows below `--span`; timed (median, after warm-up), then split by
torch.profiler's self CPU time into the linear layers (aten::mm / addmm), attention (the
scaled-dot-product ops) and the rest.

Attention: one layer's decode attention at that shape (q [slots, Hkv, g, D], the cache's first
`span` rows, a per-slot length mask) as the generator runs it (SDPA with a boolean mask) against
an additive mask and a masked bmm in bfloat16 and in float32, each checked against float64.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from dartree import defaults
from dartree.bench.machine import cpu_model
from dartree.bench.timing import call_seconds
from dartree.train.answers import _Stack

ROOT = Path(__file__).resolve().parent.parent  # default output folders

LINEAR, ATTENTION = ("aten::mm", "aten::addmm"), "scaled_dot_product"


def step_split(stack: _Stack, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[float, dict]:
    """(median seconds of a decode step, share of its self CPU time per part)."""
    seconds = statistics.median(call_seconds(lambda: stack.decode(tokens, lengths), 5, warmup=2))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            stack.decode(tokens, lengths)
    parts = {"linear layers": 0.0, "attention": 0.0, "rest": 0.0}
    for event in prof.key_averages():
        part = ("linear layers" if event.key in LINEAR else
                "attention" if ATTENTION in event.key else "rest")
        parts[part] += event.self_cpu_time_total
    total = sum(parts.values())
    return seconds, {k: v / total for k, v in parts.items()}


def attention_forms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    scale: float) -> dict:
    """name -> the call, for one layer's decode attention (visible: bool [B, 1, 1, span])."""
    additive = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))

    def bmm(dtype):
        scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)).float() * scale
        probs = scores.masked_fill_(~visible, float("-inf")).softmax(-1).to(dtype)
        return torch.matmul(probs, v.to(dtype)).to(q.dtype)

    return {"SDPA, boolean mask (the generator's)":
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale),
            "SDPA, additive mask":
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=scale),
            "masked bmm, bfloat16": lambda: bmm(torch.bfloat16),
            "masked bmm, float32": lambda: bmm(torch.float32)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--span", type=int, default=160, help="cache rows a step reads (max)")
    parser.add_argument("--out", type=Path, default=None,
                        help="Markdown file (default bench/results/answer_step_<cpu>.md)")
    args = parser.parse_args()
    if args.slots < 1 or args.span < 2:
        parser.error("--slots must be >= 1 and --span >= 2")
    torch.set_num_threads(args.threads)
    model, _ = defaults.load_smollm2(device="cpu", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    stack = _Stack(model, args.slots, args.span)
    tokens = torch.randint(0, model.config.vocab_size, (args.slots,), generator=gen)
    lengths = torch.randint(args.span // 3, args.span - 1, (args.slots,), generator=gen)
    lengths[0] = args.span - 1  # the longest slot sets the rows every slot reads
    with torch.no_grad():
        seconds, parts = step_split(stack, tokens, lengths)
        g, d = stack.heads // stack.kv_heads, stack.head_dim
        q = torch.randn(args.slots, stack.kv_heads, g, d, generator=gen).to(torch.bfloat16)
        k, v = (torch.randn(args.slots, stack.kv_heads, args.span, d, generator=gen)
                .to(torch.bfloat16) for _ in range(2))
        visible = (torch.arange(args.span) <= lengths[:, None])[:, None, None]
        reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                   attn_mask=visible, scale=stack.scaling)
        forms = []
        for name, call in attention_forms(q, k, v, visible, stack.scaling).items():
            ms = statistics.median(call_seconds(call, 10, warmup=2)) * 1e3
            error = (call().double() - reference).abs().max().item()
            forms.append((name, ms, error))

    cpu = cpu_model()
    out = args.out or ROOT / "bench" / "results" / \
        f"answer_step_{cpu.lower().replace(' ', '_').replace('(r)', '')}.md"
    lines = [f"# One decode step of the answer generator: SmolLM2-135M-Instruct, bfloat16, "
             f"{args.threads} threads", "", f"Machine: {cpu}, torch {torch.__version__}",
             f"Command: `python bench/answer_step.py {' '.join(sys.argv[1:])}`", "",
             f"{args.slots} slots, cache rows per slot drawn in [{args.span // 3}, {args.span - 1}) "
             f"(one at {args.span - 1}): a step takes **{seconds * 1e3:.1f} ms** "
             f"({args.slots / seconds:.0f} tokens/s).", "",
             "| part (torch.profiler self CPU time, 3 steps) | share |", "|---|---|"]
    lines += [f"| {name} | {share:.0%} |" for name, share in parts.items()]
    lines += ["", f"One layer's attention at that shape ({stack.kv_heads} kv heads x {g} query "
              f"rows, head dim {d}, {args.span} rows), median of 10 calls after 2:", "",
              "| form | ms | max abs error vs float64 |", "|---|---|---|"]
    lines += [f"| {name} | {ms:.2f} | {error:.1e} |" for name, ms, error in forms]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
