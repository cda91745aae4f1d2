"""Training over a draft vocabulary (dartree.train.objective): the logits, labels, CE, KL and
accept lengths of a drafter with a vocabulary are those of the whole-vocabulary objective with every
other token at -inf, a slot whose label or soft tokens lie outside it adds no loss and no NaN, and
train_drafter(draft_vocab=...) trains over it and saves it with the drafter."""

import pytest
import torch
import torch.nn.functional as F

from dartree.drafter import load_drafter
from dartree.train import (IGNORE, CachedBatches, FeatureCache, TrainOptions, block_labels,
                           block_logits, loss_terms, new_drafter, train_drafter)
from dartree.train.objective import _soft_at_slots, in_vocab, vocab_labels
from helpers import tiny_target

VOCAB = 256
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=VOCAB, layers=4)


def _options(**kw):
    base = dict(num_layers=1, block_size=8, target_layer_ids=[1, 3], emb_dim=16,
                gru_hidden_dim=32, steps=4, batch_size=2, seq_len=48, anchors=4, lr=3e-3,
                warmup=0.0, seed=0, soft_weight=0.5)
    base.update(kw)
    return TrainOptions(**base)


@pytest.fixture(scope="module")
def cache(target):
    gen = torch.Generator().manual_seed(5)
    seqs = [(torch.randint(0, VOCAB, (n,), generator=gen).tolist(), n // 3)
            for n in (40, 44, 48, 36, 47, 42)]
    return FeatureCache.build(target, seqs, [1, 3], progress=False, topk=4)


def _vocab(seed: int, size: int) -> torch.Tensor:
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:size].sort().values


def _trained_like(target, seed=1):
    """A drafter whose head correction is not zero (a new drafter's W_2 is 0)."""
    torch.manual_seed(seed)
    drafter = new_drafter(target, _options())
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return drafter.eval()


def test_places_in_the_vocabulary():
    """in_vocab / vocab_labels: a token's index in the ascending ids, IGNORE where it is not
    there (and for IGNORE itself); without a vocabulary the labels pass unchanged."""
    vocab = torch.tensor([3, 7, 8, 20, 255])
    labels = torch.tensor([[7, 255, 4, IGNORE], [3, 0, 20, 256 - 1]])
    places, found = in_vocab(labels, vocab)
    assert found.tolist() == [[True, True, False, False], [True, False, True, True]]
    assert vocab_labels(labels, vocab).tolist() == [[1, 4, IGNORE, IGNORE], [0, IGNORE, 3, 4]]
    assert places[~found].eq(0).all()
    assert torch.equal(vocab_labels(labels, None), labels)
    for seed in range(3):  # random ids against a plain lookup
        v = _vocab(seed, 40)
        ids = torch.randint(-1, VOCAB, (64,), generator=torch.Generator().manual_seed(seed))
        ids[ids < 0] = IGNORE
        lookup = {int(t): i for i, t in enumerate(v)}
        assert vocab_labels(ids, v).tolist() == [lookup.get(int(t), IGNORE) for t in ids]


@pytest.mark.parametrize("size", [1, 37, 200])
def test_block_logits_are_the_vocabularys_columns(target, cache, size):
    """Over a vocabulary, base and corrected logits are the whole-vocabulary ones at its ids."""
    drafter = _trained_like(target)
    batch = CachedBatches(cache, _options(), torch.Generator(), torch.device("cpu")).rows(
        [0, 1, 2], torch.Generator().manual_seed(0))
    h = drafter(batch.features, batch.tokens.gather(1, batch.anchors), batch.anchors)
    base, corrected = block_logits(drafter, h, batch.tokens, batch.anchors)
    vocab = _vocab(size, size)
    drafter.set_draft_vocab(vocab)
    sub_base, sub_corrected = block_logits(drafter, h, batch.tokens, batch.anchors)
    assert sub_base.shape == (*base.shape[:-1], size)
    torch.testing.assert_close(sub_base, base[..., vocab], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sub_corrected, corrected[..., vocab], rtol=1e-5, atol=1e-5)


