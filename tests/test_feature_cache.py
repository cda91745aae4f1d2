"""The feature cache's soft labels and folder storage, and the KL term they feed: soft labels
are the target's own top-K next-token log-probs, a folder cache equals the in-memory one and
resumes an interrupted build, the KL term is KL(p || q) at the right positions, training with it
learns, and bad settings are refused by name."""

import json

import pytest
import torch
import torch.nn.functional as F

from dartree.train import (CachedBatches, FeatureCache, TrainOptions, evaluate_cached,
                           loss_terms, new_drafter, soft_labels, train_drafter)
from dartree.train import features as features_module
from dartree.train.objective import _soft_at_slots, _weighted_kl
from helpers import tiny_target

VOCAB = 256


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=VOCAB, layers=4)


def _sequences(lengths=(30, 41, 25, 48, 17, 33), seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (n,), generator=gen).tolist(), n // 3) for n in lengths]


def _options(**kw):
    base = dict(num_layers=1, block_size=8, target_layer_ids=[1, 3], emb_dim=16,
                gru_hidden_dim=32, steps=4, batch_size=2, seq_len=48, anchors=4, lr=3e-3,
                warmup=0.0, seed=0)
    base.update(kw)
    return TrainOptions(**base)


def _same_cache(a: FeatureCache, b: FeatureCache) -> None:
    for name in ("tokens", "features", "offsets", "starts", "soft_ids", "soft_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name
    assert a.layer_ids == b.layer_ids


def test_soft_labels_are_the_targets_top_k(target):
    """Row by row, the cache's soft labels are the top-K of log_softmax of the target's own
    logits at that position (ids exactly, log-probs to float16)."""
    seqs = _sequences()
    cache = FeatureCache.build(target, seqs, [1, 3], progress=False, batch_size=4, topk=5)
    assert cache.topk == 5 and cache.soft_ids.dtype == torch.int32
    for i, (ids, _) in enumerate(seqs):
        with torch.no_grad():
            logits = target(torch.tensor([ids])).logits[0].float()
        expect = logits.log_softmax(-1).topk(5, dim=-1)
        got_ids, got_lp = cache.soft(i)
        assert torch.equal(got_ids.long(), expect.indices)
        torch.testing.assert_close(got_lp.float(), expect.values, atol=2e-3, rtol=1e-3)
    direct_ids, direct_lp = soft_labels(target, torch.randn(3, target.config.hidden_size), 2)
    assert direct_ids.shape == (3, 2) and direct_lp.dtype == torch.float16


def test_folder_cache_equals_memory_cache(target, tmp_path):
    seqs = _sequences()
    memory = FeatureCache.build(target, seqs, [1, 3], progress=False, batch_size=4, topk=3)
    folder = FeatureCache.build(target, seqs, [1, 3], progress=False, batch_size=4, topk=3,
                                folder=tmp_path / "cache")
    _same_cache(memory, folder)
    _same_cache(memory, FeatureCache.load(tmp_path / "cache"))
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        "features.npy", "index.pt", "progress.json", "soft_ids.npy", "soft_logprobs.npy"]
    # without soft labels: no soft arrays, soft() refused by name
    plain = FeatureCache.build(target, seqs, [1, 3], progress=False, folder=tmp_path / "plain")
    assert plain.soft_ids is None and plain.topk == 0
    with pytest.raises(ValueError, match="no soft labels"):
        plain.soft(0)


