"""dartree.integrations.chains: per-request drafter state for an engine's batch. Simulated engine
steps (rows reordered, prefill in chunks, requests joining, finishing and being preempted,
rejected-draft rows in the pass) must give every request the chain a fresh drafter gives for the
same context."""

import random

import numpy as np
import pytest
import torch

from dartree.integrations.chains import ChainDrafter, RowStep
from dartree.tree import DraftBlock, build_chain
from helpers import make_drafter, tiny_target

K = 3  # draft tokens a step


@pytest.fixture(scope="module")
def pair(one_thread):
    target = tiny_target("llama", dtype=torch.float64)
    return target


def _features(target, drafter, tokens):
    """Features [n, nF*H] of every position of `tokens` (transformers' hidden_states[l + 1])."""
    with torch.no_grad():
        out = target(torch.tensor([tokens]), output_hidden_states=True)
    return torch.cat([out.hidden_states[l + 1][0] for l in drafter.target_layer_ids], -1)


def _reference_chain(drafter, features, tokens, s, count):
    """A fresh drafter's chain after tokens[s] given the features of [0, s)."""
    drafter.reset(s + drafter.block_size)
    hidden = drafter.draft(features[:s], int(tokens[s]), s)[:count]
    head = drafter.head
    block = DraftBlock(root=int(tokens[s]), base_logits=drafter.draft_logits(hidden), head=head,
                       z=None if head is None else head.project(hidden), prefix_len=drafter.prefix_len)
    return build_chain(block, corrected=head is not None).tokens[1:].tolist()


class _Request:
    def __init__(self, tokens, prompt_len):
        self.tokens, self.done, self.prompt_len = tokens, 0, prompt_len  # done: positions computed

    @property
    def committed(self):  # tokens committed: the prompt, then one more than computed
        return max(self.prompt_len, self.done + 1)


@pytest.mark.parametrize("domino", [True, False])
def test_chains_follow_requests_through_an_engine(pair, domino):
    target = pair
    drafter = make_drafter(target, domino=domino, block_size=8)
    reference = make_drafter(target, domino=domino, block_size=8)
    chains = ChainDrafter(drafter, num_tokens=K, max_model_len=64, keep_steps=2)
    rng = random.Random(0)
    width = chains._width
    sequences = [[rng.randrange(256) for _ in range(48)] for _ in range(5)]
    sequences.append(list(sequences[0]))  # two requests with the same tokens
    feats = [_features(target, drafter, seq) for seq in sequences]
    live = {i: _Request(sequences[i], prompt_len=rng.randrange(3, 12)) for i in range(4)}
    waiting = [4, 5]
    drafted, skipped = 0, set()
    for step in range(40):
        if waiting and rng.random() < 0.3:
            i = waiting.pop()
            live[i] = _Request(sequences[i], prompt_len=rng.randrange(3, 12))
        if live and rng.random() < 0.1:  # preempted: recomputed from position 0
            i = rng.choice(sorted(live))
            live[i] = _Request(sequences[i], prompt_len=live[i].committed)
        # some requests skip a step (never two in a row: keep_steps=2 would drop their state)
        skipped = {i for i in live if i not in skipped and rng.random() < 0.1}
        order = [i for i in live if i not in skipped]
        rng.shuffle(order)
        rows, expect = [], []
        for i in order:
            req = live[i]
            start = req.done
            if req.prompt_len - start > 5:  # a prefill chunk that samples nothing
                end, sampled = start + 5, False
                n = req.prompt_len
            else:  # the rest of the prompt, or the bonus + K drafts of which `accepted` pass
                end = max(req.prompt_len, start + 1)
                accepted = 0 if start < req.prompt_len else rng.randrange(K + 1)
                n = end + accepted + 1
                sampled = True
            computed = feats[i][start:end + (accepted if sampled else 0)]
            junk = torch.randn(K - (accepted if sampled else 0), width, dtype=torch.float64)
            rows.append(RowStep(np.array(req.tokens[:n]), start,
                                torch.cat([computed, junk]) if sampled else computed, sampled))
            req.done = n - 1 if sampled else end
            expect.append((i, n) if sampled else None)
        drafts = chains.step(rows)
        for got, want in zip(drafts, expect):
            if want is None:
                assert got == []
                continue
            i, n = want
            count = min(K, 64 - n)
            assert got == _reference_chain(reference, feats[i], sequences[i], n - 1, count)
            drafted += 1
        for i in [i for i in live if live[i].done >= 40]:  # finished
            del live[i]
    assert drafted > 30


def test_a_row_without_state_gets_no_drafts(pair):
    drafter = make_drafter(pair, block_size=8)
    chains = ChainDrafter(drafter, num_tokens=K, max_model_len=64)
    tokens = list(range(20))
    feats = _features(pair, drafter, tokens)
    # a pass that starts at position 10 (its prefix served from a prefix cache): nothing to continue
    row = RowStep(np.array(tokens[:12]), 10, feats[10:12], sampled=True)
    assert chains.step([row]) == [[]]
    # the same request from position 0 drafts
    row = RowStep(np.array(tokens[:12]), 0, feats[:11], sampled=True)
    assert len(chains.step([row])[0]) == K


def test_drafts_stop_at_the_length_limit(pair):
    drafter = make_drafter(pair, block_size=8)
    chains = ChainDrafter(drafter, num_tokens=K, max_model_len=12)
    tokens = list(range(11))
    row = RowStep(np.array(tokens), 0, _features(pair, drafter, tokens)[:10], sampled=True)
    assert len(chains.step([row])[0]) == 1  # 11 tokens + 1 draft = max_model_len


def test_states_of_departed_requests_are_dropped(pair):
    drafter = make_drafter(pair, block_size=8)
    chains = ChainDrafter(drafter, num_tokens=K, max_model_len=64, keep_steps=2)
    tokens = list(range(10))
    feats = _features(pair, drafter, tokens)
    chains.step([RowStep(np.array(tokens), 0, feats[:9], sampled=True)])
    assert chains.num_states == 1
    chains.step([])
    assert chains.num_states == 1
    chains.step([])
    assert chains.num_states == 0


def test_bad_input_is_refused(pair):
    drafter = make_drafter(pair, block_size=8)
    with pytest.raises(ValueError, match="num_tokens 9 exceeds the drafter.s 8 slots"):
        ChainDrafter(drafter, num_tokens=9, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len must be an int >= 1"):
        ChainDrafter(drafter, num_tokens=2, max_model_len=0)
    chains = ChainDrafter(drafter, num_tokens=2, max_model_len=64)
    tokens = np.arange(10)
    feats = _features(pair, drafter, tokens.tolist())
    with pytest.raises(ValueError, match="features must be"):
        chains.step([RowStep(tokens, 0, feats[:9, :5], sampled=True)])
    with pytest.raises(ValueError, match=r"needs the features of positions \[0, 9\), got 4 rows"):
        chains.step([RowStep(tokens, 0, feats[:4], sampled=True)])
    with pytest.raises(ValueError, match="prefill chunk"):  # more prompt rows than tokens
        chains.step([RowStep(tokens[:3], 0, feats[:4], sampled=False)])
