"""Losslessness end to end: every method's greedy output equals transformers' greedy decoding."""

import pytest
import torch

from dartree import SpeculativeDecoder
from dartree.decoding import METHODS

from helpers import OracleDrafter, greedy_reference, make_drafter, tiny_target

PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 42, 7, 7, 7, 64, 128, 31, 2]]
SETTINGS = dict(budget=12, width=4, candidates=8)


@pytest.fixture(scope="module", params=[("qwen3", torch.float32), ("llama", torch.float64)],
                ids=lambda p: f"{p[0]}-{str(p[1])[6:]}")
def target(request):
    return tiny_target(*request.param)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "long"])
def test_greedy_equals_target_random_drafter(target, method, prompt):
    drafter = make_drafter(target, domino=True, block_size=6)
    expected = greedy_reference(target, prompt, 24)
    res = SpeculativeDecoder(target, drafter, method=method, **SETTINGS).generate(
        prompt, max_new_tokens=24)
    assert res.tokens == expected
    assert sum(res.acceptance_lengths) >= len(res.tokens) - 1  # the first token comes from prefill
    assert all(a >= 1 for a in res.acceptance_lengths)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("block_size, budget", [(4, 3), (9, 20)])
def test_greedy_equals_target_oracle_drafter(target, method, block_size, budget):
    prompt = PROMPTS[1]
    expected = greedy_reference(target, prompt, 30)
    drafter = OracleDrafter(make_drafter(target, block_size=block_size), prompt, expected)
    dec = SpeculativeDecoder(target, drafter, method=method, budget=budget, width=4, candidates=8)
    res = dec.generate(prompt, max_new_tokens=30)
    assert res.tokens == expected
    if method not in ("ar", "ngram"):  # whole branches accepted: rounds commit more than one token
        assert max(res.acceptance_lengths) >= min(budget, drafter.num_slots)


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])  # the others need a head
def test_plain_dflash_drafter(target, method):
    prompt = PROMPTS[0]
    drafter = make_drafter(target, domino=False, block_size=5)
    expected = greedy_reference(target, prompt, 20)
    res = SpeculativeDecoder(target, drafter, method=method, **SETTINGS).generate(prompt, max_new_tokens=20)
    assert res.tokens == expected


@pytest.mark.parametrize("method", METHODS)
def test_eos_mid_round_and_at_the_end(target, method):
    prompt = PROMPTS[1]
    free = greedy_reference(target, prompt, 30)
    drafter = OracleDrafter(make_drafter(target, block_size=8), prompt, free)
    # an EOS whose first occurrence falls inside a round (oracle rounds accept ~8 tokens), and one
    # at exactly the last allowed position
    mid = next(i for i, t in enumerate(free) if free.index(t) == i and i >= 3)
    last = next(n for n in range(len(free), 0, -1) if free.index(free[n - 1]) == n - 1)
    for eos, limit in [(free[mid], 30), (free[last - 1], last)]:
        expected = greedy_reference(target, prompt, limit, eos_token_id=eos)
        dec = SpeculativeDecoder(target, drafter, method=method, **SETTINGS)
        assert dec.generate(prompt, max_new_tokens=limit, eos_token_id=eos).tokens == expected


@pytest.mark.parametrize("method", ["ddtree", "dartree", "dartree-fixed"])
def test_budget_smaller_than_the_block(target, method):
    prompt = PROMPTS[0]
    drafter = make_drafter(target, block_size=8)
    expected = greedy_reference(target, prompt, 12)
    dec = SpeculativeDecoder(target, drafter, method=method, budget=2, width=2, candidates=4)
    rows = []
    full = drafter.base_logits
    drafter.base_logits = lambda h: rows.append(h.shape[0]) or full(h)
    try:
        assert dec.generate(prompt, max_new_tokens=12).tokens == expected
        assert dec.propose(prompt).num_nodes == 3
    finally:
        del drafter.base_logits
    assert rows and set(rows) == {2}  # the LM head runs on the slots a 2-node tree can reach


def test_result_fields_and_timings(target):
    drafter = make_drafter(target)
    res = SpeculativeDecoder(target, drafter).generate(torch.tensor([PROMPTS[0]]), max_new_tokens=8)
    assert len(res.tokens) == 8
    for stage in ("prefill", "draft", "tree", "verify", "accept", "commit", "decode"):
        assert res.timings[stage] >= 0
    assert res.mean_acceptance >= 1


def test_propose_returns_a_valid_tree(target):
    drafter = make_drafter(target, block_size=8)
    dec = SpeculativeDecoder(target, drafter, method="dartree", budget=10, width=3, candidates=5)
    tree = dec.propose(PROMPTS[0])
    tree.validate()
    assert tree.num_nodes == 11
    assert bool((tree.parents[1:] < torch.arange(1, 11)).all())


@pytest.mark.parametrize("method", ["ar", "dartree"])
def test_streamer_receives_exactly_the_tokens(target, method):
    """The streamer's chunks, joined, are the result's tokens: cut at EOS and at the length
    limit even when a round commits past them."""
    prompt = PROMPTS[1]
    free = greedy_reference(target, prompt, 30)
    drafter = OracleDrafter(make_drafter(target, block_size=8), prompt, free)
    mid = next(i for i, t in enumerate(free) if free.index(t) == i and i >= 3)
    for eos, limit in [(None, 13), (free[mid], 30)]:
        chunks = []
        res = SpeculativeDecoder(target, drafter, method=method, **SETTINGS).generate(
            prompt, max_new_tokens=limit, eos_token_id=eos, streamer=chunks.append)
        assert [t for chunk in chunks for t in chunk] == res.tokens
        assert all(chunks) and len(chunks) <= len(res.acceptance_lengths) + 1


def test_default_budget_follows_the_device(monkeypatch):
    """budget=None: default_budget of the target's device and dtype (CUDA and AMX 16-bit trees
    tile-aligned: budget + 1 rows a multiple of 16; elsewhere on a CPU the smallest measured
    tree); an explicit budget wins."""
    from dartree import hardware
    from dartree.hardware import DEFAULT_BUDGETS, default_budget

    for amx, f32, bf16 in ((True, 4, 15), (False, 2, 4)):
        monkeypatch.setattr(hardware, "has_amx_bf16", lambda: amx)
        for dtype, expected in [(torch.float32, f32), (torch.bfloat16, bf16)]:
            target = tiny_target("llama", dtype)
            drafter = make_drafter(target, block_size=8)
            assert SpeculativeDecoder(target, drafter).budget == expected, (amx, dtype)
            assert SpeculativeDecoder(target, drafter, budget=7).budget == 7
        assert default_budget(torch.device("cpu"), torch.float64) == f32
        assert default_budget(torch.device("cuda"), torch.float32) == 63
        assert default_budget(torch.device("mps"), torch.float16) == 63
    assert all((b + 1) % 16 == 0 for (kind, bits), b in DEFAULT_BUDGETS.items()
               if kind == "cuda" or kind == "cpu-amx" and bits == 16)
