"""Per-response rows pooled into per-configuration measures; best budgets; auto against the sweep."""

from __future__ import annotations

import math
import statistics

from ..methods import BASELINE, METHODS
from .config import STAGES, is_fallback
from .hf_baseline import HF_METHOD
from .llamacpp_baseline import LLAMACPP_METHOD

ORDER = (HF_METHOD, LLAMACPP_METHOD, *METHODS)  # the order of a report


def aggregate(rows: list[dict]) -> list[dict]:
    """Per (set, method, budget, temperature) and pooled over sets (set "all"):

    tau          mean over responses of the per-response τ (responses with a round)
    tau_micro    Σ committed / Σ rounds
    tpot_s       mean over responses of decode / new tokens; tokens_per_s = 1 / tpot_s
    tpot_total_s Σ decode / Σ new tokens
    speedup      ar's tpot_s / tpot_s, ar of the same set and temperature (speedup_total likewise)
    speedup_hf   HF generate's tpot_s / tpot_s likewise (nan when it did not run)
    speedup_llamacpp  llama.cpp's tpot_s / tpot_s likewise
    agree_ar     llama.cpp only: mean share of ar's tokens it reproduced before its first
                 difference (its activations are quantised: other tokens may follow)
    stage_ms     Σ stage time / Σ rounds, milliseconds per round
    speculative_rounds  Σ rounds that verified a draft tree (budget "+fallback": the others were
                 the fallback's one-token rounds)
    """
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        for set_name in (row["set"], "all"):
            key = (set_name, row["method"], row["budget"], row["temperature"])
            groups.setdefault(key, []).append(row)
    aggs = []
    for (set_name, method, budget, temperature), members in groups.items():
        # a response that ended at its first token (EOS from the prefill) ran no round: it has no
        # τ or TPOT and is left out of every mean (counted in `responses`, not in `decoded`)
        decoded = [r for r in members if r["rounds"] > 0]
        rounds = sum(r["rounds"] for r in decoded)
        new = sum(r["new_tokens"] for r in decoded)
        decode = sum(r["decode_s"] for r in decoded)
        tpot = statistics.fmean(r["tpot_s"] for r in decoded) if decoded else float("nan")
        aggs.append(dict(
            set=set_name, method=method, budget=budget, temperature=temperature,
            budget_value=members[0]["budget_value"], width=members[0]["width"],
            responses=len(members), decoded=len(decoded),
            tau=statistics.fmean(r["tau"] for r in decoded) if decoded else float("nan"),
            tau_micro=sum(r["committed"] for r in members) / rounds if rounds else 0.0,
            new_tokens=new, rounds=rounds, decode_s=decode,
            speculative_rounds=sum(r.get("speculative_rounds", 0) for r in decoded),
            tpot_s=tpot, tpot_total_s=decode / new if new else float("nan"),
            tokens_per_s=1.0 / tpot if tpot > 0 else float("nan"),
            stage_ms={s: 1e3 * sum(r["stage_s"][s] for r in members) / rounds if rounds else 0.0
                      for s in STAGES},
            peak_memory_bytes=max(r["peak_memory_bytes"] for r in members),
            speedup=float("nan"), speedup_total=float("nan"), speedup_hf=float("nan"),
            speedup_llamacpp=float("nan"),
            agree_ar=(statistics.fmean(r["agree_ar"] for r in members if "agree_ar" in r)
                      if any("agree_ar" in r for r in members) else float("nan"))))
    baseline = {(a["set"], a["temperature"]): a for a in aggs if a["method"] == BASELINE}
    hf = {(a["set"], a["temperature"]): a for a in aggs if a["method"] == HF_METHOD}
    llamacpp = {(a["set"], a["temperature"]): a for a in aggs if a["method"] == LLAMACPP_METHOD}
    for a in aggs:
        ar = baseline.get((a["set"], a["temperature"]))
        if ar is not None and a["tpot_s"] > 0:
            a["speedup"] = ar["tpot_s"] / a["tpot_s"]
            a["speedup_total"] = ar["tpot_total_s"] / a["tpot_total_s"]
        for key, refs in (("speedup_hf", hf), ("speedup_llamacpp", llamacpp)):
            ref = refs.get((a["set"], a["temperature"]))
            if ref is not None and a["tpot_s"] > 0:
                a[key] = ref["tpot_s"] / a["tpot_s"]
    order = {m: i for i, m in enumerate(ORDER)}
    aggs.sort(key=lambda a: (a["set"] != "all", a["set"], a["temperature"], order[a["method"]],
                             is_fallback(a["budget"]),
                             a["budget_value"] if not a["budget"].startswith("auto") else math.inf))
    return aggs


def best_budgets(aggs: list[dict], set_name: str = "all", fixed_only: bool = True) -> dict[tuple, dict]:
    """{(method, temperature): the aggregate with the highest speedup} over budgets of a set."""
    best: dict[tuple, dict] = {}
    for a in aggs:
        if a["set"] != set_name or (fixed_only and a["budget"].startswith("auto")):
            continue
        key = (a["method"], a["temperature"])
        if key not in best or _speed(a) > _speed(best[key]):
            best[key] = a
    return best


def _speed(agg: dict) -> float:
    return agg["speedup"] if math.isfinite(agg["speedup"]) else -math.inf


def auto_vs_sweep(aggs: list[dict]) -> list[dict]:
    """For each tree method run with budget auto and with fixed budgets: auto's speedup against
    the best fixed budget's (set "all"), per temperature."""
    best = best_budgets(aggs)
    out = []
    for a in aggs:
        if a["set"] != "all" or a["budget"] != "auto":
            continue
        b = best.get((a["method"], a["temperature"]))
        if b is None:
            continue
        out.append(dict(method=a["method"], temperature=a["temperature"], auto_budget=a["budget_value"],
                        auto_width=a["width"], auto_speedup=a["speedup"], auto_tau=a["tau"],
                        best_budget=b["budget_value"], best_speedup=b["speedup"], best_tau=b["tau"],
                        ratio=a["speedup"] / b["speedup"] if b["speedup"] > 0 else float("nan")))
    return out
