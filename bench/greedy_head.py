"""Greedy verify with the int8-bounded output layer against the whole float32 product, side by
side, on the default target (SmolLM2-135M packed, float32) and real text: the rows of a chain that
continues an edit request's own prompt.

    python -m bench.greedy_head [--rows 1,2,8,9,16,17] [--prefix 200] [--repeat 20] [--threads 2]

Per row count T: the output layer alone (packed_linear + argmax, against ops.greedy_head on the
same final hidden states) and the whole verify (`verify(tree, greedy=False)` + argmax against
`verify(tree, greedy=True)`), medians of --repeat calls taken in turns, in milliseconds, and their
ratio. The tokens of both are checked equal.
"""

import argparse
import statistics
import time

import torch

import dartree
from dartree import greedy_head, ops
from dartree.bench.encode import encode_prompts
from dartree.bench.machine import cpu_model
from dartree.edits import edits
from dartree.sampling import Sampling
from dartree.target import TargetModel
from dartree.tree import DraftTree


def medians(calls, repeat):
    """The median seconds of each call, the calls taken in turns (one slow moment hits all alike)."""
    times = [[] for _ in calls]
    for _ in range(repeat):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,8,9,16,17")
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _, tok = dartree.default_models(dtype=torch.float32)
    if not greedy_head.applies(target.get_output_embeddings(), torch.float32):
        raise SystemExit("greedy_head takes the whole product here (no AVX512-VNNI, or DARTREE_EXACT_ISA "
                         "below avx512): nothing to compare")
    # the last layer's output (after the final norm) as the feature: the output layer's input
    model = TargetModel(target, feature_layers=[target.config.num_hidden_layers - 1], compile=False)
    ids = torch.as_tensor(encode_prompts(edits(1), tok, target.config.vocab_size, 4096)[0])
    rows = [int(r) for r in args.rows.split(",")]
    if args.prefix + max(rows) > ids.numel():
        raise SystemExit(f"--prefix {args.prefix} + {max(rows)} rows passes the prompt's {ids.numel()} tokens")
    model.allocate(args.prefix + max(rows) + 8)
    model.prefill(ids[:args.prefix])
    model.prepare_greedy()
    head, layer = model._greedy_head(), target.get_output_embeddings()
    print(f"{cpu_model()}, float32, {args.threads} threads, SmolLM2-135M packed (output layer "
          f"{layer.qtype}), prefix {args.prefix}, medians of {args.repeat}")
    print(f"{'T':>3} {'head ms':>8} {'int8 ms':>8} {'ratio':>6} {'verify ms':>10} {'greedy ms':>10} {'ratio':>6}")
    for size in rows:
        tree = DraftTree.chain(ids[args.prefix:args.prefix + size])

        def verify(greedy):
            out, hidden = model.verify(tree, check=False, greedy=greedy)
            model.commit(torch.zeros(1, dtype=torch.int64), check=False)
            model.cache.length = args.prefix
            return (out if greedy else Sampling().tokens(out, tree.depths)), hidden

        want, x = verify(False)
        whole = lambda: ops.sample_keyed(layer(x), torch.zeros(size, dtype=torch.int64), 0, 0.0)
        if not (torch.equal(verify(True)[0], want) and torch.equal(head(x), want) and torch.equal(whole(), want)):
            raise SystemExit(f"T {size}: greedy tokens differ from the whole product's")
        a, b, c, d = medians([whole, lambda: head(x), lambda: verify(False), lambda: verify(True)], args.repeat)
        print(f"{size:3d} {a * 1e3:8.3f} {b * 1e3:8.3f} {b / a:6.3f} {c * 1e3:10.2f} {d * 1e3:10.2f} {d / c:6.3f}")


if __name__ == "__main__":
    main()