def _reference_terms(drafter, batch, vocab, gamma):
    """The objective from the whole vocabulary's logits, every token outside vocab at -inf."""
    saved = drafter.draft_vocab
    drafter.set_draft_vocab(None)
    h = drafter(batch.features, batch.tokens.gather(1, batch.anchors), batch.anchors)
    logits = dict(zip(("base", "corrected"), block_logits(drafter, h, batch.tokens, batch.anchors)))
    drafter.set_draft_vocab(saved)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[vocab] = False
    labels = block_labels(batch.tokens, batch.anchors, drafter.num_slots, batch.lengths)
    labels = labels.masked_fill((labels >= 0) & outside[labels.clamp_min(0)], IGNORE)
    k = drafter.num_slots
    w = torch.exp(-torch.arange(k, dtype=torch.float32) / gamma).expand(labels.shape) * (labels >= 0)
    w = w / w.sum()
    ids, lp = _soft_at_slots(batch.soft, batch.anchors, k)
    out = {}
    for name, x in logits.items():
        logq = x.float().masked_fill(outside, float("-inf")).log_softmax(-1)
        ce = -(logq.gather(-1, labels.clamp_min(0)[..., None])[..., 0] * w).sum()
        kl = torch.zeros(())
        for idx in torch.nonzero(w > 0).tolist():
            keep = ~outside[ids[tuple(idx)]]
            if keep.any():
                p = torch.zeros(VOCAB).index_add_(0, ids[tuple(idx)][keep],
                                                  lp[tuple(idx)].float()[keep].softmax(-1))
                kl = kl + w[tuple(idx)] * F.kl_div(logq[tuple(idx)].clamp_min(-1e30), p,
                                                   reduction="sum")
        hits = (x.masked_fill(outside, float("-inf")).argmax(-1) == labels).long()
        out[name] = (ce, kl, hits.cumprod(-1).sum(-1).float().mean())
    return out


def test_loss_terms_over_a_vocabulary_match_the_masked_reference(target, cache):
    """CE, KL and accept lengths over a vocabulary equal the whole-vocabulary objective with every
    other token at -inf: labels outside it ignored, the target's top-K renormalised over its
    tokens inside it."""
    drafter = _trained_like(target)
    batch = CachedBatches(cache, _options(), torch.Generator(), torch.device("cpu"), soft=True).rows(
        [0, 1, 2, 3], torch.Generator().manual_seed(1))
    labels = block_labels(batch.tokens, batch.anchors, drafter.num_slots, batch.lengths)
    # a vocabulary missing some labels: every other one of the batch's label tokens, plus others
    present = labels[labels >= 0].unique()
    vocab = torch.cat([present[::2], _vocab(9, 60)]).unique()
    drafter.set_draft_vocab(vocab)
    assert (~torch.isin(present, vocab)).any()
    terms = loss_terms(drafter, target, batch.tokens, batch.anchors, 4.0, batch.features,
                       batch.lengths, batch.soft)
    expect = _reference_terms(drafter, batch, vocab, 4.0)
    for name, (ce, kl, acc) in expect.items():
        torch.testing.assert_close(terms[f"ce_{name}"], ce, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(terms[f"kl_{name}"], kl, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(terms[f"accept_{name}"], acc)


def test_slots_outside_the_vocabulary_give_no_nan(target, cache):
    """A vocabulary that holds none of a batch's soft tokens and labels: the terms are zero and
    the gradients finite (no NaN from the empty renormalisation)."""
    drafter = _trained_like(target).train()
    batch = CachedBatches(cache, _options(), torch.Generator(), torch.device("cpu"), soft=True).rows(
        [0, 1], torch.Generator().manual_seed(2))
    used = torch.cat([batch.tokens.flatten(), batch.soft[0].flatten().long()]).unique()
    unused = torch.tensor([t for t in range(VOCAB) if t not in set(used.tolist())])
    assert unused.numel() > 0
    drafter.set_draft_vocab(unused)
    terms = loss_terms(drafter, target, batch.tokens, batch.anchors, 4.0, batch.features,
                       batch.lengths, batch.soft)
    assert terms["kl_corrected"].item() == 0 and terms["accept_corrected"].item() == 0
    (terms["ce_corrected"] + terms["kl_corrected"] + terms["kl_base"]).backward()
    grads = [p.grad for p in drafter.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_train_drafter_over_a_vocabulary(target, cache, tmp_path):
    """train_drafter(draft_vocab=ids) learns over those tokens (the loss falls), only their rows
    of the head's W_2 move, and the saved drafter drafts over the same ids; bad ids are refused."""
    vocab = _vocab(4, 120)
    opts = _options(steps=30, lr=1e-2)
    drafter, info = train_drafter(target, cache, opts, progress=False, output=tmp_path / "d",
                                  draft_vocab=vocab)
    assert sum(info["losses"][-5:]) < sum(info["losses"][:5])
    assert torch.equal(drafter.draft_vocab, vocab)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[vocab] = False
    w2 = drafter.head.W_2.detach()
    assert w2[outside].eq(0).all() and w2[vocab].abs().sum() > 0  # W_2 starts at 0
    loaded = load_drafter(tmp_path / "d", target)
    assert torch.equal(loaded.draft_vocab, vocab)
    with pytest.raises(ValueError, match="must be in"):
        train_drafter(target, cache, opts, progress=False, draft_vocab=[0, VOCAB])
