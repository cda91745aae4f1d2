"""Cost of bit-exactness: the target's verify pass with exact=True against the default (vendor GEMM
+ tree_attention) verify, side by side, on a SmolLM2-135M-shaped target (random weights: the cost
does not depend on them).

    python bench/exact_verify.py [--dtype bfloat16] [--threads N] [--prefix 256] [--repeat 10]

Rows: `ar` (the one-token step's verify, T=1; its commit is not timed) and verify at budgets 16,
32, 64 (a random tree of budget + 1 nodes after a prefix of --prefix tokens). Fastest of --repeat
runs of each after one warm-up (robust on a shared machine), in milliseconds, and their ratio.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from dartree.bench.machine import cpu_model
from dartree.bench.timing import call_seconds
from dartree.defaults import SMOLLM2_135M_SHAPE
from dartree.target import TargetModel
from dartree.tree import DraftTree


def random_tree(size, vocab, generator):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, size)]
    depths = [0] * size
    for i in range(1, size):
        depths[i] = depths[parents[i]] + 1
    tokens = torch.randint(0, vocab, (size,), generator=generator)
    return DraftTree(tokens=tokens, parents=torch.tensor(parents), depths=torch.tensor(depths),
                     scores=torch.zeros(size))


def time_verify(target, tree, repeat):
    return min(call_seconds(lambda: target.verify(tree, check=False), repeat, warmup=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--budgets", default="16,32,64")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M_SHAPE), attn_implementation="sdpa")
    model = model.to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, SMOLLM2_135M_SHAPE["vocab_size"], (args.prefix,), generator=g)
    targets = {"default": TargetModel(model, []), "exact": TargetModel(model, [], exact=True)}
    for target in targets.values():
        target.allocate(args.prefix + 80)
        target.prefill(prompt)
    print(f"{cpu_model()}, {args.dtype}, {args.threads} threads, SmolLM2-135M shape, prefix {args.prefix}")
    print(f"{'pass':>10} {'default ms':>11} {'exact ms':>9} {'exact/default':>14}")
    sizes = [("ar", 1)] + [(f"verify {b}", b + 1) for b in map(int, args.budgets.split(","))]
    for name, size in sizes:
        tree = random_tree(size, SMOLLM2_135M_SHAPE["vocab_size"], g)
        ms = {key: 1e3 * time_verify(t, tree, args.repeat) for key, t in targets.items()}
        print(f"{name:>10} {ms['default']:11.2f} {ms['exact']:9.2f} {ms['exact'] / ms['default']:14.2f}")


if __name__ == "__main__":
    main()
