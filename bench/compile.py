"""The target's verify compiled (TargetModel(compile=True): torch.compile, fullgraph) against eager,
side by side, on a SmolLM2-135M-shaped target (random weights): compile time, time per verify, and
how many verifies pay the compile back.

    python bench/compile.py [--device cpu] [--dtype float32] [--threads N] [--rows 5,16] [--cache 1024]
    python bench/compile.py --drafter [--dtype float32]   # the drafter's block pass instead (block 16)

Compile time is that of the first verifies of a fresh process at two prefix lengths (dynamo
specialises the prefix on the first call and makes it symbolic on the second; a third length must
not compile, and the script checks it). Fastest of --repeat runs after warm-up, the two paths
alternated --rounds times (a shared machine drifts). The compiled logits are not the eager bits
(inductor fuses and rounds differently): the largest difference is printed.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from dartree.bench.machine import cpu_model
from dartree.bench.timing import call_seconds
from dartree.defaults import SMOLLM2_135M_SHAPE
from dartree.testing import random_drafter
from dartree.compilation import graphs_compiled
from dartree.target import TargetModel
from dartree.tree import DraftTree


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="5,16", help="tree sizes (a chain of that many tokens)")
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--cache", type=int, default=1024, help="KV cache rows")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drafter", action="store_true",
                        help="time a random drafter's block pass (Drafter.draft, 1-3 new context rows)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    vocab = SMOLLM2_135M_SHAPE["vocab_size"]
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M_SHAPE), attn_implementation="sdpa")
    model = model.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    device = torch.device(args.device)
    if args.drafter:
        return time_drafter(model, args)
    targets = {c: TargetModel(model, feature_layers=[1], compile=c) for c in (False, True)}
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (args.prefix,), generator=g).to(device)
    root = torch.zeros(1, dtype=torch.long, device=device)
    print(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else cpu_model()}, {args.dtype}, {args.threads} threads, SmolLM2-135M shape, prefix "
          f"{args.prefix}, cache {args.cache} rows, torch {torch.__version__}")
    print(f"{'rows':>5} {'compile s':>10} {'eager ms':>9} {'compiled ms':>12} {'compiled/eager':>15} "
          f"{'max |dlogit|':>13} {'pays back after':>16}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            tree = DraftTree.chain(torch.randint(0, vocab, (rows,), generator=g).to(device))
            for target in targets.values():
                target.allocate(args.cache)
                target.prefill(prompt)
            compiled, eager = targets[True], targets[False]
            before = compiled.compile_seconds
            for step in range(3):  # three prefix lengths: compiles on the first two only
                graphs = graphs_compiled()
                compiled.verify(tree, check=False)
                compiled.commit(root, check=False)
                eager.verify(tree, check=False)
                eager.commit(root, check=False)
                print(f"  rows {rows}, prefix {compiled.seq_len - 1}: "
                      f"{graphs_compiled() - graphs} graph(s) compiled", flush=True)
            if graphs_compiled() != graphs:
                raise RuntimeError("the third prefix length compiled a graph: rounds would recompile")
            compile_s = compiled.compile_seconds - before
            diff = (compiled.verify(tree)[0].float() - eager.verify(tree)[0].float()).abs().max().item()
            best = {False: float("inf"), True: float("inf")}
            for _ in range(args.rounds):
                for c, target in targets.items():
                    seconds = call_seconds(lambda: target.verify(tree, check=False), args.repeat,
                                           warmup=2, device=device)
                    best[c] = min(best[c], min(seconds))
            saved = best[False] - best[True]
            payback = f"{compile_s / saved:.0f} verifies" if saved > 0 else "never"
            print(f"{rows:>5} {compile_s:10.1f} {1e3 * best[False]:9.2f} {1e3 * best[True]:12.2f} "
                  f"{best[True] / best[False]:15.2f} {diff:13.2e} {payback:>16}", flush=True)


def time_drafter(model, args):
    """Drafter.draft compiled against eager on a random drafter (block 16) for this target: a
    prefill-sized first call, then rounds of 1-3 new context rows (the dynamic dim)."""
    drafter = random_drafter(model, block_size=16)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    g = torch.Generator().manual_seed(0)
    rows = [args.prefix] + [1 + i % 3 for i in range(args.repeat + 2)]
    features = [torch.randn(n, width, generator=g).to(model.device, model.dtype) for n in rows]

    def run(compiled):  # seconds of each call
        drafter.reset(args.cache)
        position, seconds = 0, []
        for f in features:
            position += f.shape[0]
            seconds.append(call_seconds(lambda: drafter.draft(f, 5, position, compiled=compiled), 1,
                                        warmup=0, device=model.device)[0])
        return seconds

    print(f"{cpu_model() if model.device.type == 'cpu' else torch.cuda.get_device_name(model.device)}, "
          f"{args.dtype}, {args.threads} threads, drafter of the SmolLM2-135M shape (random, "
          f"block 16), first call {args.prefix} context rows, then 1-3")
    with torch.inference_mode():
        first = run(True)
        print(f"compiling calls: {', '.join(f'{s:.1f}' for s in first[:3])} s")
        best = {False: float("inf"), True: float("inf")}
        for _ in range(args.rounds):
            for compiled in best:
                best[compiled] = min(best[compiled], min(run(compiled)[3:]))
    print(f"draft pass: eager {1e3 * best[False]:.2f} ms, compiled {1e3 * best[True]:.2f} ms, "
          f"compiled/eager {best[True] / best[False]:.2f}")


if __name__ == "__main__":
    main()
