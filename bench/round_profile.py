"""Where a round of the default pair goes: the target's verify of T rows and the drafter's pass,
each split by torch.profiler into its largest ops.

    python bench/round_profile.py [--threads 2] [--rows 1,5,16] [--slots 4] [--calls 20]
                                  [--dtype bfloat16] [--exact]

Default models (SmolLM2 packed on a CPU; --dtype: the activations', float32 by default; --exact:
the decoder as `dartree bench --exact` builds it); a random 300-token prefix. Verify: a chain of
T random tokens, verified --calls times (the cache is not committed, so each call sees the same
prefix). Draft: the engine's draft stage for a tree of --slots + 1 rows (2 new context rows a
round, the drafter's block pass, the draft logits of the first --slots slots and the Domino
projection), with the GEMV routing on as in the engine. Times are wall-clock means per call;
the op split is the profiler's self time per call (the profiler adds its own overhead).
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import dartree
from dartree.bench.machine import cpu_model
from dartree.linear_routing import gemv_linears
from dartree.tree import DraftTree


def split(prof, calls: int, top: int = 6) -> str:
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return ", ".join(f"{e.key} {e.self_cpu_time_total / calls / 1e3:.2f}" for e in ops)


def timed(fn, calls: int):
    for _ in range(3):
        fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        ms = (time.perf_counter() - start) / calls * 1e3
    return ms, prof


@torch.no_grad()
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="1,5,16", help="verify tree sizes T")
    parser.add_argument("--slots", type=int, default=4, help="draft slots (budget)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--exact", action="store_true", help="exact=True, as `dartree bench --exact`")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, drafter, _ = dartree.default_models(dtype=getattr(torch, args.dtype))
    dec = dartree.SpeculativeDecoder(target, drafter, method="dartree", budget=args.slots, exact=args.exact)
    g = torch.Generator().manual_seed(0)
    tm = dec.target
    tm.allocate(1024)
    tm.prefill(torch.randint(100, 40000, (300,), generator=g))
    vocab = "all" if drafter.draft_vocab is None else drafter.draft_vocab.numel()
    print(f"{cpu_model()}, {args.threads} threads, torch {torch.__version__}; {tm.dtype}, "
          f"exact={args.exact}, draft vocabulary {vocab}; ms per call, then the profiler's largest ops (self ms per call)")
    for rows in (int(r) for r in args.rows.split(",")):
        tree = DraftTree.chain(torch.randint(100, 40000, (rows,), generator=g))

        def verify():
            tm.verify(tree, check=False)
            tm._tree_size = None  # not committed: the next call sees the same prefix

        ms, prof = timed(verify, args.calls)
        print(f"verify {rows:>3} rows: {ms:6.2f} ms | {split(prof, args.calls)}")

    width = len(drafter.target_layer_ids) * drafter.config.hidden_size
    features = torch.randn(300 + 2 * (args.calls + 8), width, generator=g).to(drafter.dtype)
    bonus = torch.tensor([17])
    drafter.reset(1024)
    drafter.draft(features[:300], bonus, 300)
    position = [300]

    def draft():
        s = position[0] + 2
        with gemv_linears(drafter.dtype, drafter.device):
            hidden = drafter.draft(features[s - 2:s], bonus, s)[:args.slots]
            drafter.draft_logits(hidden)
            if drafter.head is not None:
                drafter.head.project(hidden)
        position[0] = s

    ms, prof = timed(draft, args.calls)
    print(f"draft {args.slots} slots:  {ms:6.2f} ms | {split(prof, args.calls)}")


if __name__ == "__main__":
    main()
