"""The draft vocabulary (dartree.drafter.vocab): drafting scores a subset of the tokens. Its
logits are the LM head's on those rows (packed: the same bits), -inf elsewhere; it round-trips
through the drafter folder; and it never changes what any method returns (greedy and keyed
sampling), only what can be proposed."""

import json

import pytest
import torch
from torch import nn

import dartree
from dartree import SpeculativeDecoder, gguf_blocks
from dartree.decoding import METHODS
from dartree.drafter import load_drafter, save_drafter
from dartree.drafter.vocab import (VOCAB_FILE, check_ids, frequent_tokens, read_draft_vocab,
                                   restrict_lm_head, save_draft_vocab)
from dartree.gguf import PackedLinear

from helpers import greedy_reference, make_drafter, tiny_target
from dartree.testing import random_packed

PROMPT = [200, 1, 1, 42, 7, 7, 7, 64, 128, 31, 2]


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", torch.float32)


def test_frequent_tokens_ranks_by_count_then_id_and_keeps_always():
    ids, covered = frequent_tokens([[5, 5, 5, 9, 9, 3], [9, 7, 3, 11]], size=3, vocab_size=16, always=[2])
    # counts: 5 x3, 9 x3, 3 x2, 7, 11; EOS 2 always: 2, then 5 and 9 (tie: the lower id first)
    assert ids == [2, 5, 9]
    assert covered == pytest.approx(6 / 10)
    assert frequent_tokens([[1, 2]], size=5, vocab_size=4)[0] == [1, 2]
    with pytest.raises(ValueError, match="size must be >= 1"):
        frequent_tokens([[1]], size=0, vocab_size=4)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 4\)"):
        frequent_tokens([[1, 4]], size=2, vocab_size=4)


def test_ids_are_checked_and_sorted():
    assert check_ids([7, 2, 5], 8).tolist() == [2, 5, 7]
    for bad, message in [([], "non-empty 1-D"), ([[1, 2]], "non-empty 1-D"), ([1.0, 2.0], "non-empty 1-D"),
                         ([1, 8], r"in \[0, 8\)"), ([-1, 2], r"in \[0, 8\)"), ([3, 1, 3], "distinct")]:
        with pytest.raises(ValueError, match=message):
            check_ids(bad, 8)


def test_file_round_trip_and_refusals(tmp_path):
    assert read_draft_vocab(tmp_path, 16) is None
    save_draft_vocab(tmp_path, [9, 1, 4], 16, source="test")
    data = json.loads((tmp_path / VOCAB_FILE).read_text())
    assert data["ids"] == [1, 4, 9] and data["size"] == 3 and data["source"] == "test"
    assert read_draft_vocab(tmp_path, 16).tolist() == [1, 4, 9]
    with pytest.raises(ValueError, match="made for a vocabulary of 16 tokens, the target has 32"):
        read_draft_vocab(tmp_path, 32)
    (tmp_path / VOCAB_FILE).write_text('{"size": 3}')
    with pytest.raises(ValueError, match="not a draft vocabulary file"):
        read_draft_vocab(tmp_path, 16)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K"])
def test_a_packed_head_keeps_its_bits_on_the_rows_kept(native, qtype):
    K = gguf_blocks.block_type(qtype).block_size * 2
    head = PackedLinear(random_packed(qtype, 300, K, seed=1), qtype, K)
    ids = torch.tensor([0, 3, 17, 150, 299])
    x = torch.randn(6, K)
    sub = restrict_lm_head(head, ids)(x)
    assert torch.equal(sub, head(x)[:, ids])


def test_a_dense_head_keeps_its_rows_and_other_heads_are_refused():
    torch.manual_seed(0)
    head = nn.Linear(32, 50, bias=True)
    ids = torch.tensor([2, 7, 49])
    x = torch.randn(4, 32)
    torch.testing.assert_close(restrict_lm_head(head, ids)(x), head(x)[:, ids])
    with pytest.raises(ValueError, match="got Sequential"):
        restrict_lm_head(nn.Sequential(head), ids)


