"""The fallback: one-token rounds where speculation measures slower, with the same tokens."""

import re
import time

import pytest
import torch

from dartree import SpeculativeDecoder
from dartree.fallback import FallbackGate
from dartree.methods import METHODS, lookup

from helpers import OracleDrafter, greedy_reference, make_drafter, tiny_target

PROMPT = [200, 1, 1, 42, 7, 7, 7, 64, 128, 31, 2]
SPECULATIVE = [m for m in METHODS if lookup(m).drafter]  # the drafter's rounds
SETTINGS = dict(budget=12, width=4, candidates=8)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request):
    return tiny_target(request.param, torch.float32)


def _play(gate: FallbackGate, rounds: int, cost) -> str:
    """Run the gate over the simulated rounds of one call; cost(i, speculate) -> (seconds,
    tokens). Returns the kinds played, "S" speculative and "." one-token."""
    kinds = []
    gate.begin_call()
    for i in range(rounds):
        kind = gate.speculate()
        gate.record(kind, *cost(i, kind))
        kinds.append("S" if kind else ".")
    return "".join(kinds)


def _runs(kinds: str) -> list[tuple[str, int]]:
    return [(m.group()[0], len(m.group())) for m in re.finditer(r"S+|\.+", kinds)]


def test_gate_probes_both_kinds_then_keeps_the_cheaper():
    # speculation: 3 ms a round for 1.5 tokens (2 ms a token) against 1 ms a token
    kinds = _play(FallbackGate(), 300, lambda i, s: ((3e-3, 1 + i % 2) if s else (1e-3, 1)))
    # unmeasured first round, 3 + 2 measured; then 3 speculative rounds tried after 32 one-token
    # rounds, then after 64, 128, 128
    assert _runs(kinds) == [("S", 4), (".", 2 + 32), ("S", 3), (".", 64), ("S", 3), (".", 128),
                            ("S", 3), (".", 300 - 239)]
    # the other way round: 2 one-token rounds tried after 32, 64, ... speculative rounds
    kinds = _play(FallbackGate(), 300, lambda i, s: (2e-3, 3) if s else (1e-3, 1))
    assert _runs(kinds) == [("S", 4), (".", 2), ("S", 32), (".", 2), ("S", 64), (".", 2),
                            ("S", 128), (".", 2), ("S", 300 - 236)]
    # other gaps
    kinds = _play(FallbackGate(first_gap=4, max_gap=8), 40, lambda i, s: (2e-3, 1) if s else (1e-3, 1))
    assert _runs(kinds) == [("S", 4), (".", 2 + 4), ("S", 3), (".", 8), ("S", 3), (".", 8),
                            ("S", 3), (".", 40 - 35)]


def test_gate_follows_a_change_of_acceptance():
    """τ falls from 4 to 1 at round 100 (speculation from 1.6x faster to 2.5x slower): the gate
    moves to one-token rounds within a few rounds, and back to speculation within max_gap rounds
    of τ's return at round 300."""
    def cost(i, speculate):
        if not speculate:
            return 1e-3, 1
        return 2.5e-3, 4 if i < 100 or i >= 300 else 1
    kinds = _play(FallbackGate(), 600, cost)
    assert kinds[100:300].find("....") < 12            # out within a few rounds of the fall
    assert kinds[110:300].count("S") <= 3 * 3          # then only the tries (32, 64, 128)
    back = kinds.find("S" * 10, 300)
    assert 300 < back <= 300 + 128 + 3
    assert kinds[back:].count(".") <= 2 * 3            # speculating again, tried against ar


def test_gate_carries_its_measurements_into_the_next_call():
    """A later call starts from the kind that leads, its tries on the gap schedule reached; its
    first speculative round (the drafter reading the prompt) is not measured."""
    gate = FallbackGate()
    cost = lambda i, s: (30e-3 if s and i == 0 else 3e-3, 1 + i % 2) if s else (1e-3, 1)
    assert _runs(_play(gate, 50, cost)) == [("S", 4), (".", 2 + 32), ("S", 3), (".", 50 - 41)]
    # 55 more one-token rounds reach the gap of 64; the try's first round is unmeasured: 1 + 3
    assert _runs(_play(gate, 70, cost)) == [(".", 55), ("S", 4), (".", 70 - 59)]
    assert gate.leader() is False and gate.gap == 128


def test_gate_rejects_bad_settings_and_rounds():
    for kwargs in (dict(speculative_probe=0), dict(ar_probe=True), dict(first_gap=2.0),
                   dict(first_gap=32, max_gap=16)):
        with pytest.raises(ValueError):
            FallbackGate(**kwargs)
    with pytest.raises(ValueError, match="at least one token"):
        FallbackGate().record(True, 1e-3, 0)


class _Scripted(FallbackGate):
    """A gate that plays a fixed pattern of round kinds (repeated), whatever the time."""

    def __init__(self, pattern):
        super().__init__()
        self.pattern, self.i = pattern, 0

    def speculate(self):
        kind = self.pattern[self.i % len(self.pattern)]
        self.i += 1
        return kind

    def record(self, speculated, seconds, tokens):
        assert seconds >= 0 and tokens >= 1


