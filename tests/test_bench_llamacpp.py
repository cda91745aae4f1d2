"""The llama.cpp baseline: llama.cpp (xllamacpp) decoding the default target's GGUF file beside
dartree's methods in one `dartree bench` run."""

import os

import pytest
import torch

from dartree.bench import BenchSettings, format_table, run_benchmark
from dartree.bench.llamacpp_baseline import LLAMACPP_METHOD, LlamaCpp, NgramMode, agreement
from dartree.prompts import PromptSet

pytest.importorskip("xllamacpp")


def test_agreement_counts_the_shared_prefix():
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert agreement([1, 2], []) == 0.0 and agreement([], [5]) == 1.0


@pytest.fixture(scope="module")
def smollm2():
    defaults = pytest.importorskip("dartree.defaults")
    try:
        path = defaults.smollm2_gguf()
    except ModuleNotFoundError as exc:
        pytest.skip(str(exc))
    target, drafter, tokenizer = defaults.default_models(device="cpu", packed=True)
    return path, target, drafter, tokenizer


def test_llamacpp_decodes_the_file_greedily(smollm2):
    path, _, _, tokenizer = smollm2
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                        add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    llama = LlamaCpp(path, threads=1)
    first = llama.generate(list(ids), 8)
    assert len(first.tokens) == 8 and first.timings["decode"] > 0 and first.timings["prefill"] > 0
    assert llama.generate(list(ids), 8).tokens == first.tokens  # greedy: the same again
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        LlamaCpp(path.parent / "missing.gguf", threads=1)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        LlamaCpp(path, threads=0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_llamacpp_leaves_no_thread_behind(smollm2):
    """Each call runs in a child process: after it this process has no more threads than before
    (llama.cpp in-process kept a polling thread pool that halved the speed of what ran next)."""
    path, _, _, _ = smollm2
    before = len(os.listdir("/proc/self/task"))
    LlamaCpp(path, threads=2).generate([1, 2, 3], 2)
    assert len(os.listdir("/proc/self/task")) <= before


def test_ngram_modes_draft_and_keep_greedy_tokens(smollm2):
    """Two of llama.cpp's n-gram modes (a child process per call: the others run in the bench
    test's default set) draft on a prompt they can copy from and return plain llama.cpp's greedy
    tokens."""
    path, _, _, tokenizer = smollm2
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Repeat this code:\n" + code}],
                                        add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    plain = LlamaCpp(path, threads=1).generate(ids, 16)
    assert plain.drafted == plain.draft_accepted == 0
    for name in ("ngram_simple", "ngram_mod"):
        res = LlamaCpp(path, threads=1, mode=NgramMode.parse(name)).generate(ids, 16)
        assert res.tokens == plain.tokens, name
        assert 0 < res.draft_accepted <= res.drafted, name  # the second function copies the first


def test_llamacpp_failure_is_reported(smollm2, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(RuntimeError, match="llama.cpp failed"):
        LlamaCpp(bad, threads=1).generate([1, 2], 2)


def test_bench_reports_llamacpp_beside_the_methods(smollm2):
    path, target, drafter, tokenizer = smollm2
    settings = BenchSettings(methods=["ar", "dartree"], budgets=[2], temperatures=[0.0, 1.0],
                             max_new_tokens=6, warmup_tokens=2, hf_baseline=False, exact=True,
                             llamacpp=str(path), threads=1, llamacpp_modes=("ngram_simple",))
    result = run_benchmark(target, drafter, [PromptSet("mine", ["Say hello."])], settings,
                           tokenizer=tokenizer)
    rows = [r for r in result.rows if r["method"] == LLAMACPP_METHOD]
    assert [r["budget"] for r in rows] == ["-", "ngram_simple size_n=3 size_m=8"]
    assert all(r["temperature"] == 0.0 for r in rows)  # greedy only
    assert all(0.0 <= r["agree_ar"] <= 1.0 for r in rows) and 0.0 <= rows[1]["agree_llamacpp"] <= 1.0
    dartree_t0 = next(a for a in result.aggregates if a["method"] == "dartree" and a["set"] == "all"
                      and a["temperature"] == 0.0)
    assert dartree_t0["speedup_llamacpp"] > 0
    assert dartree_t0["speedup_llamacpp_ngram"] > 0 and not result.llamacpp_failed
    table = format_table(result)
    assert "vs llama.cpp |" in table and "vs llama.cpp n-gram |" in table


def test_llamacpp_step_is_timed_beside_ar(smollm2):
    from dartree.bench.floor import time_llamacpp_step

    path, target, _, _ = smollm2
    seconds = time_llamacpp_step(path, target.config.vocab_size, prefix_len=8, threads=1, steps=4, repeats=1)
    assert 0 < seconds < 1
