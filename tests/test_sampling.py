"""Temperature > 0: the method's first tokens have the target's own sampling distribution.

For a tiny vocabulary the exact joint distribution of the first three new tokens is computed from
the target, and a chi-square test compares it with thousands of `generate` calls. The third token
is the first that can come from an accepted draft node, so acceptance is what is being tested.
Position-keyed sampling (`seed=`) is tested the same way over many seeds, every method returning
the one-token loop's tokens for each seed.
"""

import itertools

import pytest
import torch

from dartree import SpeculativeDecoder
from dartree.decoding import METHODS

from helpers import chi_square_p_value, make_drafter, tiny_target

VOCAB, SAMPLES, TEMPERATURE = 4, 600, 1.0
PROMPT = [1, 3, 2, 3]
pytestmark = pytest.mark.usefixtures("one_thread")


def exact_joint(model) -> torch.Tensor:
    """p(t1, t2, t3) of the target's own sampling at TEMPERATURE: [V, V, V]."""
    pairs = torch.tensor(list(itertools.product(range(VOCAB), repeat=2)))
    ids = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        logits = model(ids).logits.double() / TEMPERATURE
    p1 = torch.softmax(logits[0, len(PROMPT) - 1], -1)
    p2 = torch.softmax(logits[::VOCAB, len(PROMPT)], -1)            # [t1, t2]
    p3 = torch.softmax(logits[:, len(PROMPT) + 1], -1).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.fixture(scope="module")
def target():
    model = tiny_target("qwen3", vocab=VOCAB, layers=2, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.4)  # moderate entropy: every cell is reachable
    return model


@pytest.mark.parametrize("method", ["dflash", "domino", "ddtree", "dartree-fixed", "dartree"])
def test_first_tokens_follow_the_target_distribution(target, method):
    drafter = make_drafter(target, block_size=4, seed=1)
    dec = SpeculativeDecoder(target, drafter, method=method, budget=6, width=3, candidates=4)
    generator = torch.Generator().manual_seed(1234)
    counts = torch.zeros(VOCAB ** 3, dtype=torch.float64)
    accepted = 0
    for _ in range(SAMPLES):
        res = dec.generate(PROMPT, max_new_tokens=3, temperature=TEMPERATURE, generator=generator)
        t1, t2, t3 = res.tokens
        counts[(t1 * VOCAB + t2) * VOCAB + t3] += 1
        accepted += res.acceptance_lengths[0] > 1
    p_value = chi_square_p_value(counts, exact_joint(target).flatten())
    assert p_value > 1e-3, f"{method}: p = {p_value:.2e}"
    assert accepted > SAMPLES // 20, "draft nodes were almost never accepted: a weak test"


def test_the_test_detects_a_wrong_distribution(target):
    """The same check rejects samples drawn at the wrong temperature."""
    dec = SpeculativeDecoder(target, None, method="ar")
    generator = torch.Generator().manual_seed(99)
    counts = torch.zeros(VOCAB ** 3, dtype=torch.float64)
    for _ in range(SAMPLES):
        t1, t2, t3 = dec.generate(PROMPT, max_new_tokens=3, temperature=0.6, generator=generator).tokens
        counts[(t1 * VOCAB + t2) * VOCAB + t3] += 1
    assert chi_square_p_value(counts, exact_joint(target).flatten()) < 1e-6


def test_keyed_sampling_follows_the_target_distribution(target):
    """seed = 0 .. SAMPLES-1: the `ar` tokens of each seed have the target's distribution, and for
    the first SAMPLES // 3 seeds every method returns exactly those tokens, with drafts accepted
    (so the equality covers accepted nodes, not only bonus tokens)."""
    drafter = make_drafter(target, block_size=4, seed=1)
    decoders = {method: SpeculativeDecoder(target, drafter, method=method, budget=6, width=3,
                                           candidates=4) for method in METHODS}
    counts = torch.zeros(VOCAB ** 3, dtype=torch.float64)
    accepted = dict.fromkeys(METHODS, 0)
    for seed in range(SAMPLES):
        expected = decoders["ar"].generate(PROMPT, max_new_tokens=3, temperature=TEMPERATURE,
                                           seed=seed).tokens
        for method in METHODS[1:] if seed < SAMPLES // 3 else ():
            res = decoders[method].generate(PROMPT, max_new_tokens=3, temperature=TEMPERATURE, seed=seed)
            assert res.tokens == expected, (method, seed)
            accepted[method] += res.acceptance_lengths[0] > 1
        t1, t2, t3 = expected
        counts[(t1 * VOCAB + t2) * VOCAB + t3] += 1
    p_value = chi_square_p_value(counts, exact_joint(target).flatten())
    assert p_value > 1e-3, f"p = {p_value:.2e}"
    assert all(accepted[m] > SAMPLES // 60 for m in METHODS[1:]), accepted


def test_keyed_the_test_detects_a_wrong_distribution(target):
    dec = SpeculativeDecoder(target, None, method="ar")
    counts = torch.zeros(VOCAB ** 3, dtype=torch.float64)
    for seed in range(SAMPLES):
        t1, t2, t3 = dec.generate(PROMPT, max_new_tokens=3, temperature=0.6, seed=seed).tokens
        counts[(t1 * VOCAB + t2) * VOCAB + t3] += 1
    assert chi_square_p_value(counts, exact_joint(target).flatten()) < 1e-6
