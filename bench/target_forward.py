"""The target's verify through dartree's layer loop (dartree/decoder_stack.py) against the same call
through transformers' forward, side by side, on a SmolLM2-135M-shaped target (random weights).

    python bench/target_forward.py [--dtype bfloat16] [--threads N] [--exact] [--rows 1,16,32] [--repeat 10]

Both paths give the same bits (tests/test_decoder_stack.py); this measures what the loop saves:
transformers' per-call overhead (module dispatch, keyword plumbing, output objects) and, in exact mode
and for bfloat16 calls of <= 16 rows, the TorchFunctionMode that routes every linear layer. Fastest
of --repeat runs after warm-up, alternating the two paths --rounds times (a shared machine drifts).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from dartree.bench.machine import cpu_model
from dartree.bench.timing import call_seconds
from dartree.defaults import SMOLLM2_135M_SHAPE
from dartree.target import TargetModel
from dartree.tree import DraftTree


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--exact", action="store_true", help="TargetModel(exact=True)")
    parser.add_argument("--rows", default="1,16,32", help="tree sizes (a chain of that many tokens)")
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M_SHAPE), attn_implementation="sdpa")
    model = model.to(getattr(torch, args.dtype)).eval()
    target = TargetModel(model, feature_layers=[1], exact=args.exact)
    sizes = [int(r) for r in args.rows.split(",")]
    target.allocate(args.prefix + max(sizes))
    g = torch.Generator().manual_seed(0)
    target.prefill(torch.randint(0, SMOLLM2_135M_SHAPE["vocab_size"], (args.prefix,), generator=g))
    print(f"{cpu_model()}, {args.dtype}{' exact' if args.exact else ''}, {args.threads} threads, "
          f"SmolLM2-135M shape, prefix {args.prefix}")
    print(f"{'rows':>5} {'loop ms':>8} {'transformers ms':>16} {'loop/transformers':>18}")
    for rows in sizes:
        tree = DraftTree.chain(torch.randint(0, SMOLLM2_135M_SHAPE["vocab_size"], (rows,), generator=g))
        best = {None: float("inf"), "forced": float("inf")}
        for _ in range(args.rounds):
            for path in best:
                target._stack_unsupported = path  # None: the loop; a reason: transformers' forward
                seconds = call_seconds(lambda: target.verify(tree, check=False), args.repeat, warmup=2)
                best[path] = min(best[path], min(seconds))
        loop, hf = 1e3 * best[None], 1e3 * best["forced"]
        print(f"{rows:>5} {loop:8.2f} {hf:16.2f} {loop / hf:18.2f}")


if __name__ == "__main__":
    main()