@pytest.mark.parametrize("method", SPECULATIVE)
def test_mixed_rounds_give_the_target_tokens(target, method):
    """Any mix of speculative and one-token rounds commits the target's greedy tokens, and the
    drafter reads every position's features exactly once, as a pure run gives them."""
    pattern = [True, False, False, True, True, False, False, False, True]
    expected = greedy_reference(target, PROMPT, 40)

    def run(fallback):
        drafter = make_drafter(target, block_size=6)
        seen, draft = [], drafter.draft
        drafter.draft = lambda f, b, s, **kw: seen.append((drafter.ctx_len, s, f.clone())) or draft(f, b, s, **kw)
        res = SpeculativeDecoder(target, drafter, method=method, fallback=fallback,
                                 **SETTINGS).generate(PROMPT, max_new_tokens=40)
        return res, seen

    mixed, seen = run(_Scripted(pattern))
    assert mixed.tokens == expected
    kinds = (pattern * 40)[:len(mixed.speculated)]
    assert mixed.speculated == kinds and False in kinds
    assert [a for a, k in zip(mixed.acceptance_lengths, kinds) if not k] == [1] * kinds.count(False)
    # contiguous: each draft starts where the last one ended and covers up to its position
    assert seen[0][0] == 0 and all(b[0] == a[1] for a, b in zip(seen, seen[1:]))
    assert all(f.shape[0] == s - start for start, s, f in seen)
    pure, pure_seen = run(False)
    assert pure.tokens == expected and all(pure.speculated)
    end = min(seen[-1][1], pure_seen[-1][1])
    mixed_features = torch.cat([f for *_, f in seen])[:end]
    pure_features = torch.cat([f for *_, f in pure_seen])[:end]
    torch.testing.assert_close(mixed_features, pure_features, atol=1e-5, rtol=1e-5)


def test_mixed_rounds_keep_an_oracle_drafter_in_step(target):
    """After one-token rounds the drafter drafts from the right position: an oracle drafter's
    speculative rounds still accept whole blocks."""
    expected = greedy_reference(target, PROMPT, 60)
    drafter = OracleDrafter(make_drafter(target, block_size=8), PROMPT, expected)
    res = SpeculativeDecoder(target, drafter, method="dartree", fallback=_Scripted([True, False, False]),
                             **SETTINGS).generate(PROMPT, max_new_tokens=60)
    assert res.tokens == expected
    spec = [a for a, k in zip(res.acceptance_lengths[:-1], res.speculated) if k]
    assert len(spec) >= 3 and min(spec) >= 8  # every whole round accepted its block (8 slots)


def test_sampling_with_a_seed_gives_ar_tokens(target):
    drafter = make_drafter(target, block_size=6)
    kwargs = dict(max_new_tokens=30, temperature=0.8, seed=7)
    want = SpeculativeDecoder(target, None, method="ar").generate(PROMPT, **kwargs).tokens
    got = SpeculativeDecoder(target, drafter, method="dartree", fallback=True,
                             **SETTINGS).generate(PROMPT, **kwargs)
    assert got.tokens == want


def test_slow_drafts_fall_back_and_an_oracle_keeps_speculating(target):
    """The real gate on measured time: a drafter made 30 ms slower a pass loses to one-token
    rounds; an oracle drafter (whole blocks accepted) keeps speculating."""
    expected = greedy_reference(target, PROMPT, 80)
    slow = make_drafter(target, block_size=6)
    draft = slow.draft
    slow.draft = lambda *a, **kw: time.sleep(0.03) or draft(*a, **kw)
    dec = SpeculativeDecoder(target, slow, method="dartree", fallback=True, **SETTINGS)
    res = dec.generate(PROMPT, max_new_tokens=80)
    assert res.tokens == expected
    assert sum(res.speculated) <= 4 + 3  # the first 4, then one try (after 32 rounds)
    assert dec.fallback_gate.leader() is False
    res = dec.generate(PROMPT, max_new_tokens=80)  # the decoder's gate: one-token rounds from the start
    assert res.tokens == expected and not res.speculated[0]
    assert sum(res.speculated) <= 4  # at most one try (unmeasured round + 3)

    # 16 tokens a round: a speculative round may cost up to 16 one-token rounds before it loses
    oracle = OracleDrafter(make_drafter(target, block_size=16), PROMPT, expected)
    res = SpeculativeDecoder(target, oracle, method="dartree", fallback=True, budget=15, width=4,
                             candidates=8).generate(PROMPT, max_new_tokens=80)
    assert res.tokens == expected
    assert res.speculated.count(False) <= 2  # the first two: the first try comes after 32 rounds
    assert max(res.acceptance_lengths) == 16


def test_ar_ignores_fallback_and_bad_arguments_are_named(target):
    ar = SpeculativeDecoder(target, None, method="ar", fallback=True).generate(PROMPT, max_new_tokens=8)
    assert ar.speculated == [False] * len(ar.acceptance_lengths)
    with pytest.raises(ValueError, match="fallback must be True, False or a"):
        SpeculativeDecoder(target, make_drafter(target), fallback="yes")
    dec = SpeculativeDecoder(target, make_drafter(target), fallback=True)
    with pytest.raises(ValueError, match="seed="):
        dec.generate(PROMPT, max_new_tokens=4, temperature=1.0, generator=torch.Generator())
    # a generator at temperature 0 draws nothing: allowed
    assert len(dec.generate(PROMPT, max_new_tokens=4, generator=torch.Generator()).tokens) == 4
