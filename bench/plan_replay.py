"""The round planner replayed on the target's own answers, with verify costs measured once: a change
to the lookup, the candidate tree, the calibrator or the planner compared without the host's noise.

    python -m bench.plan_replay [--prompts edit,mtbench2,humaneval] [--limit 12] [--dtype float32]
                                [--seeds 6] [--noise 0.1] [--repeat 15] [--threads 2] [--save FILE]

On a shared 2-core host two runs of the same decoder a minute apart differ by 5-20% (a float32
SmolLM2 verify of 9 rows took 18.5 and 22.4 ms in two runs of one script), more than most changes
to the planning move. Here:
1. The target answers each prompt (greedy, `ngram`: the same tokens as `ar`); the two-turn sets'
   first turns are answered as the bench answers them.
2. verify(T) for T = 1 .. 33 rows (the largest `auto` tree on a CPU) is timed once (chains of real text after the sets' median prompt
   length, greedy as the decoder's rounds are, medians of --repeat calls taken in turns), and the
   rest of a round (the planning, accept, commit) is taken as --other ms (--ar-other for `ar`: float32
   SmolLM2 on the edit set, 0.5 and 0.2 ms measured).
3. Each set is replayed through the decoder's own `Lookup` (and its store), `CandidateTree`,
   `AcceptanceCalibrator` and `RoundPlanner` (method `ngram`, budget "auto"), one planner over the
   set as a decoder keeps it: a round verifies the tree the planner picks after the answer's tokens
   so far, accepts the longest path that the answer continues, and costs verify(T) + rest; the
   planner is told that cost times 1 + noise x Exp(1) (a shared host's bursts), one draw per round
   from --seeds seeds.
Printed per set: the modelled speedup over `ar` (verify(1) + its rest per token), the mean over seeds and
its range; rounds and verified rows; and the bound of perfect knowledge (each round verifies just the
longest accepted path among the same lookup continuations).

The figures compare versions of the planning on the same inputs (--save); they are not the speed a
run reaches: a verify timed back to back on one chain costs less than one in the decoding loop (float32
SmolLM2 on an EPYC Zen 4: 16.0 against 20.2 ms at 8 rows, 29.1 against 35.5 at 16), so the model runs
above `dartree bench` (edit: 2.26x modelled, 1.79-1.90x measured at 80dfbf5).
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

import dartree
from dartree.bench.config import BenchSettings
from dartree.bench.conversations import answer_first_turns
from dartree.bench.encode import encode_prompts
from dartree.bench.machine import cpu_model
from dartree.candidates import AcceptanceCalibrator, CandidateTree
from dartree.cost_model import RoundPlanner
from dartree.decoding import LOOKUP_BRANCHES, LOOKUP_DEPTH
from dartree.hardware import auto_max_nodes
from dartree.lookup import Lookup, LookupStore
from dartree.prompts import load_prompt_sets
from dartree.tree import DraftTree

MAX_ROWS = auto_max_nodes(torch.device("cpu")) + 1  # the largest tree budget="auto" verifies on a CPU, root counted


def verify_costs(decoder, prompts, repeat):
    """Seconds of a greedy verify of T = 1 .. MAX_ROWS rows (chains of the longest prompt's text) at
    the prompts' median length, medians of `repeat` calls taken in turns."""
    target = decoder.target
    prefix = int(statistics.median(len(p) for p in prompts))
    text = torch.as_tensor(max(prompts, key=len) * (1 + (prefix + MAX_ROWS) // min(len(p) for p in prompts)))
    target.allocate(prefix + MAX_ROWS + 1)
    target.prepare_greedy()
    target.prefill(text[:prefix])
    trees = {t: DraftTree.chain(text[prefix:prefix + t]) for t in range(1, MAX_ROWS + 1)}
    times = {t: [] for t in trees}
    for _ in range(repeat):
        for t, tree in trees.items():
            start = time.perf_counter()
            target.verify(tree, check=False, greedy=True)
            times[t].append(time.perf_counter() - start)
            target.commit(torch.zeros(1, dtype=torch.int64), check=False)
            target.cache.length = prefix
    return [0.0] + [statistics.median(times[t]) for t in trees]  # [rows] -> seconds


def accepted(cands, rows, answer):
    """The rows of the longest root path among `rows` (candidate nodes) that `answer` continues."""
    chosen = {node: row for row, node in enumerate(rows)}
    path, node = [0], 0
    for token in answer:
        child = cands.nodes[node].children.get(token)
        if child is None or child not in chosen:
            break
        node = child
        path.append(chosen[child])
    return path


def replay(prompts, answers, cost, other, noise, seed):
    """(seconds, rounds, rows verified) of the planner over the set, its costs told with noise."""
    rng, calibrator = random.Random(seed), AcceptanceCalibrator()
    planner, store = RoundPlanner(MAX_ROWS - 1, has_drafter=False), LookupStore()
    seconds, rounds, verified = 0.0, 0, 0
    for prompt, answer in zip(prompts, answers):
        lookup, i = Lookup(store=store), 1
        lookup.start(list(prompt) + answer[:1])
        while i < len(answer):
            cands = CandidateTree(answer[i - 1])
            cands.add_continuations(lookup.continuations(depth=min(planner.max_nodes, LOOKUP_DEPTH),
                                                         limit=LOOKUP_BRANCHES))
            curve = cands.expected_tokens(calibrator)
            size = planner.size(curve, False)
            _, rows = cands.select(size, "cpu")
            path = accepted(cands, rows, answer[i:])
            cands.observe(rows, path, calibrator)
            planner.record(len(rows), cost[len(rows)] * (1 + noise * rng.expovariate(1.0)), None, other)
            if size:
                planner.record_tokens(size, curve[size], len(path), False)
            seconds, rounds, verified = seconds + cost[len(rows)] + other, rounds + 1, verified + len(rows)
            lookup.extend(answer[i:i + len(path)])  # the accepted candidates and the bonus token
            i += len(path)
        lookup.finish(answer)
    return seconds, rounds, verified


def bound(prompts, answers, cost, other):
    """Seconds of perfect knowledge: each round verifies just the longest accepted path among the
    same lookup continuations (none: the bonus row alone)."""
    store, seconds = LookupStore(), 0.0
    for prompt, answer in zip(prompts, answers):
        lookup, i = Lookup(store=store), 1
        lookup.start(list(prompt) + answer[:1])
        while i < len(answer):
            found = lookup.continuations(depth=LOOKUP_DEPTH, limit=LOOKUP_BRANCHES)
            longest = max((_common(c.tokens, answer[i:]) for c in found), default=0)
            seconds += cost[longest + 1] + other
            lookup.extend(answer[i:i + longest + 1])
            i += longest + 1
        lookup.finish(answer)
    return seconds


def _common(a, b):
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def measure(args, exact):
    """The sets' prompts and the target's answers, and verify(T) on this machine."""
    target, _, tok = dartree.default_models(dtype=getattr(torch, args.dtype))
    decoder = dartree.SpeculativeDecoder(target, None, method="ngram", budget="auto", exact=exact)
    settings = BenchSettings(max_new_tokens=args.max_new_tokens, exact=exact)
    sets = {}
    for ps in load_prompt_sets(args.prompts, args.limit):
        ps = answer_first_turns(ps, target, tok, settings, tok.eos_token_id)
        prompts = encode_prompts(ps, tok, target.config.vocab_size, settings.max_prompt_tokens)
        answers = [decoder.generate(p, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id).tokens
                   for p in prompts]
        sets[ps.name] = prompts, answers
        print(f"{ps.name}: {len(prompts)} answers, {sum(map(len, answers))} tokens", flush=True)
    return sets, verify_costs(decoder, [p for prompts, _ in sets.values() for p in prompts], args.repeat)


def _inputs(args):
    """What the saved answers and costs depend on."""
    return dict(prompts=args.prompts, limit=args.limit, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                threads=args.threads, repeat=args.repeat)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="edit,mtbench2,humaneval")
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--other", type=float, default=0.5, help="ms of a speculative round besides its verify")
    parser.add_argument("--ar-other", type=float, default=0.2, help="ms of an ar step besides its verify")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--save", help="JSON file of the answers and costs: written by the first run, read "
                                       "by the next (a changed planner replayed on the same inputs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    exact = args.dtype == "bfloat16"
    saved = Path(args.save) if args.save else None
    if saved is not None and saved.exists():  # another version of the planning, the same inputs
        data = json.loads(saved.read_text())
        if data["args"] != _inputs(args):
            raise SystemExit(f"{saved} holds {data['args']}, not {_inputs(args)}: another --save file")
        sets, cost, machine = data["sets"], data["cost"], data["machine"]
    else:
        sets, cost = measure(args, exact)
        machine = cpu_model()
        if saved is not None:
            saved.write_text(json.dumps(dict(args=_inputs(args), sets=sets, cost=cost, machine=machine)))
    other = args.other / 1e3
    print(f"{machine}, {args.dtype}{' exact' if exact else ''}, {args.threads} threads; verify ms at "
          + ", ".join(f"T={t}: {cost[t] * 1e3:.2f}" for t in (1, 2, 4, 8, 16, 32))
          + f"; rest {args.other} ms a round; noise {args.noise}, {args.seeds} seeds")
    print(f"{'set':<10} {'speedup':>8} {'range':>13} {'rounds':>7} {'rows':>6} {'bound':>6}")
    for name, (prompts, answers) in sets.items():
        ar = sum(len(a) - 1 for a in answers) * (cost[1] + args.ar_other / 1e3)
        runs = [replay(prompts, answers, cost, other, args.noise, seed) for seed in range(args.seeds)]
        speedups = [ar / r[0] for r in runs]
        print(f"{name:<10} {statistics.fmean(speedups):8.3f} {min(speedups):6.3f}-{max(speedups):.3f} "
              f"{statistics.fmean(r[1] for r in runs):7.0f} {statistics.fmean(r[2] for r in runs):6.0f} "
              f"{ar / bound(prompts, answers, cost, other):6.2f}")


if __name__ == "__main__":
    main()
