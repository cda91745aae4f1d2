"""Per-response rows pooled into per-configuration measures; best budgets; auto against the sweep."""

from __future__ import annotations

import math
import statistics

from ..methods import BASELINE, METHODS
from .config import STAGES, budget_name, is_fallback, is_no_ngram, series
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
    speedup_llamacpp  plain llama.cpp's tpot_s / tpot_s likewise
    speedup_llamacpp_ngram  the fastest llama.cpp n-gram mode's tpot_s (of this set and
                 temperature) / tpot_s
    agree_ar     llama.cpp only: mean share of ar's tokens it reproduced before its first
                 difference (its activations are quantised: other tokens may follow)
    agree_llamacpp  llama.cpp n-gram modes: the same against plain llama.cpp's tokens
    accepted     Σ accepted draft tokens (bonus excluded) by source: drafter, lookup, both
    source_share each source's share of those tokens (nan each when none was accepted)
    drafted, draft_accepted  llama.cpp n-gram modes: Σ draft tokens proposed / accepted
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
            speedup_llamacpp=float("nan"), speedup_llamacpp_ngram=float("nan"),
            agree_ar=_mean_of(members, "agree_ar"), agree_llamacpp=_mean_of(members, "agree_llamacpp"),
            drafted=sum(r.get("drafted", 0) for r in members),
            draft_accepted=sum(r.get("draft_accepted", 0) for r in members),
            **_sources(members)))
    baseline = {(a["set"], a["temperature"]): a for a in aggs if a["method"] == BASELINE}
    hf = {(a["set"], a["temperature"]): a for a in aggs if a["method"] == HF_METHOD}
    llamacpp = {(a["set"], a["temperature"]): a for a in aggs
                if a["method"] == LLAMACPP_METHOD and a["budget"] == "-"}
    ngram_modes: dict[tuple, dict] = {}  # the fastest llama.cpp n-gram mode per set and temperature
    for a in aggs:
        key = (a["set"], a["temperature"])
        if a["method"] == LLAMACPP_METHOD and a["budget"] != "-" and a["tpot_s"] > 0 and (
                key not in ngram_modes or a["tpot_s"] < ngram_modes[key]["tpot_s"]):
            ngram_modes[key] = a
    for a in aggs:
        ar = baseline.get((a["set"], a["temperature"]))
        if ar is not None and a["tpot_s"] > 0:
            a["speedup"] = ar["tpot_s"] / a["tpot_s"]
            a["speedup_total"] = ar["tpot_total_s"] / a["tpot_total_s"]
        for key, refs in (("speedup_hf", hf), ("speedup_llamacpp", llamacpp),
                          ("speedup_llamacpp_ngram", ngram_modes)):
            ref = refs.get((a["set"], a["temperature"]))
            if ref is not None and a["tpot_s"] > 0:
                a[key] = ref["tpot_s"] / a["tpot_s"]
    order = {m: i for i, m in enumerate(ORDER)}
    aggs.sort(key=lambda a: (a["set"] != "all", a["set"], a["temperature"], order[a["method"]],
                             is_fallback(a["budget"]), is_no_ngram(a["budget"]),
                             budget_name(a["budget"]) == "auto",
                             a["budget_value"] if a["budget_value"] is not None else -1, a["budget"]))
    return aggs


def _mean_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else float("nan")


def _sources(rows: list[dict]) -> dict:
    """accepted (Σ accepted draft tokens per source) and source_share (each one's share)."""
    accepted: dict[str, int] = {}
    for r in rows:
        for source, count in r.get("accepted_by_source", {}).items():
            accepted[source] = accepted.get(source, 0) + count
    total = sum(accepted.values())
    return dict(accepted=accepted,
                source_share={k: v / total if total else float("nan") for k, v in accepted.items()})


def best_budgets(aggs: list[dict], set_name: str = "all", fixed_only: bool = True) -> dict[tuple, dict]:
    """{(series, temperature): the aggregate with the highest speedup} over the budgets of each
    series (a method and its variant: "dartree", "dartree+no-ngram", `config.series`) of a set."""
    best: dict[tuple, dict] = {}
    for a in aggs:
        if a["set"] != set_name or (fixed_only and budget_name(a["budget"]) == "auto"):
            continue
        key = (series(a["method"], a["budget"]), a["temperature"])
        if key not in best or _speed(a) > _speed(best[key]):
            best[key] = a
    return best


def _speed(agg: dict) -> float:
    return agg["speedup"] if math.isfinite(agg["speedup"]) else -math.inf


def auto_vs_sweep(aggs: list[dict]) -> list[dict]:
    """For each series run with budget auto and with fixed budgets: auto's speedup against the
    best fixed budget's of the same series, per prompt set (and "all") and temperature."""
    out = []
    for set_name in dict.fromkeys(a["set"] for a in aggs):
        best = best_budgets(aggs, set_name)
        for a in aggs:
            if a["set"] != set_name or budget_name(a["budget"]) != "auto":
                continue
            name = series(a["method"], a["budget"])
            b = best.get((name, a["temperature"]))
            if b is None:
                continue
            out.append(dict(set=set_name, method=a["method"], series=name,
                            temperature=a["temperature"], auto_speedup=a["speedup"],
                            auto_tau=a["tau"], best_budget=b["budget"], best_speedup=b["speedup"],
                            best_tau=b["tau"],
                            ratio=a["speedup"] / b["speedup"] if b["speedup"] > 0 else float("nan")))
    return out
