"""Position-keyed sampling end to end: at temperature > 0 with a seed, every method, budget and
tree returns exactly the tokens of the one-token loop (`ar`) with that seed, and those equal
transformers' `generate` with `dartree.PositionKeyedSampler` (float32, random-init targets)."""

import pytest
import torch
from transformers import LogitsProcessorList

import dartree
from dartree import SpeculativeDecoder
from dartree.decoding import METHODS

from helpers import OracleDrafter, make_drafter, tiny_target

PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 42, 7, 7, 7, 64, 128, 31, 2]]
NEW = 20
pytestmark = pytest.mark.usefixtures("one_thread")
# (method, budget): the chain methods ignore the budget
RUNS = [("dflash", 0), ("domino", 0)] + [(m, b) for m in ("ddtree", "dartree-fixed", "dartree")
                                         for b in (3, 12)]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request):
    return tiny_target(request.param, torch.float32)


def hf_keyed(model, prompt, max_new_tokens, seed, temperature):
    ids = torch.tensor([prompt])
    sampler = dartree.PositionKeyedSampler(seed, temperature)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, min_new_tokens=0, pad_token_id=0,
                         eos_token_id=None, logits_processor=LogitsProcessorList([sampler]))
    return out[0, len(prompt):].tolist()


def decoder(target, drafter, method, budget):
    return SpeculativeDecoder(target, drafter, method=method, budget=max(budget, 1), width=4,
                              candidates=8)


@pytest.mark.parametrize("prompt, seed, temperature", [(PROMPTS[0], 0, 1.0), (PROMPTS[1], 2**64 - 9, 1.0),
                                                     (PROMPTS[1], 31, 0.7)])
def test_every_method_returns_the_one_token_samples(target, prompt, seed, temperature):
    expected = decoder(target, None, "ar", 1).generate(prompt, NEW, temperature, seed=seed).tokens
    assert hf_keyed(target, prompt, NEW, seed, temperature) == expected
    drafter = make_drafter(target, block_size=6)
    for method, budget in RUNS:
        res = decoder(target, drafter, method, budget).generate(prompt, NEW, temperature, seed=seed)
        assert res.tokens == expected, (method, budget)


@pytest.mark.parametrize("block_size", [4, 9])
def test_accepted_branches_are_the_one_token_samples(target, block_size):
    """An oracle drafter proposes the seed's own continuation: whole branches are accepted, and
    the output is still exactly the one-token loop's."""
    prompt, seed = PROMPTS[1], 4242
    expected = decoder(target, None, "ar", 1).generate(prompt, 30, 1.0, seed=seed).tokens
    drafter = OracleDrafter(make_drafter(target, block_size=block_size), prompt, expected)
    for method, budget in RUNS:
        res = decoder(target, drafter, method, budget).generate(prompt, 30, 1.0, seed=seed)
        assert res.tokens == expected, (method, budget)
        branch = min(budget, drafter.num_slots) if budget else drafter.num_slots
        assert max(res.acceptance_lengths) >= branch, (method, budget, res.acceptance_lengths)


def test_the_seed_decides_the_tokens(target):
    dec = decoder(target, None, "ar", 1)
    runs = [dec.generate(PROMPTS[0], 16, 1.0, seed=seed).tokens for seed in range(4)]
    assert len({tuple(r) for r in runs}) > 1
    assert dec.generate(PROMPTS[0], 16, 1.0, seed=2).tokens == runs[2]
    greedy = dec.generate(PROMPTS[0], 16, 0.0).tokens
    assert dec.generate(PROMPTS[0], 16, 0.0, seed=5).tokens == greedy  # no effect at T = 0


def test_generator_path_is_unchanged_and_exclusive(target):
    dec = decoder(target, make_drafter(target), "dartree", 8)
    first = dec.generate(PROMPTS[0], 12, 1.0, generator=torch.Generator().manual_seed(3)).tokens
    # a generator's draws follow the tree's size: the same decoder state gives the same tokens (a
    # fresh decoder: its lookup store and calibration start alike), and so does ngram=False on one
    again = decoder(target, make_drafter(target), "dartree", 8)
    assert again.generate(PROMPTS[0], 12, 1.0, generator=torch.Generator().manual_seed(3)).tokens == first
    plain = SpeculativeDecoder(target, make_drafter(target), budget=8, width=4, candidates=8, ngram=False)
    runs = [plain.generate(PROMPTS[0], 12, 1.0, generator=torch.Generator().manual_seed(3)).tokens
            for _ in range(2)]
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="not both"):
        dec.generate(PROMPTS[0], 4, 1.0, generator=torch.Generator(), seed=1)
    for bad in (-1, 2**64, 1.0, True):
        with pytest.raises(ValueError, match="seed must be"):
            dec.generate(PROMPTS[0], 4, 1.0, seed=bad)
    for bad in (0.0, -1.0, "1"):
        with pytest.raises(ValueError, match="temperature must be"):
            dartree.PositionKeyedSampler(1, bad)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_seed_with_exact_mode_in_bfloat16(native, kind):
    """Seed and exact=True together in bfloat16: every method returns HF generate's position-keyed
    samples inside dartree.exact(). This guards the combination (keyed noise through the exact
    verify); on these tiny models a 1-ulp logit difference rarely flips a sample, so the bfloat16
    effect itself is shown on SmolLM2 by bench/exact_check.py."""
    target = tiny_target(kind, torch.bfloat16)
    prompt, seed, temperature = PROMPTS[1], 77, 1.0
    with dartree.exact():
        expected = hf_keyed(target, prompt, 32, seed, temperature)
    drafter = make_drafter(target, block_size=6)
    for method, budget in [("ar", 0)] + RUNS:
        dec = SpeculativeDecoder(target, drafter, method=method, budget=max(budget, 1), width=4,
                                 candidates=8, exact=True)
        assert dec.generate(prompt, 32, temperature, seed=seed).tokens == expected, (method, budget)
