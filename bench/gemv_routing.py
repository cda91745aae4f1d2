"""The GEMV routing (dartree.linear_routing.gemv_rows) against the vendor GEMM, side by side, on a
SmolLM2-135M-shaped target (random weights) and a random one-layer drafter.

    python bench/gemv_routing.py [--dtype float32] [--threads N] [--rows 1,5,16,32] [--repeat 8]

Rows: the target's verify of a chain of that many tokens after a 256-token prefix, with calls of up
to --gemv-rows rows (default: what `gemv_rows` picks for this machine and dtype) on
ops.exact_linear, against every call on F.linear; "drafter": the drafter's block pass plus its base
logits for 16 slots (the draft stage), with and without `gemv_linears`. Fastest of --repeat runs
after warm-up, the two paths alternated --rounds times (a shared machine drifts). Speed only: the
routing changes no guarantee (exact mode keeps its own kernels either way).
"""

import argparse
import contextlib
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from dartree.bench.machine import cpu_model
from dartree.bench.timing import call_seconds
from dartree.defaults import SMOLLM2_135M_SHAPE
from dartree.testing import random_drafter
from dartree.hardware import vendor
from dartree.linear_routing import _SmallRowsLinear, gemv_rows
from dartree.target import TargetModel
from dartree.tree import DraftTree


def fastest(calls: dict, repeat: int, rounds: int) -> dict:
    """{name: fastest seconds} of each call, the calls alternated `rounds` times."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            best[name] = min(best[name], min(call_seconds(call, repeat, warmup=2)))
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="1,5,16,32", help="tree sizes (a chain of that many tokens)")
    parser.add_argument("--gemv-rows", type=int, default=None,
                        help="route calls of up to this many rows (default: gemv_rows here)")
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype, cpu = getattr(torch, args.dtype), torch.device("cpu")
    routed = gemv_rows(dtype, cpu) if args.gemv_rows is None else args.gemv_rows
    if routed < 1:
        sys.exit(f"gemv_rows routes no {args.dtype} call on this CPU ({cpu_model()}, {vendor()}, "
                 f"{torch.backends.cpu.get_cpu_capability()}): pass --gemv-rows N to measure it anyway")
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M_SHAPE)).to(dtype).eval()
    drafter = random_drafter(model, num_layers=1, block_size=16)
    target = TargetModel(model, feature_layers=drafter.target_layer_ids)
    sizes = [int(r) for r in args.rows.split(",")]
    target.allocate(args.prefix + max(sizes))
    g = torch.Generator().manual_seed(0)
    vocab = SMOLLM2_135M_SHAPE["vocab_size"]
    print(f"{cpu_model()} ({vendor()}, {torch.backends.cpu.get_cpu_capability()}), {args.dtype}, "
          f"{args.threads} threads, torch {torch.__version__}; SmolLM2-135M shape, random weights, "
          f"prefix {args.prefix}; routed: calls of <= {routed} rows")
    print(f"{'stage':>9} {'routed ms':>10} {'GEMM ms':>8} {'routed/GEMM':>12}")
    with torch.inference_mode():
        _, features = target.prefill(torch.randint(0, vocab, (args.prefix,), generator=g))
        for rows in sizes:
            tree = DraftTree.chain(torch.randint(0, vocab, (rows,), generator=g))

            def verify(limit):
                target._gemv_rows = limit
                target.verify(tree, check=False)

            best = fastest({"routed": lambda: verify(routed), "gemm": lambda: verify(0)},
                           args.repeat, args.rounds)
            _row(f"verify {rows}", best)
        drafter.reset(args.prefix + 64)
        start = args.prefix - 4  # each timed pass adds a round's 4 new feature rows to the context
        drafter.draft(features[:start], 17, start)

        def draft(routing):
            drafter.ctx_len = start
            with routing:
                drafter.draft_logits(drafter.draft(features[start:], 17, args.prefix))

        best = fastest({"routed": lambda: draft(_SmallRowsLinear(routed)),
                        "gemm": lambda: draft(contextlib.nullcontext())}, args.repeat, args.rounds)
        _row("drafter", best)


def _row(name, best):
    routed, gemm = 1e3 * best["routed"], 1e3 * best["gemm"]
    print(f"{name:>9} {routed:10.2f} {gemm:8.2f} {routed / gemm:12.2f}")


if __name__ == "__main__":
    main()
