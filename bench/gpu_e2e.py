"""End-to-end run of the engine on random-init targets of real shapes (part of bench/gpu_check.sh).

    python bench/gpu_e2e.py --device cuda --out bench/results/gpu_check/e2e.md   # the GPU machine
    python bench/gpu_e2e.py --device cpu --quick                                 # rehearsal on a CPU

Targets: SmolLM2-135M (Llama: 30 layers, hidden 576, 9/3 heads, head dim 64) and Qwen3-4B (36
layers, hidden 2560, 32/8 heads, head dim 128, vocabulary 151,936), random init, bfloat16, each
with a random one-layer drafter (`dartree.testing.random_drafter`, Domino head). Per target:

  1. verify latency against tree size: one target forward over a random tree of T rows (1..256)
     after a --prefix-token context, median of --iters;
  2. stage times per round of every method (`GenerationResult.timings` / rounds) and host syncs
     per round, counted with `torch.cuda.set_sync_debug_mode("warn")` (every implicit sync of
     the current stream warns; the stopwatch's own explicit `torch.cuda.synchronize()` does not)
     and attributed to the innermost dartree line that caused it;
  3. temperature-0 equality with transformers' `generate(do_sample=False)` in float32, for every
     method with a random drafter and, for the tree methods, an oracle drafter whose rounds accept
     whole branches (so that multi-row commits are checked too).

--quick (the CPU rehearsal) keeps the heads and head dims but uses 2 layers, hidden 16 per
head, intermediate 512, a vocabulary of 4096 and one CPU thread, trees of up to 64 rows and 8 new tokens. The report
is Markdown (--out, rewritten after each part); the last line printed is a one-line summary.
Exit status 1 when a part fails or an output differs from transformers'.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

import dartree
import dartree.ops as ops
from dartree.bench.timing import call_seconds
from dartree.decoding import METHODS, SpeculativeDecoder
from dartree.methods import TREE_METHODS
from dartree.target import TargetModel
from dartree.testing import OracleDrafter, random_drafter
from dartree.tree import DraftTree

SHAPES = {
    "SmolLM2-135M": (LlamaConfig, dict(
        num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
        max_position_embeddings=8192)),
    "Qwen3-4B": (Qwen3Config, dict(
        num_hidden_layers=36, hidden_size=2560, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=40960)),
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(dartree.__file__)))  # the checkout that runs


def make_target(shape, dtype, device, shrink=None, seed=0):
    """A random-init causal LM of a `SHAPES` entry (config fields in `shrink` replaced), built
    directly on `device`."""
    config_class, fields = SHAPES[shape]
    fields = dict(fields, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if shrink:  # hidden 16 per head: transformers wants a multiple of the head count
        fields.update(shrink, hidden_size=16 * fields["num_attention_heads"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config_class(**fields), attn_implementation="sdpa",
                                                 dtype=dtype)
    return model.eval()


def random_prompt(length, vocab, seed):
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def random_tree(size, vocab, device, seed):
    """A tree of `size` rows (root included) whose parents are drawn uniformly from earlier rows."""
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size)]
    depths = [0] * size
    for i in range(1, size):
        depths[i] = depths[parents[i]] + 1
    tokens = torch.randint(0, vocab, (size,), generator=gen)
    as_long = lambda xs: torch.as_tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    return DraftTree(as_long(tokens), as_long(parents), as_long(depths),
                     torch.zeros(size, device=device))


def median_seconds(fn, device, warmup, iters):
    return statistics.median(call_seconds(fn, iters, warmup, device))


class SyncCounter:
    """Counts implicit host syncs on CUDA (sync debug mode "warn") and where they come from.

    Each warning is attributed to the innermost frame of dartree's own code on the Python stack
    (else the innermost frame outside this file and the warnings module)."""

    def __init__(self):
        self.sites: Counter[str] = Counter()

    @property
    def total(self):
        return sum(self.sites.values())

    def __enter__(self):
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)

    def _record(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        stack = [f for f in traceback.extract_stack()[:-1]
                 if f.filename != os.path.abspath(__file__) and os.path.basename(f.filename) != "warnings.py"]
        ours = [f for f in stack if f.filename.startswith(os.path.join(ROOT, "dartree") + os.sep)]
        frame = (ours or stack or [None])[-1]
        where = (f"{os.path.relpath(frame.filename, ROOT) if frame.filename.startswith(ROOT) else os.path.basename(frame.filename)}"
                 f":{frame.lineno} {frame.name}" if frame else "?")
        self.sites[where] += 1


def check_sync_counter(device):
    """The counter must see a known sync (.item()); else its zeros would mean nothing."""
    with SyncCounter() as counter:
        torch.ones(1, device=device).sum().item()
    if counter.total < 1:
        raise RuntimeError("torch.cuda.set_sync_debug_mode('warn') reported no sync for .item(): "
                           "host sync counts unavailable")


class Report:
    """Markdown report, rewritten to `path` after every part so a timeout keeps what ran."""

    def __init__(self, path):
        self.path, self.lines, self.failures, self.summary = path, [], [], []

    def add(self, *lines):
        self.lines.extend(lines)
        print("\n".join(lines), flush=True)
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "w") as f:
                f.write("\n".join(self.lines) + "\n")

    def part(self, title, fn, *args):
        start = time.perf_counter()
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 -- a failed part is reported, the others still run
            traceback.print_exc()
            self.failures.append(f"{title}: {type(exc).__name__}: {exc}".splitlines()[0][:300])
            self.add(f"\n**FAILED** {title}: `{type(exc).__name__}: {str(exc).splitlines()[0][:300]}`")
        self.add(f"\n_{title}: {time.perf_counter() - start:.1f} s_")


def verify_latency(report, args, shape, target, device):
    tm = TargetModel(target, feature_layers=[])
    vocab = tm.vocab_size
    tm.allocate(args.prefix + max(args.tree_sizes) + 1)
    tm.prefill(torch.tensor(random_prompt(args.prefix, vocab, 1), device=device))
    rows = []
    with torch.inference_mode():
        for size in args.tree_sizes:
            tree = random_tree(size, vocab, device, seed=size)
            seconds = median_seconds(lambda: tm.verify(tree, check=False), device, args.warmup, args.iters)
            rows.append(f"| {size} | {int(tree.depths.max())} | {seconds * 1e3:.3f} | "
                        f"{seconds * 1e6 / size:.1f} |")
    report.add(f"\n#### {shape}: verify latency against tree size (prefix {args.prefix}, "
               f"{tm.dtype}, median of {args.iters})\n",
               "| tree rows T | depth | verify ms | us / row |", "|---:|---:|---:|---:|", *rows)
    first, last = rows[0].split("|")[3].strip(), rows[-1].split("|")[3].strip()
    report.summary.append(f"{shape} verify T={args.tree_sizes[0]} {first} ms, "
                          f"T={args.tree_sizes[-1]} {last} ms")


def stage_times(report, args, shape, target, drafter, device):
    prompt = random_prompt(args.prefix, target.config.vocab_size, 2)
    stages = ("draft", "tree", "verify", "accept", "commit")
    rows, sites = [], Counter()
    for method in METHODS:
        dec = SpeculativeDecoder(target, drafter, method=method, budget=args.budget)
        dec.generate(prompt, max_new_tokens=4)  # warm-up: allocations, kernel selection
        res = dec.generate(prompt, max_new_tokens=args.new_tokens)
        rounds = len(res.acceptance_lengths)
        per_round = [res.timings.get(s, 0.0) * 1e3 / rounds for s in stages]
        syncs = "n/a (cpu)" if device.type != "cuda" else "n/a (counter failed)"
        if device.type == "cuda" and args.sync_counter_ok:
            with SyncCounter() as counter:
                counted = dec.generate(prompt, max_new_tokens=args.new_tokens)
            syncs = f"{counter.total / len(counted.acceptance_lengths):.1f}"
            sites.update({f"{method}: {k}": v / len(counted.acceptance_lengths)
                          for k, v in counter.sites.items()})
            if method == "dartree":
                report.summary.append(f"{shape} dartree {res.timings['decode'] * 1e3 / rounds:.2f} ms/round, "
                                      f"{syncs} syncs/round")
        rows.append(f"| {method} | {rounds} | {res.mean_acceptance:.2f} | "
                    + " | ".join(f"{t:.3f}" for t in per_round)
                    + f" | {res.timings['decode'] * 1e3 / rounds:.3f} | {syncs} |")
    report.add(f"\n#### {shape}: stage times per round (ms), random drafter, budget {args.budget}, "
               f"prompt {args.prefix}, {args.new_tokens} new tokens\n",
               "| method | rounds | τ | " + " | ".join(stages) + " | decode | host syncs / round |",
               "|---|---:|---:|" + "---:|" * (len(stages) + 2), *rows)
    if sites:
        report.add("\nHost syncs per round by source line (sync debug mode):\n",
                   "| method: site | syncs / round |", "|---|---:|",
                   *(f"| {site} | {n:.2f} |" for site, n in sorted(sites.items())))


def equality(report, args, shape, device):
    target = make_target(shape, torch.float32, device, args.shrink, seed=3)
    vocab = target.config.vocab_size
    prompt = random_prompt(args.eq_prompt, vocab, 4)
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=args.eq_tokens, min_new_tokens=args.eq_tokens,
                              pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    runs = [(m, "random") for m in METHODS] + [(m, "oracle") for m in TREE_METHODS]
    drafters = {"random": random_drafter(target, num_layers=1, block_size=16, seed=5),
                "oracle": OracleDrafter(random_drafter(target, num_layers=1, block_size=16, seed=5),
                                        prompt, expected)}
    rows, bad = [], 0
    for method, kind in runs:
        drafter = drafters[kind]
        res = SpeculativeDecoder(target, drafter, method=method, budget=args.budget).generate(
            prompt, max_new_tokens=args.eq_tokens)
        same = res.tokens == expected
        first = next((i for i, (a, b) in enumerate(zip(res.tokens, expected)) if a != b),
                     None if len(res.tokens) == len(expected) else min(len(res.tokens), len(expected)))
        bad += not same
        rows.append(f"| {method} | {kind} | {'yes' if same else '**NO**'} | "
                    f"{'-' if first is None else first} | {res.mean_acceptance:.2f} |")
    report.add(f"\n#### {shape}: temperature 0 against transformers generate(do_sample=False), "
               f"float32, {target.config.num_hidden_layers} layers, vocabulary {vocab}, prompt "
               f"{len(prompt)}, {args.eq_tokens} tokens ({len(set(expected))} distinct)\n",
               "| method | drafter | equal | first difference | τ |", "|---|---|---|---:|---:|", *rows)
    report.summary.append(f"{shape} fp32 equality {len(runs) - bad}/{len(runs)}")
    if bad:
        raise AssertionError(f"{bad} of {len(runs)} runs differ from transformers' greedy output")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="CPU rehearsal: real heads and head "
                        "dims, 2 layers, hidden 16 per head, intermediate 512, vocabulary 4096, one thread")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of "
                        + ", ".join(SHAPES))
    parser.add_argument("--equality-shapes", default=None, help="shapes of the float32 equality "
                        "check (default: all of --shapes)")
    parser.add_argument("--out", default=None, help="Markdown report path")
    args = parser.parse_args(argv)
    quick = args.quick
    args.shrink = dict(num_hidden_layers=2, intermediate_size=512, vocab_size=4096) if quick else {}
    torch.set_num_threads(args.threads or (1 if quick else torch.get_num_threads()))
    args.tree_sizes = [1, 4, 16, 64] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 192, 256]
    args.prefix, args.budget = (64, 16) if quick else (512, 64)
    args.new_tokens, args.eq_tokens, args.eq_prompt = (8, 8, 16) if quick else (48, 48, 32)
    args.warmup, args.iters = (1, 3) if quick else (3, 15)
    shapes = [s for s in args.shapes.split(",") if s]
    eq_shapes = shapes if args.equality_shapes is None else [s for s in args.equality_shapes.split(",") if s]
    unknown = sorted(set(shapes + eq_shapes) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_e2e: --device cuda but no CUDA GPU is visible")

    report = Report(args.out)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    report.add(f"### dartree end to end on {device.type} ({name}){' -- quick rehearsal' if quick else ''}",
               f"\ntorch {torch.__version__}, transformers {__import__('transformers').__version__}, "
               f"dartree {dartree.__version__}, extension {ops.HAS_EXTENSION}, CUDA kernels "
               f"{ops.HAS_CUDA_KERNELS}, {torch.get_num_threads()} CPU threads"
               + "".join(f", {k} {v}" for k, v in args.shrink.items()))
    if device.type == "cuda":
        report.part("sync counter self-check", check_sync_counter, device)
    args.sync_counter_ok = not report.failures
    for shape in shapes:
        state = {}

        def build(shape=shape, state=state):
            state["target"] = make_target(shape, torch.bfloat16, device, args.shrink)
            state["drafter"] = random_drafter(state["target"], num_layers=1, block_size=16, seed=1)
        report.part(f"{shape} bf16 target + drafter (random init)", build)
        if "drafter" in state:
            report.part(f"{shape} verify latency", verify_latency, report, args, shape,
                        state["target"], device)
            report.part(f"{shape} stage times and host syncs", stage_times, report, args, shape,
                        state["target"], state["drafter"], device)
        state.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for shape in eq_shapes:
        report.part(f"{shape} float32 equality", equality, report, args, shape, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    status = "FAILED: " + "; ".join(report.failures) if report.failures else "ok"
    print(f"\ngpu_e2e {status} | " + " | ".join(report.summary), flush=True)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
