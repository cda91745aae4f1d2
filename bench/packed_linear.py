"""packed_linear on SmolLM2-135M's layer shapes, every GGUF block type, few rows; optionally side by
side with another checkout's build.

    python bench/packed_linear.py [--types Q4_0,Q4_1] [--rows 1,5] [--threads 2] [--rounds 3]
    python bench/packed_linear.py --against /path/to/other/checkout   # its dartree/ as built there

Random blocks (finite scales), float32 activations. Each figure is the fastest call of --rounds
rounds of --calls back-to-back calls. With --against, the two builds run in turns (this one, then
the other, --rounds times, one child process each: the two extensions register the same op names),
so both see the same machine state; the table gives both times and their ratio.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
SHAPES = [("q/o 576x576", 576, 576), ("gate/up 1536x576", 1536, 576), ("down 576x1536", 576, 1536)]  # name, N, K
ROOT = Path(__file__).resolve().parents[1]

# The child: times one build. argv: package root (or "" for the one installed), then the options
# as JSON. Prints {key: microseconds}. The other build's dartree must win over an editable install
# of this one, whose import hook sits on sys.meta_path.
_CHILD = r"""
import json, sys, time
root, opts = sys.argv[1], json.loads(sys.argv[2])
if root:
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, root)
import torch
import dartree
from dartree import gguf_blocks
if root and not dartree.__file__.startswith(root):
    raise SystemExit(f"imported {dartree.__file__}, not the build under {root}")
torch.set_num_threads(opts["threads"])
out = {}
for qtype in opts["types"]:
    block = gguf_blocks.block_type(qtype)
    for name, n, k in opts["shapes"]:
        k = -(-k // block.block_size) * block.block_size  # K-quants: a whole number of blocks
        g = torch.Generator().manual_seed(0)
        packed = torch.randint(0, 256, (n, gguf_blocks.row_bytes(qtype, k)), generator=g, dtype=torch.uint8)
        fields = packed.view(-1, block.type_size)
        for offset in opts["f16_fields"][qtype]:
            half = (torch.randn(fields.shape[0], generator=g) * 0.02).to(torch.float16)
            fields[:, offset:offset + 2] = half.view(torch.uint8).reshape(-1, 2)
        for m in opts["rows"]:
            x = torch.randn(m, k, generator=g)
            call = lambda: torch.ops.dartree.packed_linear.default(x, packed, block.ggml_type, k, None)
            for _ in range(5):
                call()
            t0 = time.perf_counter()
            for _ in range(opts["calls"]):
                call()
            out[f"{qtype}|{name}|{m}"] = (time.perf_counter() - t0) / opts["calls"] * 1e6
print(json.dumps(out))
"""

# offsets of each block type's float16 fields (set to finite halves: random bits may be NaN)
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def run_build(root: str, opts: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, root, json.dumps(opts)], check=True,
                          capture_output=True, text=True)
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
    args = parser.parse_args()
    types = args.types.split(",")
    unknown = [t for t in types if t not in TYPES]
    if unknown:
        parser.error(f"--types: {unknown} not among {TYPES}")
    opts = {"types": types, "rows": [int(r) for r in args.rows.split(",")], "threads": args.threads,
            "calls": args.calls, "shapes": SHAPES, "f16_fields": F16_FIELDS}
    other = str(Path(args.against).resolve()) if args.against else None
    if other and not any((Path(other) / "dartree").glob("_C*.so")):
        parser.error(f"--against {other}: no built dartree/_C*.so there")
    this_runs, other_runs = [], []
    start = time.time()
    for r in range(args.rounds):
        this_runs.append(run_build("", opts))
        if other:
            other_runs.append(run_build(other, opts))
        print(f"round {r + 1}/{args.rounds} done ({time.time() - start:.0f} s)", file=sys.stderr)
    best = lambda runs, key: min(run[key] for run in runs)
    print(f"{cpu_model()}, float32 activations, {args.threads} threads, torch {torch.__version__}; "
          f"fastest of {args.rounds} rounds x {args.calls} calls, microseconds per call")
    if other:
        print(f"this: {ROOT}; other: {other}\n")
        print("| type | shape | M | other µs | this µs | other / this |\n|---|---|---|---|---|---|")
    else:
        print("\n| type | shape | M | µs | weights G/s |\n|---|---|---|---|---|")
    for key in this_runs[0]:
        qtype, name, m = key.split("|")
        mine = best(this_runs, key)
        if other:
            theirs = best(other_runs, key)
            print(f"| {qtype} | {name} | {m} | {theirs:.1f} | {mine:.1f} | **{theirs / mine:.2f}x** |")
        else:
            n, k = next((n, k) for label, n, k in SHAPES if label == name)
            print(f"| {qtype} | {name} | {m} | {mine:.1f} | {n * k / mine / 1e3:.1f} |")


if __name__ == "__main__":
    main()