def test_interrupted_folder_build_resumes(target, tmp_path, monkeypatch):
    """A build stopped after some batches restarts after its last saved batch (the target runs
    only on the rest) and ends with the arrays of an uninterrupted build; a folder holding other
    sequences starts afresh."""
    seqs = _sequences(lengths=(30, 41, 25, 48, 17, 33, 22, 39))
    fresh = FeatureCache.build(target, seqs, [1, 3], progress=False, batch_size=2, topk=4)
    monkeypatch.setattr(features_module._Store, "SAVE_SECONDS", 0.0)  # save after every batch
    real, calls = features_module._backbone, []

    def stop_after_two(*args):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args)

    folder = tmp_path / "cache"
    monkeypatch.setattr(features_module, "_backbone", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        FeatureCache.build(target, seqs, [1, 3], progress=False, batch_size=2, topk=4,
                           folder=folder)
    assert json.loads((folder / "progress.json").read_text()) == {"batches": 2,
                                                                  "complete": False}
    with pytest.raises(ValueError, match="incomplete.*2 batches"):
        FeatureCache.load(folder)

    def counting(*args):
        calls.append(1)
        return real(*args)

    calls.clear()
    monkeypatch.setattr(features_module, "_backbone", counting)
    resumed = FeatureCache.build(target, seqs, [1, 3], progress=False, batch_size=2, topk=4,
                                 folder=folder)
    assert len(calls) == 2  # 4 batches, 2 done before
    _same_cache(fresh, resumed)
    calls.clear()
    other = _sequences(lengths=(20, 21), seed=9)
    FeatureCache.build(target, other, [1, 3], progress=False, batch_size=2, topk=4, folder=folder)
    assert len(calls) == 1  # other sequences: nothing reused
    _same_cache(FeatureCache.build(target, other, [1, 3], progress=False, batch_size=2, topk=4),
                FeatureCache.load(folder))


def test_kl_term_is_kl_to_the_renormalised_top_k_at_each_slot(target):
    """_soft_at_slots gives slot m of the block at a the distribution at position a + m (the one
    that predicts its label a + 1 + m), and _weighted_kl is sum_slots w KL(p || q) with p the
    top-K renormalised, checked against F.kl_div slot by slot."""
    gen = torch.Generator().manual_seed(0)
    N, L, K, A, k, V = 2, 20, 3, 2, 4, 11
    ids = torch.rand(N, L, V, generator=gen).argsort(-1)[..., :K]  # distinct, as a top-K
    lp = torch.randn(N, L, K, generator=gen)
    anchors = torch.tensor([[1, 9], [4, 15]])
    s_ids, s_lp = _soft_at_slots((ids, lp), anchors, k)
    for n in range(N):
        for a in range(A):
            for m in range(k):
                pos = min(int(anchors[n, a]) + m, L - 1)
                assert torch.equal(s_ids[n, a, m], ids[n, pos])
                assert torch.equal(s_lp[n, a, m], lp[n, pos])
    logprobs = torch.randn(N, A, k, V, generator=gen).log_softmax(-1)
    w = torch.rand(N, A, k, generator=gen)
    w = w / w.sum()
    got = _weighted_kl(logprobs, (s_ids, s_lp), w)
    expect = 0.0
    for n in range(N):
        for a in range(A):
            for m in range(k):
                p = torch.zeros(V).index_add_(0, s_ids[n, a, m], s_lp[n, a, m].softmax(-1))
                expect += w[n, a, m] * F.kl_div(logprobs[n, a, m], p, reduction="sum")
    torch.testing.assert_close(got, expect)


def test_training_with_soft_labels(target, tmp_path):
    """soft_weight > 0 trains on (1 - w) CE + w KL: the loss falls, KL terms are reported, the
    held-out report has acceptance per slot (summing to the accept length); without soft labels
    it is refused by name."""
    seqs = _sequences(lengths=(40, 44, 48, 36, 47, 42))
    cache = FeatureCache.build(target, seqs, [1, 3], progress=False, topk=4,
                               folder=tmp_path / "cache")
    opts = _options(steps=30, lr=1e-2, soft_weight=0.5)
    drafter, info = train_drafter(target, cache, opts, progress=False)
    assert sum(info["losses"][-5:]) < sum(info["losses"][:5])
    assert {"kl_base", "kl_corrected"} <= set(info["smoothed"])
    held = evaluate_cached(drafter, target, cache, opts)
    by_slot = held["accept_by_slot"]
    assert len(by_slot) == drafter.num_slots
    assert all(a >= b for a, b in zip(by_slot, by_slot[1:]))
    assert abs(sum(by_slot) - held["accept_corrected"]) < 1e-3
    assert held["kl_corrected"] >= 0
    # a batch's KL equals the loss_terms value computed from the same rows
    batch = CachedBatches(cache, opts, torch.Generator(), torch.device("cpu")).rows(
        [0, 1], torch.Generator().manual_seed(0))
    terms = loss_terms(drafter, target, batch.tokens, batch.anchors, 4.0, batch.features,
                       batch.lengths, batch.soft)
    assert terms["kl_base"] > 0 and torch.isfinite(terms["kl_base"])

    plain = FeatureCache.build(target, seqs, [1, 3], progress=False)
    with pytest.raises(ValueError, match="soft_weight > 0 needs soft labels"):
        train_drafter(target, plain, opts, progress=False)
    with pytest.raises(ValueError, match="soft labels asked for"):
        CachedBatches(plain, opts, torch.Generator(), torch.device("cpu"), soft=True)
    with pytest.raises(ValueError, match="soft_weight must be in"):
        train_drafter(target, cache, _options(soft_weight=1.5), progress=False)
    with pytest.raises(ValueError, match="topk must be >= 0"):
        FeatureCache.build(target, seqs, [1, 3], progress=False, topk=-1)
    assert new_drafter(target, opts) is not None