def test_draft_logits_are_the_base_logits_on_the_vocabulary_and_minus_inf_elsewhere(target):
    drafter = make_drafter(target)
    h = torch.randn(5, target.config.hidden_size)
    assert drafter.draft_vocab is None
    assert torch.equal(drafter.draft_logits(h), drafter.base_logits(h))
    ids = torch.tensor([3, 10, 11, 97, 255])
    drafter.set_draft_vocab(ids.flip(0))
    assert drafter.draft_vocab.tolist() == ids.tolist()
    out, base = drafter.draft_logits(h), drafter.base_logits(h)
    assert out.shape == base.shape
    torch.testing.assert_close(out[:, ids], base[:, ids])
    rest = torch.ones(base.shape[1], dtype=torch.bool)
    rest[ids] = False
    assert torch.isneginf(out[:, rest]).all()
    with pytest.raises(ValueError, match=r"in \[0, 256\)"):
        drafter.set_draft_vocab([1, 256])
    drafter.set_draft_vocab(None)
    assert torch.equal(drafter.draft_logits(h), base)


def test_the_drafter_folder_carries_the_vocabulary(target, tmp_path):
    drafter = make_drafter(target)
    drafter.set_draft_vocab([4, 8, 15, 16, 23, 42])
    save_drafter(drafter, tmp_path)
    assert load_drafter(tmp_path, target).draft_vocab.tolist() == [4, 8, 15, 16, 23, 42]
    drafter.set_draft_vocab(None)
    save_drafter(drafter, tmp_path)  # a save without one leaves no stale file behind
    assert not (tmp_path / VOCAB_FILE).exists()
    assert load_drafter(tmp_path, target).draft_vocab is None


def _vocab_with(drafter, expected, extra, drop):
    """A draft vocabulary holding `extra` random ids and the target's tokens but every `drop`-th
    (those may still be among the random ids), so branches are sometimes accepted and sometimes
    cut by a missing token."""
    g = torch.Generator().manual_seed(3)
    keep = set(torch.randperm(drafter.logit_size, generator=g)[:extra].tolist())
    keep |= {t for i, t in enumerate(expected) if i % drop}
    return sorted(keep)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_is_unchanged(target, method):
    expected = greedy_reference(target, PROMPT, 24)
    drafter = make_drafter(target, block_size=6)
    drafter.set_draft_vocab(_vocab_with(drafter, expected, extra=40, drop=2))
    res = SpeculativeDecoder(target, drafter, method=method, budget=12, width=4, candidates=8).generate(
        PROMPT, max_new_tokens=24)
    assert res.tokens == expected


@pytest.mark.parametrize("method", ["domino", "ddtree", "dartree"])
def test_keyed_samples_are_unchanged(target, method):
    ar = SpeculativeDecoder(target, None, method="ar").generate(PROMPT, max_new_tokens=20, temperature=0.8,
                                                                seed=5)
    drafter = make_drafter(target, block_size=6)
    drafter.set_draft_vocab(_vocab_with(drafter, ar.tokens, extra=40, drop=3))
    res = SpeculativeDecoder(target, drafter, method=method, budget=12, width=4, candidates=8).generate(
        PROMPT, max_new_tokens=20, temperature=0.8, seed=5)
    assert res.tokens == ar.tokens


def test_the_default_drafter_ships_a_vocabulary():
    folder = dartree.defaults.SMOLLM2_DRAFTER_DIR
    data = json.loads((folder / VOCAB_FILE).read_text())
    ids = read_draft_vocab(folder, 49152)
    assert ids.numel() == data["size"] >= 4096 and 2 in ids.tolist()  # <|im_end|> can be drafted
    assert data["coverage"] > 0.95


def test_generate_keeps_the_drafter_vocabulary_unless_full(capsys, monkeypatch):
    """`--draft-vocab auto` drafts over the folder's vocabulary, `full` over every token; the
    answer is the same (the tiny set, given a vocabulary here: its folder has none)."""
    from dartree import cli, defaults

    loaded, texts = [], []
    real = defaults.default_models

    def with_vocab(*args, **kwargs):
        target, drafter, tokenizer = real(*args, **kwargs)
        drafter.set_draft_vocab(range(0, drafter.logit_size, 2))
        loaded.append(drafter)
        return target, drafter, tokenizer

    monkeypatch.setattr(defaults, "default_models", with_vocab)
    for choice in ("auto", "full"):
        code = cli.main(["generate", "--model", "tiny", "--device", "cpu", "--prompt", "def add(a, b):",
                         "--max-new-tokens", "16", "--method", "dartree", "--budget", "4",
                         "--draft-vocab", choice])
        assert code == 0
        texts.append(capsys.readouterr().out)
    assert loaded[0].draft_vocab.numel() == loaded[0].logit_size // 2 and loaded[1].draft_vocab is None
    assert texts[0] == texts[1]
