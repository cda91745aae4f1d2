"""Results as results.json, a Markdown table and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..methods import BASELINE, METHODS, lookup
from .aggregate import best_budgets
from .config import is_fallback
from .hf_baseline import HF_METHOD
from .llamacpp_baseline import LLAMACPP_METHOD
from .run import BenchResult

HF_NOTE = ("HF generate: transformers' `model.generate(ids, do_sample=False, max_new_tokens=N)` of the "
           "same model, dtype, threads and prompts (T > 0: `do_sample=True`, no top-k/top-p; tokens/s "
           "only), after one warm-up call; its decode time = the N-token call's time minus a 1-token "
           "call's on the same prompt (prefill and first token), divided by the new tokens as for every "
           "method. At T=0 in float32 every output is checked equal to HF generate's (other dtypes: "
           "recorded as match_hf in results.json).")
LLAMACPP_NOTE = ("llama.cpp: the same GGUF file decoded by llama.cpp (xllamacpp) in a child process per call, greedy, same "
                 "prompt ids, threads and new tokens (T = 0 only); its decode time is its own "
                 "`predicted_ms`. Its dot products quantise activations to 8 bits, so its tokens may "
                 "leave the target's: on average it reproduced {agree}% of ar's tokens before its first "
                 "difference.")


FALLBACK_NOTE = ("+fallback: the configuration run with SpeculativeDecoder(fallback=True): one-token "
                 "rounds wherever they measured cheaper per token, the other kind tried again now "
                 "and then; one gate per configuration from its warm-up call on, as one decoder "
                 "keeps it from call to call; its τ counts both kinds of round. Rounds that "
                 "speculated: {shares}.")


def _fmt(value, digits=2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if not math.isfinite(value) else f"{value:.{digits}f}"
    return str(value)


def format_table(result: BenchResult) -> str:
    """Markdown: per temperature, every configuration pooled over the prompt sets; then each
    method at its best budget per set; then auto against the sweep."""
    aggs = result.aggregates
    m = result.machine
    lines = [f"Machine: {m.get('cpu')} ({m.get('torch_threads')} threads), {m.get('device')} "
             f"{m.get('dtype')}, torch {m.get('torch')}" + (f", GPU {m['gpu']}" if "gpu" in m else "")]
    sets = result.settings.get("prompt_sets", {})
    lines.append("Prompts: " + ", ".join(f"{k} ({v['prompts']})" for k, v in sets.items())
                 + f"; max new tokens {result.settings.get('max_new_tokens')}; batch 1; prefill excluded"
                 + ("; dartree's methods with exact=True (HF generate: vendor kernels)"
                    if result.settings.get("exact") else "")
                 + ("; dartree's methods compiled (compile=True; graphs built in the warm-up calls)"
                    if result.settings.get("compile") is True else "")
                 + (f"; the drafter drafts over a vocabulary of {result.models['draft_vocab']} tokens"
                    if (result.models or {}).get("draft_vocab") else ""))
    mem = "peak MiB" + (" (process RSS)" if m.get("peak_memory") == "process_peak_rss" else "")
    hf = any(a["method"] == HF_METHOD for a in aggs)
    llc = any(a["method"] == LLAMACPP_METHOD for a in aggs)
    vs_hf = (" vs HF |" if hf else "") + (" vs llama.cpp |" if llc else "")
    for temperature in sorted({a["temperature"] for a in aggs}):
        lines += ["", f"**Temperature {temperature:g}**, all prompt sets", "",
                  f"| method | budget | width | τ | TPOT ms | tokens/s | speedup |{vs_hf} draft | tree | verify | "
                  f"accept+commit (ms/round) | {mem} |",
                  "|---|---|---|---|---|---|---|" + "---|" * (hf + llc) + "---|---|---|---|---|"]
        for a in aggs:
            if a["set"] != "all" or a["temperature"] != temperature:
                continue
            budget = a["budget"]
            if budget.startswith("auto") and a["budget_value"] != "auto":  # the searched budget
                budget = budget.replace("auto", f"auto ({a['budget_value']})", 1)
            st = a["stage_ms"]
            stages = [st["draft"], st["tree"], st["verify"], st["accept"] + st["commit"]]
            tau = _fmt(a["tau"])
            if a["method"] in (HF_METHOD, LLAMACPP_METHOD):  # not a round loop: no τ, no stages
                tau, stages = "-", [None] * 4
            lines.append(f"| {a['method']} | {budget} | {_fmt(a['width'])} | {tau} | "
                         f"{_fmt(1e3 * a['tpot_s'], 3)} | {_fmt(a['tokens_per_s'], 1)} | "
                         f"**{_fmt(a['speedup'])}×** |" + (f" **{_fmt(a['speedup_hf'])}×** |" if hf else "")
                         + (f" **{_fmt(a['speedup_llamacpp'])}×** |" if llc else "")
                         + "".join(f" {_fmt(s)} |" for s in stages)
                         + f" {a['peak_memory_bytes'] / 2**20:.0f} |")
    if hf:
        lines += ["", HF_NOTE]
    if llc:
        agree = [a["agree_ar"] for a in aggs if a["method"] == LLAMACPP_METHOD and a["set"] == "all"]
        lines += ["", LLAMACPP_NOTE.format(agree=_fmt(100 * agree[0], 0) if agree else "-")]
    fallback = [a for a in aggs if a["set"] == "all" and is_fallback(a["budget"])]
    if fallback:
        shares = "; ".join(f"{a['method']} {a['budget']} at T={a['temperature']:g} "
                           f"{_fmt(100 * a['speculative_rounds'] / a['rounds'], 0)}%"
                           for a in fallback if a["rounds"])
        lines += ["", FALLBACK_NOTE.format(shares=shares)]
    set_names = ["all"] + [s for s in dict.fromkeys(a["set"] for a in aggs) if s != "all"]
    if aggs:
        what = "speedup vs ar / vs HF generate" if hf else "speedup"
        lines += ["", f"Each method at its best fixed budget, per prompt set: {what} (τ, budget)", "",
                  "| method | T | " + " | ".join(set_names) + " |",
                  "|---|---|" + "---|" * len(set_names)]
        per_set = {s: best_budgets(aggs, s) for s in set_names}
        for method, temperature in best_budgets(aggs):
            if method in (BASELINE, HF_METHOD, LLAMACPP_METHOD):
                continue
            cells = []
            for s in set_names:
                a = per_set[s].get((method, temperature))
                speed = f"{_fmt(a['speedup'])}×" + (f" / {_fmt(a['speedup_hf'])}×" if hf else "") if a else ""
                cells.append("-" if a is None else f"{speed} ({_fmt(a['tau'])}, {a['budget']})")
            lines.append(f"| {method} | {temperature:g} | " + " | ".join(cells) + " |")
    if result.auto_vs_sweep:
        lines += ["", "Budget auto against the best fixed budget of the sweep (all prompt sets)", "",
                  "| method | T | auto budget (width) | auto speedup | best fixed budget | best speedup "
                  "| auto / best |",
                  "|---|---|---|---|---|---|---|"]
        for r in result.auto_vs_sweep:
            lines.append(f"| {r['method']} | {r['temperature']:g} | {r['auto_budget']} ({_fmt(r['auto_width'])}) | "
                         f"{_fmt(r['auto_speedup'])}× | {r['best_budget']} | {_fmt(r['best_speedup'])}× | "
                         f"{_fmt(100 * r['ratio'], 0)}% |")
    return "\n".join(lines) + "\n"


def write_results(result: BenchResult, out: str | Path) -> dict[str, Path]:
    """results.json (settings, machine, models, rows, aggregates, auto) and table.md in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = dict(json=out / "results.json", table=out / "table.md")
    data = _finite(result.to_dict())
    paths["json"].write_text(json.dumps(data, indent=1, default=_json_default, allow_nan=False) + "\n")
    paths["table"].write_text(format_table(result))
    return paths


