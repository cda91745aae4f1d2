"""Lookup branches in the decoder: method ngram, ngram= on the tree methods, budget="auto";
exact against the target alone, today's trees with ngram=False, memory flat over long use."""

import random
import time

import pytest
import torch

from dartree import SpeculativeDecoder
from dartree.methods import TREE_METHODS
from helpers import greedy_reference, make_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", torch.float32)


def repeating_prompt(seed, length=40, vocab=256):
    """Random tokens whose second half copies stretches of the first (so lookups fire)."""
    rng = random.Random(seed)
    base = [rng.randrange(vocab) for _ in range(length // 2)]
    out = list(base)
    while len(out) < length:
        start = rng.randrange(len(base) - 4)
        out += base[start:start + rng.randrange(3, 9)]
    return out[:length]


def test_ngram_copies_what_the_target_repeats(target):
    """A target that repeats its prompt: the lookup proposes the repeat and rounds commit many
    tokens, with the target's own output."""
    prompt = repeating_prompt(3)
    expected = greedy_reference(target, prompt, 48)
    # continue the prompt with the target's own answer twice: the third answer copies the second
    context = prompt + expected + prompt
    again = greedy_reference(target, context, 48)
    for kw in (dict(method="ngram", budget=8), dict(method="ngram", budget="auto")):
        res = SpeculativeDecoder(target, None, **kw).generate(context, max_new_tokens=48)
        assert res.tokens == again
        if again[:16] == expected[:16]:  # the target copies: whole stretches accepted
            assert max(res.acceptance_lengths) >= 6 and res.accepted_by_source["lookup"] >= 20
        assert res.accepted_by_source["drafter"] == res.accepted_by_source["both"] == 0


@pytest.mark.parametrize("method", TREE_METHODS)
def test_ngram_false_verifies_the_drafters_tree_as_built(target, method, monkeypatch):
    drafter = make_drafter(target, block_size=6)
    dec = SpeculativeDecoder(target, drafter, method=method, budget=6, width=3, candidates=8,
                             ngram=False)
    built, verified = [], []
    build, verify = dec._spec.build, dec._verify
    monkeypatch.setattr(dec, "_spec", type(dec._spec)(**{**dec._spec.__dict__, "build": lambda *a: built.append(
        build(*a)) or built[-1]}))
    monkeypatch.setattr(dec, "_verify", lambda tree, sampling, watch: verified.append(tree) or verify(tree, sampling, watch))
    res = dec.generate(repeating_prompt(1), max_new_tokens=20)
    assert res.tokens == greedy_reference(target, repeating_prompt(1), 20)
    assert len(verified) == len(built) > 0 and all(a is b for a, b in zip(verified, built))
    assert res.accepted_by_source["lookup"] == res.accepted_by_source["both"] == 0


def test_with_ngram_the_lookup_adds_branches_and_sources_add_up(target):
    drafter = make_drafter(target, block_size=6)
    prompt = repeating_prompt(5)
    expected = greedy_reference(target, prompt, 40)
    dec = SpeculativeDecoder(target, drafter, method="dartree", budget=8, width=3, candidates=8)
    for _ in range(2):  # the second call also finds the first one's output in the store
        res = dec.generate(prompt, max_new_tokens=40)
        assert res.tokens == expected
        assert sum(res.accepted_by_source.values()) == sum(res.acceptance_lengths) - len(res.acceptance_lengths)
    assert res.accepted_by_source["lookup"] + res.accepted_by_source["both"] > 0
    assert res.mean_acceptance > 3  # the store holds this very answer


def test_auto_budget_runs_one_token_rounds_when_nothing_pays(target, monkeypatch):
    """A verify whose extra rows cost 4 ms each (a tiny model's row, ~1 ms): the planner stops
    speculating."""
    dec = SpeculativeDecoder(target, make_drafter(target, block_size=6), budget="auto")
    verify = dec._verify

    def slow_verify(tree, sampling, watch):
        with watch("verify"):
            time.sleep(0.004 * (tree.num_nodes - 1))
        return verify(tree, sampling, watch)

    monkeypatch.setattr(dec, "_verify", slow_verify)
    prompt = [random.Random(s).randrange(256) for s in range(30)]
    res = dec.generate(prompt, max_new_tokens=80)
    assert res.tokens == greedy_reference(target, prompt, 80)
    assert res.speculated[-20:] == [False] * 20
    assert dec.fallback_gate is None  # the planner chooses one-token rounds itself


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
def test_resident_memory_stays_flat_over_long_use():
    """A 4,000-token generation, then 200 requests on one decoder (store and calibration growing):
    resident memory within 5% of what it was after the first 10."""
    model = tiny_target("qwen3", torch.float32)
    model.config.max_position_embeddings = 8192
    dec = SpeculativeDecoder(model, make_drafter(model, block_size=6), budget="auto",
                             lookup_store_mb=1.0)
    samples = []
    dec.generate(repeating_prompt(0), max_new_tokens=4000,
                 streamer=lambda new: samples.append(rss_kb()))
    early, late = samples[len(samples) // 10], samples[-1]
    assert late <= 1.05 * early, (early, late)
    after = []
    for request in range(200):
        dec.generate(repeating_prompt(request, length=60), max_new_tokens=32)
        after.append(rss_kb())
    assert after[-1] <= 1.05 * after[9], (after[9], after[-1])
    assert dec._lookup.store.num_bytes <= dec._lookup.store.max_bytes
