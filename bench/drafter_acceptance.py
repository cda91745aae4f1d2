#!/usr/bin/env python3
"""How far the drafter sees on the bench prompts: per-depth acceptance and top-1/4/16 hit rates.

    python bench/drafter_acceptance.py                 # 12 HumanEval + 12 MT-Bench prompts, 128 tokens
    python bench/drafter_acceptance.py --limit 3 --max-new-tokens 32 --out /tmp/acc

For every prompt the target answers greedily (method `ar`), then the drafter is run, teacher
forced, at every answer position a as a decoding round would: a block rooted at token a sees the
target's features of positions < a and predicts tokens a+1 .. a+k. For each depth m (slot m + 1)
the report gives how often the target's token is the drafter's top-1, in its top-4 and in its
top-16 (the tree's headroom: a width-w tree can keep it when it is in the top-w), and the chance
that a chain is accepted through depth m (top-1 at every depth up to m). tau_chain = 1 + the mean
accepted length of a chain: the acceptance `dflash` would see. Logits: the Domino head's corrected
ones when the drafter has a head (`domino`, `dartree`), else the base ones; both are reported.
Ranks are over the drafter's draft vocabulary when it has one, as it drafts (a target token outside
it is a miss at every depth and every t).
With a head, `outside_base_top{E}` per depth: the share of blocks whose target token is the
corrected top-1 but outside the base top-E, the candidates a dartree parent expands (E =
min(candidates, budget): 4 and 16 at the CPU default budgets, 64 on CUDA): hits the head finds
that the tree cannot keep. Writes OUT/table.md and OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dartree import SpeculativeDecoder
from dartree.bench.encode import encode_prompts
from dartree.bench.machine import machine_info
from dartree.cli_options import add_weights_option, weights_choice
from dartree.defaults import default_models
from dartree.drafter import load_drafter
from dartree.prompts import load_prompt_sets
from dartree.train.features import target_features
from dartree.train.objective import block_labels, block_logits, vocab_labels

TOPS = (1, 4, 16)
EXPANDS = (4, 16, 64)  # dartree's E = min(candidates, budget) at the CPU and CUDA default budgets


@torch.no_grad()
def depth_hits(drafter, target, ids: list[int], start: int, chunk: int = 16) -> dict[str, torch.Tensor]:
    """{logits kind: bool [A, k, len(TOPS)]}: whether the target's token at each depth is in the
    drafter's top-t, for the blocks rooted at every answer position a in [start, len - 1)."""
    tokens = torch.tensor(ids)[None]
    features = target_features(target, tokens, drafter.config.target_layer_ids)
    k = drafter.num_slots
    anchors = torch.arange(start, len(ids) - 1)[None]
    lengths = torch.tensor([len(ids)])
    out: dict[str, list[torch.Tensor]] = {}
    has_label = None
    for lo in range(0, anchors.shape[1], chunk):
        a = anchors[:, lo:lo + chunk]
        h = drafter(features, tokens.gather(1, a), a)
        base, corrected = block_logits(drafter, h, tokens, a)
        labels = block_labels(tokens, a, k, lengths)[0]                      # [A, k]
        has_label = (labels >= 0)[..., None]
        # logits over the draft vocabulary when the drafter has one: labels as places in it,
        # IGNORE (a miss at every t) where the target's token lies outside it
        labels = vocab_labels(labels, drafter.draft_vocab)
        if corrected is not None:
            out.setdefault("outside_base", []).append(
                torch.cat([_outside_base(base[0].float(), corrected[0].float(), labels), has_label], -1))
        for kind, logits in (("base", base), ("corrected", corrected)):
            if logits is None:
                continue
            logits = logits[0].float()                                       # [A, k, V]
            label_logit = logits.gather(-1, labels.clamp_min(0)[..., None])
            rank = (logits > label_logit).sum(-1)                            # ties: counted as hits
            hit = torch.stack([rank < t for t in TOPS], dim=-1) & (labels >= 0)[..., None]
            out.setdefault(kind, []).append(torch.cat([hit, has_label], dim=-1))
    return {kind: torch.cat(parts) for kind, parts in out.items()}