def _finite(value):
    """NaN and ±inf become None, so results.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default(value):
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def write_plots(result: BenchResult, out: str | Path) -> list[Path]:
    """PNGs in `out`: tau_hist.png (per-response τ of each method at its best budget) and
    budget_sweep_T<t>.png (speedup and τ against budget). Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install matplotlib") from None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    aggs, rows = result.aggregates, result.rows
    temperatures = sorted({a["temperature"] for a in aggs})
    best = best_budgets(aggs, fixed_only=False)
    methods = [m for m in METHODS if m != BASELINE and any(a["method"] == m for a in aggs)]
    paths = []
    if methods:
        t0 = temperatures[0]
        cols = min(3, len(methods))
        nrows = -(-len(methods) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3 * nrows), squeeze=False, sharex=True)
        chosen = {m: best[(m, t0)] for m in methods}
        taus = {m: [r["tau"] for r in rows if r["method"] == m and r["budget"] == a["budget"]
                    and r["temperature"] == t0 and r["tau"] is not None] for m, a in chosen.items()}
        low = min((min(v) for v in taus.values() if v), default=1.0)
        high = max((max(v) for v in taus.values() if v), default=1.0)
        bins = [low + (high - low + 1e-9) * i / 20 for i in range(21)] if high > low else 10
        for ax, method in zip(axes.flat, methods):
            a = chosen[method]
            ax.hist(taus[method], bins=bins, color="C0", edgecolor="white")
            ax.axvline(a["tau"], color="C3", linestyle="--")
            budget = {"-": "", "auto": f", budget auto ({a['budget_value']})"
                      if a["budget_value"] != "auto" else ", budget auto (per round)"}.get(
                a["budget"], f", budget {a['budget']}")
            ax.set_title(f"{method}{budget}: τ {a['tau']:.2f}", fontsize=10)
            ax.set_xlabel("τ of a response (tokens per round)")
            ax.set_ylabel("responses")
        for ax in list(axes.flat)[len(methods):]:
            ax.axis("off")
        fig.suptitle(f"Acceptance length per response, temperature {t0:g}, each method at its best budget")
        fig.tight_layout()
        paths.append(out / "tau_hist.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    for temperature in temperatures:
        fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
        for i, method in enumerate(methods):
            mine = [a for a in aggs if a["set"] == "all" and a["method"] == method and a["temperature"] == temperature]
            color = f"C{i}"
            if not lookup(method).budget:  # a chain: one value, no budget axis
                for ax, key in ((ax_s, "speedup"), (ax_t, "tau")):
                    ax.axhline(mine[0][key], color=color, linestyle="--", label=f"{method} (chain)")
                continue
            fixed = sorted((a for a in mine if a["budget"] != "auto" and not is_fallback(a["budget"])),
                           key=lambda a: a["budget_value"])
            autos = [a for a in mine if a["budget"] == "auto"]
            for ax, key in ((ax_s, "speedup"), (ax_t, "tau")):
                ax.plot([a["budget_value"] for a in fixed], [a[key] for a in fixed], "o-", color=color, label=method)
                for a in (a for a in autos if a["budget_value"] != "auto"):  # per round: no x
                    ax.plot([a["budget_value"]], [a[key]], "*", color=color, markersize=14,
                            markeredgecolor="black", label=f"{method} auto")
        ax_s.axhline(1.0, color="grey", linewidth=0.8)
        for a in aggs:
            if a["set"] == "all" and a["method"] in (HF_METHOD, LLAMACPP_METHOD) \
                    and a["temperature"] == temperature:
                hf_row = a["method"] == HF_METHOD
                ax_s.axhline(a["speedup"], color="black" if hf_row else "grey", linestyle=":",
                             label="HF generate" if hf_row else "llama.cpp")
                ax_s.legend(fontsize=8, loc="best")
        for ax, label in ((ax_s, "speedup over ar"), (ax_t, "τ (tokens per round)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (draft nodes verified per round)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        ax_t.legend(fontsize=8, loc="best")
        m = result.machine
        fig.suptitle(f"Temperature {temperature:g} — {m.get('device')} {m.get('dtype')}, {m.get('cpu')}", fontsize=10)
        fig.tight_layout()
        paths.append(out / f"budget_sweep_T{temperature:g}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
