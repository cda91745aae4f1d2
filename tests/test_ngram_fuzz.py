"""Fuzz: lookup branches never change a token. 1,080 generate calls over random Qwen3 and Llama
targets and prompts built to repeat (so lookups fire, and miss), on decoders kept from call to
call (their stores and calibration grow): every output equals the target decoding alone, in
float32 (HF generate), bfloat16 with exact=True (`dartree.exact()` generate) and at T > 0 with a
seed (one-token decoding with that seed)."""

import random

import pytest
import torch

import dartree
from dartree import SpeculativeDecoder
from helpers import greedy_reference, make_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

RUNS = 120  # per case below: 9 cases, 1,080 runs
CONFIGS = [dict(method="ngram", budget=4), dict(method="ngram", budget="auto"),
           dict(method="dartree", budget=6), dict(method="ddtree", budget="auto"),
           dict(method="dartree", budget="auto")]


def fuzz_prompt(rng: random.Random, vocab: int) -> list[int]:
    """Random tokens, then copies of their stretches (some altered), sometimes a long repeat."""
    base = [rng.randrange(vocab) for _ in range(rng.randrange(2, 24))]
    out = list(base)
    for _ in range(rng.randrange(0, 6)):
        start = rng.randrange(len(base))
        piece = base[start:start + rng.randrange(1, 12)]
        if piece and rng.random() < 0.3:
            piece[rng.randrange(len(piece))] = rng.randrange(vocab)
        out += piece
    return out


def decoders(target, drafter):
    return [SpeculativeDecoder(target, None if c["method"] == "ngram" else drafter, width=3,
                               candidates=8, exact=target.dtype != torch.float32,
                               lookup_store_mb=0.05, **c) for c in CONFIGS]


@pytest.mark.slow
@pytest.mark.parametrize("case, kind, dtype, temperature", [
    (0, "qwen3", torch.float32, 0.0), (1, "llama", torch.float32, 0.0), (2, "qwen3", torch.float32, 0.9),
    (3, "qwen3", torch.bfloat16, 0.0), (4, "llama", torch.bfloat16, 0.0), (5, "llama", torch.bfloat16, 0.8),
    (6, "llama", torch.float32, 1.0), (7, "qwen3", torch.float32, 0.0), (8, "llama", torch.float32, 0.0)])
def test_lookup_branches_never_change_a_token(case, kind, dtype, temperature):
    rng = random.Random(case)
    vocab = rng.choice([16, 64, 256])  # a small vocabulary repeats more
    target = tiny_target(kind, dtype, vocab=vocab, layers=2, seed=case)
    decs = decoders(target, make_drafter(target, block_size=rng.choice([4, 7]), seed=case))
    ar = SpeculativeDecoder(target, None, method="ar", exact=dtype != torch.float32)
    proposed = hits = 0
    for run in range(RUNS):
        prompt = fuzz_prompt(rng, vocab)
        new = rng.randrange(1, 24)
        dec = decs[run % len(decs)]
        seed = rng.randrange(2**64)
        if temperature > 0:
            expected = ar.generate(prompt, new, temperature, seed=seed).tokens
        elif dtype == torch.float32:
            expected = greedy_reference(target, prompt, new)
        else:
            with dartree.exact():
                expected = greedy_reference(target, prompt, new)
        res = dec.generate(prompt, new, temperature, seed=seed)
        assert res.tokens == expected, (run, dec.method, dec.auto, prompt, new)
        hits += res.accepted_by_source["lookup"] + res.accepted_by_source["both"] > 0
        proposed += dec.method == "ngram" and any(res.speculated)  # the lookup found branches
    assert proposed > 0 and hits < RUNS  # lookups fired, and missed
    assert hits > 0 or temperature > 0  # and at T = 0 were taken
