#!/usr/bin/env python3
"""Bit-exactness on the real default pair: every method with exact=True against the target alone.

    python bench/exact_check.py                    # float32 + bfloat16, T=0 and T=1, 6+6 prompts
    python bench/exact_check.py --dtypes bfloat16 --temperatures 0 --limit 2 --max-new-tokens 32

Target and drafter: `dartree.default_models()` (SmolLM2-135M-Instruct + its trained drafter).
Prompts: the `dartree bench` default sets (humaneval, mtbench; first --limit of each, through the
chat template). For every dtype, temperature and prompt:
  T = 0: the reference is `with dartree.exact(): model.generate(do_sample=False)`;
  T > 0: the reference is HF `generate` + `dartree.PositionKeyedSampler` (seed = --seed + prompt
         index) inside `dartree.exact()`, the same tokens as the one-token loop (method ar);
then every method with exact=True (ar included) must return the reference's tokens. Tree methods cycle through
--budgets across prompts so that every budget meets every prompt set. Each result is appended to
OUT/results.jsonl as it is known (a rerun skips what is there: the run resumes); OUT/table.md is
rewritten at the end. Exit status 1 if any output differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import LogitsProcessorList

import dartree
from dartree import SpeculativeDecoder
from dartree.bench.encode import encode_prompts
from dartree.bench.machine import machine_info
from dartree.cli_options import add_weights_option, weights_choice
from dartree.decoding import METHODS
from dartree.defaults import default_models
from dartree.methods import TREE_METHODS
from dartree.prompts import load_prompt_sets



def hf_reference(model, ids, max_new, eos, temperature, seed):
    """HF generate inside dartree.exact(): greedy at T=0, position-keyed samples at T>0."""
    x = torch.tensor([ids])
    extra = {}
    if temperature > 0:
        extra["logits_processor"] = LogitsProcessorList([dartree.PositionKeyedSampler(seed, temperature)])
    with torch.inference_mode(), dartree.exact():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=max_new, min_new_tokens=0, eos_token_id=eos,
                             pad_token_id=eos[0], **extra)
    return out[0, len(ids):].tolist()


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def load_done(path: Path) -> dict:
    done = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            done[row["key"]] = row
    return done


def write_table(rows, out: Path, header: str) -> None:
    lines = [header, "", "| dtype | T | method | budgets | prompts | equal | first difference | τ |",
             "|---|---|---|---|---|---|---|---|"]
    groups = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["temperature"], r["method"]), []).append(r)
    for (dtype, temperature, method), rs in groups.items():
        budgets = sorted({r["budget"] for r in rs if r["budget"]})
        bad = [f'{r["set"]}[{r["index"]}]@{r["first_difference"]}' for r in rs if not r["equal"]]
        taus = [r["tau"] for r in rs if r.get("tau")]
        tau = f"{sum(taus) / len(taus):.2f}" if taus else "-"
        equal = "reference" if method == "hf-generate" else f"{sum(r['equal'] for r in rs)}/{len(rs)}"
        lines.append(f"| {dtype} | {temperature:g} | {method} | {','.join(map(str, budgets)) or '-'} | "
                     f"{len(rs)} | {equal} | {', '.join(bad) or '-'} | {tau} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--limit", type=int, default=6, help="prompts per set (the bench default)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budgets", default="16,32,64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench/results/exact_smollm2")
    add_weights_option(p)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "results.jsonl"
    done = load_done(log)
    failures = 0
    for dtype in dtypes:
        dname = str(dtype).removeprefix("torch.")
        target, drafter, tokenizer = default_models(device="cpu", dtype=dtype,
                                                    packed=weights_choice(args.weights))
        weights = "packed GGUF (Q4_1 + Q8_0)" if any(hasattr(m, "qtype") for m in target.modules()) \
            else "dequantised"
        eos = target.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos)
        sets = load_prompt_sets("humaneval,mtbench", limit=args.limit)
        for temperature in temperatures:
            for prompt_set in sets:
                for index, ids in enumerate(encode_prompts(prompt_set, tokenizer, target.config.vocab_size, 512)):
                    seed = args.seed + index
                    budget = budgets[index % len(budgets)]
                    reference = None
                    for method in ("reference",) + METHODS:
                        key = f"{dname}/{temperature:g}/{prompt_set.name}/{index}/{method}"
                        if key in done:
                            row = done[key]
                            if method == "reference":
                                reference = row["tokens"]
                            failures += not row["equal"]
                            continue
                        start = time.perf_counter()
                        tau = None
                        if method == "reference":
                            tokens = hf_reference(target, ids, args.max_new_tokens, eos, temperature, seed)
                        else:
                            dec = SpeculativeDecoder(target, drafter, method=method, budget=budget, exact=True)
                            res = dec.generate(ids, args.max_new_tokens, temperature, eos_token_id=eos,
                                               seed=seed if temperature > 0 else None)
                            tokens, tau = res.tokens, res.mean_acceptance
                        seconds = time.perf_counter() - start
                        if method == "reference":
                            reference = tokens
                        diff = first_difference(tokens, reference)
                        row = dict(key=key, dtype=dname, temperature=temperature, set=prompt_set.name,
                                   index=index, method=method if method != "reference" else "hf-generate",
                                   budget=budget if method in TREE_METHODS else None, seed=seed,
                                   equal=diff is None, first_difference=diff, tau=tau,
                                   new_tokens=len(tokens), seconds=round(seconds, 2), tokens=tokens)
                        with log.open("a") as f:
                            f.write(json.dumps(row) + "\n")
                        done[key] = row
                        failures += diff is not None
                        print(f"{key}: {'equal' if diff is None else f'DIFFERS at {diff}'} "
                              f"({len(tokens)} tokens, {seconds:.1f} s)", file=sys.stderr, flush=True)
    rows = list(done.values())
    m = machine_info(torch.device("cpu"), torch.float32)
    header = (f"# Exact mode on SmolLM2-135M-Instruct + its drafter\n\nTarget weights: {weights}. "
              f"Machine: {m['cpu']}, "
              f"{m['torch_threads']} threads, torch {m['torch']}, transformers {m.get('transformers')}\n"
              f"Command: `python bench/exact_check.py {' '.join(sys.argv[1:])}`\n\n"
              f"Reference (the hf-generate rows): T=0 `with dartree.exact(): model.generate(do_sample=False)`; "
              f"T>0 the same with `dartree.PositionKeyedSampler(seed, T)` (seed = {args.seed} + prompt index); "
              f"every method runs with exact=True (and the seed). {args.max_new_tokens} new tokens "
              f"(or to EOS); tree methods cycle through budgets {args.budgets} across prompts.")
    write_table(rows, out, header)
    print(f"{len(rows)} outputs, {failures} differ; table in {out / 'table.md'}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
