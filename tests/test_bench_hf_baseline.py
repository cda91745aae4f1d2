"""dartree.bench.hf_baseline: transformers' generate as the external baseline, and its clock."""

import pytest

from dartree import SpeculativeDecoder
from dartree.bench.hf_baseline import hf_generate, timed_hf_generate

from helpers import greedy_reference, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 99, 3, 42]


@pytest.fixture(scope="module")
def target():
    return tiny_target(kind="llama", layers=2)


def test_greedy_equals_transformers_and_ar(target):
    hf_generate(target, PROMPT, 2)  # warm, as the bench is before it times: a cold first call can
    res = timed_hf_generate(target, PROMPT, 12)  # outlast the 12-token one (decode clamped to 0)
    assert res.tokens == greedy_reference(target, PROMPT, 12)
    assert res.tokens == SpeculativeDecoder(target, method="ar").generate(PROMPT, max_new_tokens=12).tokens
    assert res.acceptance_lengths == [1] * 11  # one step per token after the first, as ar
    assert res.timings["prefill"] > 0 and res.timings["decode"] > 0


def test_only_the_given_eos_stops(target):
    free = hf_generate(target, PROMPT, 12)
    eos = free[3]
    first = free.index(eos)
    assert hf_generate(target, PROMPT, 12, eos_token_id=eos) == free[:first + 1]  # EOS included
    saved = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = eos  # the model's own EOS does not apply
    try:
        assert hf_generate(target, PROMPT, 12, eos_token_id=None) == free
        assert target.generation_config.eos_token_id == eos  # restored after the call
    finally:
        target.generation_config.eos_token_id = saved


def test_sampling_is_seeded(target):
    a = hf_generate(target, PROMPT, 12, temperature=1.0, seed=3)
    assert a == hf_generate(target, PROMPT, 12, temperature=1.0, seed=3)
    assert len(a) == 12
    others = [hf_generate(target, PROMPT, 12, temperature=1.0, seed=s) for s in range(4, 8)]
    assert any(o != a for o in others)  # it samples: not greedy
