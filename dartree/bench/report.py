"""Results as results.json, a Markdown table and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..methods import BASELINE, lookup
from .aggregate import best_budgets
from .config import SEARCH, budget_name, is_fallback, series
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
NGRAM_MODES_NOTE = ("llama.cpp's n-gram modes (`CommonParamsSpeculative.types`, each mode's "
                    "settings as labelled; the same file, prompts and threads): its τ = tokens "
                    "after the first / its target passes (those tokens less the accepted draft "
                    "tokens). Per mode: draft tokens accepted / proposed, and the share of plain "
                    "llama.cpp's tokens it reproduced before its first difference (a batched "
                    "verify may round otherwise): {modes}.")
SOURCES_NOTE = ("Sources (d / l / b %): the accepted draft tokens (bonus tokens excluded) whose tree "
                "node the drafter proposed, the lookup, or both (`GenerationResult."
                "accepted_by_source`); +no-ngram: SpeculativeDecoder(ngram=False), the drafter's "
                "tree alone; method ngram: the lookup alone, no drafter.")


FALLBACK_NOTE = ("+fallback: the configuration run with SpeculativeDecoder(fallback=True): one-token "
                 "rounds wherever they measured cheaper per token, the other kind tried again now "
                 "and then; one gate per configuration from its warm-up call on, as one decoder "
                 "keeps it from call to call; its τ counts both kinds of round.")
AUTO_NOTE = ("auto (per round): SpeculativeDecoder(budget=\"auto\"): each round's tree size, and "
             "whether the drafter runs, chosen from the decoder's measured costs (one-token rounds "
             "where nothing pays); its τ counts every round.")
DECODER_NOTE = ("Each configuration keeps one decoder from its warm-up call (on the first prompt "
                "reversed) to its last prompt, as a user keeps one: its measured costs, "
                "calibration, fallback gate and lookup store of earlier outputs carry over.")


def _fmt(value, digits=2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if not math.isfinite(value) else f"{value:.{digits}f}"
    return str(value)


def _budget_cell(a: dict) -> str:
    name = budget_name(a["budget"])
    if name == "auto":
        return a["budget"].replace("auto", "auto (per round)", 1)
    if name == SEARCH:
        return a["budget"].replace(SEARCH, f"{SEARCH} ({a['budget_value']})", 1)
    return a["budget"]


def _shares(a: dict) -> str:
    """"d / l / b" percentages of the accepted draft tokens, "-" when none was accepted."""
    share = a.get("source_share") or {}
    if not share or not all(math.isfinite(v) for v in share.values()):
        return "-"
    return " / ".join(_fmt(100 * share.get(k, 0.0), 0) for k in ("drafter", "lookup", "both"))


def format_table(result: BenchResult) -> str:
    """Markdown: per temperature, every configuration pooled over the prompt sets; then τ and
    sources per set; each series at its best budget per set; auto against the sweep."""
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
    llc = any(a["method"] == LLAMACPP_METHOD and a["budget"] == "-" for a in aggs)
    modes = any(a["method"] == LLAMACPP_METHOD and a["budget"] != "-" for a in aggs)
    sources = any(a["method"] not in (HF_METHOD, LLAMACPP_METHOD) and lookup(a["method"]).budget
                  for a in aggs)  # the tree methods and ngram: where the lookup can propose
    vs = (" vs HF |" if hf else "") + (" vs llama.cpp |" if llc else "") \
        + (" vs llama.cpp n-gram |" if modes else "")
    for temperature in sorted({a["temperature"] for a in aggs}):
        lines += ["", f"**Temperature {temperature:g}**, all prompt sets", "",
                  f"| method | budget | width | τ |" + (" sources d / l / b % |" if sources else "")
                  + f" TPOT ms | tokens/s | speedup |{vs} draft | tree | verify | "
                  f"accept+commit (ms/round) | {mem} |",
                  "|---|---|---|---|" + "---|" * sources + "---|---|---|"
                  + "---|" * (hf + llc + modes) + "---|---|---|---|---|"]
        for a in aggs:
            if a["set"] != "all" or a["temperature"] != temperature:
                continue
            st = a["stage_ms"]
            stages = [st["draft"], st["tree"], st["verify"], st["accept"] + st["commit"]]
            tau = _fmt(a["tau"])
            if a["method"] in (HF_METHOD, LLAMACPP_METHOD):  # not a round loop: no stages
                stages = [None] * 4
                tau = "-" if a["method"] == HF_METHOD else tau  # llama.cpp's: from its passes
            lines.append(f"| {a['method']} | {_budget_cell(a)} | {_fmt(a['width'])} | {tau} |"
                         + (f" {_shares(a)} |" if sources else "")
                         + f" {_fmt(1e3 * a['tpot_s'], 3)} | {_fmt(a['tokens_per_s'], 1)} | "
                         f"**{_fmt(a['speedup'])}×** |"
                         + "".join(f" **{_fmt(a[k])}×** |" for k, on in (
                             ("speedup_hf", hf), ("speedup_llamacpp", llc),
                             ("speedup_llamacpp_ngram", modes)) if on)
                         + "".join(f" {_fmt(s)} |" for s in stages)
                         + f" {a['peak_memory_bytes'] / 2**20:.0f} |")
    lines += _notes(result, hf, llc, modes, sources)
    set_names = ["all"] + [s for s in dict.fromkeys(a["set"] for a in aggs) if s != "all"]
    speculative = [a for a in aggs if a["method"] not in (BASELINE, HF_METHOD, LLAMACPP_METHOD)]
    if speculative and len(set_names) > 2:
        lines += ["", "τ (sources d / l / b %) per prompt set", "",
                  "| method | budget | T | " + " | ".join(set_names) + " |",
                  "|---|---|---|" + "---|" * len(set_names)]
        cells = {(a["method"], a["budget"], a["temperature"], a["set"]): a for a in speculative}
        for key in dict.fromkeys((a["method"], a["budget"], a["temperature"]) for a in speculative):
            row = [cells.get((*key, s)) for s in set_names]
            lines.append(f"| {key[0]} | {_budget_cell(row[0])} | {key[2]:g} | " + " | ".join(
                "-" if a is None else f"{_fmt(a['tau'])} ({_shares(a)})" for a in row) + " |")
    if aggs:
        what = "speedup vs ar / vs HF generate" if hf else "speedup"
        lines += ["", f"Each method at its best fixed budget, per prompt set: {what} (τ, budget)", "",
                  "| method | T | " + " | ".join(set_names) + " |",
                  "|---|---|" + "---|" * len(set_names)]
        per_set = {s: best_budgets(aggs, s) for s in set_names}
        for name, temperature in best_budgets(aggs):
            if name in (BASELINE, HF_METHOD, LLAMACPP_METHOD):
                continue
            cells = []
            for s in set_names:
                a = per_set[s].get((name, temperature))
                speed = f"{_fmt(a['speedup'])}×" + (f" / {_fmt(a['speedup_hf'])}×" if hf else "") if a else ""
                cells.append("-" if a is None else f"{speed} ({_fmt(a['tau'])}, {budget_name(a['budget'])})")
            lines.append(f"| {name} | {temperature:g} | " + " | ".join(cells) + " |")
    if result.auto_vs_sweep:
        lines += ["", "Budget auto (per round) against the best fixed budget of the sweep", "",
                  "| method | set | T | auto speedup (τ) | best fixed budget | best speedup (τ) "
                  "| auto / best |",
                  "|---|---|---|---|---|---|---|"]
        for r in result.auto_vs_sweep:
            lines.append(f"| {r['series']} | {r['set']} | {r['temperature']:g} | "
                         f"{_fmt(r['auto_speedup'])}× ({_fmt(r['auto_tau'])}) | "
                         f"{budget_name(r['best_budget'])} | {_fmt(r['best_speedup'])}× "
                         f"({_fmt(r['best_tau'])}) | {_fmt(100 * r['ratio'], 0)}% |")
    return "\n".join(lines) + "\n"


def _notes(result: BenchResult, hf: bool, llc: bool, modes: bool, sources: bool) -> list[str]:
    """The paragraphs under the main tables: what each baseline, column and suffix means."""
    aggs = [a for a in result.aggregates if a["set"] == "all"]
    lines = ["", DECODER_NOTE]
    if hf:
        lines += ["", HF_NOTE]
    if llc:
        agree = [a["agree_ar"] for a in aggs if a["method"] == LLAMACPP_METHOD and a["budget"] == "-"]
        lines += ["", LLAMACPP_NOTE.format(agree=_fmt(100 * agree[0], 0) if agree else "-")]
    if modes or result.llamacpp_failed:
        done = [f"{a['budget']} {a['draft_accepted']} / {a['drafted']}, "
                f"{_fmt(100 * a['agree_llamacpp'], 0)}%"
                for a in aggs if a["method"] == LLAMACPP_METHOD and a["budget"] != "-"]
        failed = [f"{label} FAILED: {error}" for label, error in result.llamacpp_failed.items()]
        lines += ["", NGRAM_MODES_NOTE.format(modes="; ".join(done + failed))]
    if sources:
        lines += ["", SOURCES_NOTE]
    chosen = [a for a in aggs if is_fallback(a["budget"]) or budget_name(a["budget"]) == "auto"]
    if any(is_fallback(a["budget"]) for a in chosen):
        lines += ["", FALLBACK_NOTE]
    if any(budget_name(a["budget"]) == "auto" for a in chosen):
        lines += ["", AUTO_NOTE]
    if chosen:
        lines.append("Rounds that speculated: " + "; ".join(
            f"{a['method']} {a['budget']} at T={a['temperature']:g} "
            f"{_fmt(100 * a['speculative_rounds'] / a['rounds'], 0)}%" for a in chosen if a["rounds"]) + ".")
    return lines


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
    # every method and variant ("dartree", "dartree+no-ngram", ...), in the report's order
    names = [name for name, t in best if t == temperatures[0]
             and best[(name, t)]["method"] not in (BASELINE, HF_METHOD, LLAMACPP_METHOD)]
    paths = []
    if names:
        t0 = temperatures[0]
        cols = min(3, len(names))
        nrows = -(-len(names) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3 * nrows), squeeze=False, sharex=True)
        chosen = {name: best[(name, t0)] for name in names}
        taus = {name: [r["tau"] for r in rows if r["method"] == a["method"] and r["budget"] == a["budget"]
                       and r["temperature"] == t0 and r["tau"] is not None] for name, a in chosen.items()}
        low = min((min(v) for v in taus.values() if v), default=1.0)
        high = max((max(v) for v in taus.values() if v), default=1.0)
        bins = [low + (high - low + 1e-9) * i / 20 for i in range(21)] if high > low else 10
        for ax, name in zip(axes.flat, names):
            a = chosen[name]
            ax.hist(taus[name], bins=bins, color="C0", edgecolor="white")
            ax.axvline(a["tau"], color="C3", linestyle="--")
            budget = "" if budget_name(a["budget"]) == "-" else f", budget {_budget_cell(a)}"
            ax.set_title(f"{a['method']}{budget}: τ {a['tau']:.2f}", fontsize=10)
            ax.set_xlabel("τ of a response (tokens per round)")
            ax.set_ylabel("responses")
        for ax in list(axes.flat)[len(names):]:
            ax.axis("off")
        fig.suptitle(f"Acceptance length per response, temperature {t0:g}, each method at its best budget")
        fig.tight_layout()
        paths.append(out / "tau_hist.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    for temperature in temperatures:
        fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
        for i, name in enumerate(names):
            mine = [a for a in aggs if a["set"] == "all" and a["temperature"] == temperature
                    and series(a["method"], a["budget"]) == name]
            color = f"C{i % 10}"
            fixed = sorted((a for a in mine if a["budget_value"] is not None), key=lambda a: a["budget_value"])
            lines = [a for a in mine if a["budget_value"] is None]  # chains, per-round budgets
            for ax, key in ((ax_s, "speedup"), (ax_t, "tau")):
                if fixed:
                    ax.plot([a["budget_value"] for a in fixed], [a[key] for a in fixed], "o-",
                            color=color, label=name)
                for a in lines:
                    ax.axhline(a[key], color=color, linestyle="--", label=f"{name} {_budget_cell(a)}")
        ax_s.axhline(1.0, color="grey", linewidth=0.8)
        for a in aggs:
            if a["set"] == "all" and a["method"] in (HF_METHOD, LLAMACPP_METHOD) \
                    and a["temperature"] == temperature:
                hf_row = a["method"] == HF_METHOD
                label = "HF generate" if hf_row else "llama.cpp" + (
                    "" if a["budget"] == "-" else f" {a['budget']}")
                ax_s.axhline(a["speedup"], color="black" if hf_row else "grey", linestyle=":", label=label)
        ax_s.legend(fontsize=7, loc="best")
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
