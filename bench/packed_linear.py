"""packed_linear on SmolLM2-135M's layer shapes, every GGUF block type, few rows; optionally side by
side with another checkout's build.

    python bench/packed_linear.py [--types Q4_0,Q4_1] [--rows 1,5] [--threads 2] [--rounds 3]
    python bench/packed_linear.py --against /path/to/other/checkout   # its dartree/ as built there
    python bench/packed_linear.py --dtype bfloat16                    # bfloat16 activations

Random blocks (`dartree.testing.random_packed`), activations of --dtype, built once here and saved
for the child processes that time them, so every build times the same tensors. Each figure is the
mean time per call of --calls back-to-back calls (after 5), the lowest over --rounds rounds. With
--against, the two builds run in turns (this one, then the other, --rounds times, one child process
each: the two extensions register the same op names), so both see the same machine state; the
table gives both times and their ratio.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dartree import gguf_blocks
from dartree.testing import random_packed

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
SHAPES = [("q/o 576x576", 576, 576), ("gate/up 1536x576", 1536, 576), ("down 576x1536", 576, 1536)]  # name, N, K
ROOT = Path(__file__).resolve().parents[1]

# The child: times one build on the inputs the parent saved. argv: package root (or "" for the one
# installed), the inputs file, the options as JSON. Prints {key: microseconds}. The other build's
# dartree must win over an editable install of this one, whose import hook sits on sys.meta_path.
_CHILD = r"""
import json, sys, time
root, inputs, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if root:  # root is first on PYTHONPATH (run_build)
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
import torch
import dartree
if root and not dartree.__file__.startswith(root):
    raise SystemExit(f"imported {dartree.__file__}, not the build under {root}")
torch.set_num_threads(opts["threads"])
out = {}
for key, (x, packed, ggml_type, k) in torch.load(inputs).items():
    call = lambda: torch.ops.dartree.packed_linear.default(x, packed, ggml_type, k, None)
    for _ in range(5):
        call()
    t0 = time.perf_counter()
    for _ in range(opts["calls"]):
        call()
    out[key] = (time.perf_counter() - t0) / opts["calls"] * 1e6
print(json.dumps(out))
"""


def make_inputs(types: list[str], rows: list[int], dtype: torch.dtype) -> dict:
    """{"type|shape|M": (x [M, K] of dtype, packed rows [N, bytes], GGML type number, K)}; K is the
    shape's, rounded up to whole blocks (the K-quants' 256)."""
    inputs = {}
    for qtype in types:
        block = gguf_blocks.block_type(qtype)
        for name, n, k in SHAPES:
            k = -(-k // block.block_size) * block.block_size
            packed = random_packed(qtype, n, k, seed=0)
            g = torch.Generator().manual_seed(1)
            for m in rows:
                inputs[f"{qtype}|{name}|{m}"] = (torch.randn(m, k, generator=g).to(dtype), packed, block.ggml_type, k)
    return inputs


def run_build(root: str, inputs: str, opts: dict) -> dict:
    env = dict(os.environ)
    if root:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    # cwd: `-c` puts the working directory first on sys.path, before PYTHONPATH
    done = subprocess.run([sys.executable, "-c", _CHILD, root, inputs, json.dumps(opts)], check=True,
                          capture_output=True, text=True, env=env, cwd=root or None)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    from dartree.bench.machine import cpu_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--rows", default="1,2,4,5,8,16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--against", default=None, help="another checkout whose dartree/ holds a built _C")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the activations' dtype (the output's too)")
    args = parser.parse_args()
    types = args.types.split(",")
    unknown = [t for t in types if t not in TYPES]
    if unknown:
        parser.error(f"--types: {unknown} not among {TYPES}")
    other = str(Path(args.against).resolve()) if args.against else None
    if other and not any((Path(other) / "dartree").glob("_C*.so")):
        parser.error(f"--against {other}: no built dartree/_C*.so there")
    opts = {"threads": args.threads, "calls": args.calls}
    inputs = make_inputs(types, [int(r) for r in args.rows.split(",")], getattr(torch, args.dtype))
    this_runs, other_runs = [], []
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        saved = str(Path(tmp) / "inputs.pt")
        torch.save(inputs, saved)
        for r in range(args.rounds):
            this_runs.append(run_build("", saved, opts))
            if other:
                other_runs.append(run_build(other, saved, opts))
            print(f"round {r + 1}/{args.rounds} done ({time.time() - start:.0f} s)", file=sys.stderr)
    best = lambda runs, key: min(run[key] for run in runs)
    print(f"{cpu_model()}, {args.dtype} activations, {args.threads} threads, torch {torch.__version__}; "
          f"microseconds per call: the lowest mean of {args.calls} calls over {args.rounds} rounds")
    if other:
        print(f"this: {ROOT}; other: {other}\n")
        print("| type | shape | M | other µs | this µs | other / this |\n|---|---|---|---|---|---|")
    else:
        print("\n| type | shape | M | µs | weights G/s |\n|---|---|---|---|---|")
    for key, (_, packed, _, k) in inputs.items():
        qtype, name, m = key.split("|")
        mine = best(this_runs, key)
        if other:
            theirs = best(other_runs, key)
            print(f"| {qtype} | {name} | {m} | {theirs:.1f} | {mine:.1f} | **{theirs / mine:.2f}x** |")
        else:
            print(f"| {qtype} | {name} | {m} | {mine:.1f} | {packed.shape[0] * k / mine / 1e3:.1f} |")


if __name__ == "__main__":
    main()