def _outside_base(base: torch.Tensor, corrected: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """bool [A, k, len(EXPANDS)]: the label is the corrected argmax (ties: counted as hits) but
    ranks at E or below in the base logits, so a dartree parent expanding its base top-E misses it."""
    label = labels.clamp_min(0)[..., None]
    top1 = (corrected > corrected.gather(-1, label)).sum(-1) == 0
    base_rank = (base > base.gather(-1, label)).sum(-1)
    return torch.stack([top1 & (base_rank >= e) & (labels >= 0) for e in EXPANDS], dim=-1)


def summarise_outside(hits: torch.Tensor) -> dict:
    """hits bool [A, k, len(EXPANDS) + 1] (the last column: the depth has a label)."""
    valid = hits[..., -1]
    return {f"outside_base_top{e}": [round(float(hits[:, m, i].sum() / valid[:, m].sum().clamp_min(1)), 4)
                                     for m in range(hits.shape[1])]
            for i, e in enumerate(EXPANDS)}


def summarise(hits: torch.Tensor) -> dict:
    """hits bool [A, k, len(TOPS) + 1] (the last column: the depth has a label)."""
    valid = hits[..., -1]
    rates = {}
    for i, t in enumerate(TOPS):
        rates[f"top{t}"] = [round(float(hits[:, m, i].sum() / valid[:, m].sum().clamp_min(1)), 4)
                            for m in range(hits.shape[1])]
    chain = hits[..., 0].long().cumprod(-1)                                  # top-1 through depth m
    rates["chain"] = [round(float(chain[:, m].sum() / valid[:, m].sum().clamp_min(1)), 4)
                      for m in range(hits.shape[1])]
    rates["tau_chain"] = round(1 + float(chain.sum(-1).float().mean()), 3)
    rates["blocks"] = int(hits.shape[0])
    return rates


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", default="humaneval,mtbench")
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", default="bench/results/drafter_acceptance")
    p.add_argument("--drafter", default=None,
                   help="drafter folder (default: the shipped SmolLM2 drafter)")
    add_weights_option(p)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, drafter, tokenizer = default_models(device="cpu", dtype=getattr(torch, args.dtype),
                                                packed=weights_choice(args.weights))
    if args.drafter is not None:
        drafter = load_drafter(args.drafter, target)
    results = {}
    start_time = time.perf_counter()
    for prompt_set in load_prompt_sets(args.prompts, limit=args.limit):
        per_kind: dict[str, list[torch.Tensor]] = {}
        prompts = encode_prompts(prompt_set, tokenizer, target.config.vocab_size, 512)
        for index, ids in enumerate(prompts):
            answer = SpeculativeDecoder(target, None, method="ar").generate(
                torch.tensor([ids]), args.max_new_tokens).tokens
            if len(answer) < 2:
                continue
            for kind, hits in depth_hits(drafter, target, ids + answer, len(ids)).items():
                per_kind.setdefault(kind, []).append(hits)
            print(f"{prompt_set.name} {index + 1}/{len(prompts)} ({time.perf_counter() - start_time:.0f} s)",
                  file=sys.stderr, flush=True)
        results[prompt_set.name] = {kind: summarise(torch.cat(h)) for kind, h in per_kind.items()
                                    if kind != "outside_base"}
        if "outside_base" in per_kind:
            results[prompt_set.name]["corrected"].update(
                summarise_outside(torch.cat(per_kind["outside_base"])))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    m = machine_info(torch.device("cpu"), getattr(torch, args.dtype))
    record = {"command": "python bench/drafter_acceptance.py " + " ".join(sys.argv[1:]), "cpu": m["cpu"],
              "torch": m["torch"], "drafter": str(getattr(drafter, "path", "")), "results": results}
    (out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# Drafter acceptance by depth on the bench prompts\n",
             f"Command: `{record['command']}`; {m['cpu']}, torch {m['torch']}. Target answers: greedy "
             f"`ar`, {args.max_new_tokens} new tokens; a block at every answer position, teacher forced. "
             f"Per depth m: share of blocks whose target token is the drafter's top-1 / in its top-4 / "
             f"top-16, and `chain`: top-1 at every depth up to m (a chain accepted through m).\n"]
    for name, kinds in results.items():
        for kind, r in kinds.items():
            lines.append(f"\n**{name}, {kind} logits** ({r['blocks']} blocks, tau_chain {r['tau_chain']})\n")
            lines.append("| depth | " + " | ".join(str(d + 1) for d in range(len(r["top1"]))) + " |")
            lines.append("|---|" + "---|" * len(r["top1"]))
            for key in ("top1", "top4", "top16", "chain",
                        *(f"outside_base_top{e}" for e in EXPANDS if f"outside_base_top{e}" in r)):
                lines.append(f"| {key} | " + " | ".join(f"{v:.2f}" for v in r[key]) + " |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
