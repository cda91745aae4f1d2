"""Batch-invariant linear (dartree.ops.exact_linear) against the vendor GEMM (F.linear), side by side.

    python bench/exact_linear.py [--dtype bfloat16] [--threads N] [--repeat 20]

For each SmolLM2-135M shape (K x N) and M in 1, 16, 32, 64: fastest of --repeat runs of both (robust on a shared machine), their ratio, and at
M = 1 the weight bandwidth achieved (the weights are read once; decode is memory-bound).
"""

import argparse

import torch
import torch.nn.functional as F

from dartree import ops
from dartree.bench.machine import cpu_model
from dartree.bench.timing import call_seconds

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]  # (K, N)
ROWS = [1, 16, 32, 64]


def fastest_seconds(fn, repeat):
    return min(call_seconds(fn, repeat, warmup=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"{cpu_model()}, {args.dtype}, {args.threads} threads, torch {torch.__version__}")
    print(f"{'K x N':>12} {'M':>3} {'F.linear us':>12} {'exact us':>10} {'exact/F':>8} {'exact GB/s':>11} {'F GB/s':>7}")
    with torch.inference_mode():
        for k, n in SHAPES:
            w = (torch.randn(n, k) / k ** 0.5).to(dtype)
            for m in ROWS:
                x = torch.randn(m, k).to(dtype)
                vendor = fastest_seconds(lambda: F.linear(x, w), args.repeat)
                exact = fastest_seconds(lambda: ops.exact_linear(x, w), args.repeat)
                bw = ""
                if m == 1:
                    gb = w.numel() * w.element_size() / 1e9
                    bw = f"{gb / exact:11.1f} {gb / vendor:7.1f}"
                print(f"{k:>5} x {n:<5} {m:>3} {vendor * 1e6:12.1f} {exact * 1e6:10.1f} "
                      f"{exact / vendor:8.2f} {bw}")


if __name__ == "__main__":
    main()
