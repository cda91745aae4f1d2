"""Sharded feature caches: shards read as one cache equal the cache of all their sequences,
build_shards grows a data set without touching the shards it has (every sequence featurised
once, in a seeded order), resumes an interrupted shard, trains, and refuses bad shards by name."""

import pytest
import torch

from dartree.train import (CachedBatches, FeatureCache, FeatureShards, TrainOptions,
                           build_shards, train_drafter)
from dartree.train import features as features_module
from helpers import tiny_target

VOCAB = 256
LAYERS = [1, 3]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=VOCAB, layers=4)


def _sequences(n=9, seed=5):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(12, 50, (n,), generator=gen).tolist()
    return [(torch.randint(0, VOCAB, (m,), generator=gen).tolist(), m // 3) for m in lengths]


def _key(ids, start):
    return (int(start), *[int(t) for t in ids])


def _shard_keys(shards: FeatureShards) -> list[tuple]:
    return [_key(shards.sequence(i)[0].tolist(), shards.sequence(i)[2])
            for i in range(len(shards))]


def test_shards_read_as_one_cache(target):
    """Two shards read as one: the same tokens, offsets, starts, features and soft labels, and
    the same training batch, as one cache built from all their sequences."""
    seqs = _sequences()
    # one sequence a forward: the same GEMM shapes, hence the same bits, in both builds
    whole = FeatureCache.build(target, seqs, LAYERS, progress=False, batch_size=1, topk=4)
    shards = FeatureShards([
        FeatureCache.build(target, seqs[:4], LAYERS, progress=False, batch_size=1, topk=4),
        FeatureCache.build(target, seqs[4:], LAYERS, progress=False, batch_size=1, topk=4)])
    assert len(shards) == len(whole) == 9 and shards.width == whole.width
    assert shards.topk == 4 and shards.layer_ids == LAYERS
    for name in ("tokens", "offsets", "starts"):
        assert torch.equal(getattr(shards, name), getattr(whole, name)), name
    for i in range(len(seqs)):
        for got, want in zip(shards.sequence(i), whole.sequence(i)):
            assert torch.equal(torch.as_tensor(got), torch.as_tensor(want))
        for got, want in zip(shards.soft(i), whole.soft(i)):
            assert torch.equal(got, want)
    options = TrainOptions(num_layers=1, block_size=8, target_layer_ids=LAYERS, emb_dim=16,
                           gru_hidden_dim=32, steps=2, batch_size=3, seq_len=48, anchors=4)
    picks = [8, 0, 5]
    a = CachedBatches(shards, options, torch.Generator(), torch.device("cpu"))
    b = CachedBatches(whole, options, torch.Generator(), torch.device("cpu"))
    assert torch.equal(a.weights, b.weights)
    rows_a = a.rows(picks, torch.Generator().manual_seed(1))
    rows_b = b.rows(picks, torch.Generator().manual_seed(1))
    for x, y in zip(rows_a[:4], rows_b[:4]):
        assert torch.equal(x, y)
    with pytest.raises(IndexError, match="sequence 9 out of range"):
        shards.sequence(9)


def test_build_shards_grows_without_rebuilding(target, tmp_path, monkeypatch):
    """Five of nine sequences in shards of two (000: 2, 001: 2, 002: 1), then all nine: the
    first shards stay as they were and the target runs only on the four new sequences; every
    sequence is in exactly one shard, with the features a direct build gives it."""
    seqs = _sequences()
    folder = tmp_path / "train"
    first = build_shards(target, seqs, LAYERS, folder, 2, total=5, seed=7, progress=False)
    assert [len(s) for s in first.shards] == [2, 2, 1]
    assert sorted(p.name for p in folder.iterdir()) == ["000", "001", "002"]
    before = _shard_keys(first)
    real, rows = features_module._backbone, []

    def counting(target_, ids, layer_ids):
        rows.append(ids.shape[0])
        return real(target_, ids, layer_ids)

    monkeypatch.setattr(features_module, "_backbone", counting)
    grown = build_shards(target, seqs, LAYERS, folder, 2, total=None, seed=7, progress=False)
    assert [len(s) for s in grown.shards] == [2, 2, 1, 2, 2] and sum(rows) == 4
    keys = _shard_keys(grown)
    assert keys[:5] == before
    assert sorted(keys) == sorted(_key(ids, s) for ids, s in seqs)
    monkeypatch.setattr(features_module, "_backbone", real)
    whole = FeatureCache.build(target, seqs, LAYERS, progress=False)
    where = {_key(ids, s): i for i, (ids, s) in enumerate(seqs)}
    for i, key in enumerate(keys):
        torch.testing.assert_close(grown.sequence(i)[1].float(),
                                   whole.sequence(where[key])[1].float(), atol=0.02, rtol=0.02)
    # the order is the seed's: a fresh folder gets the same first shards
    again = build_shards(target, seqs, LAYERS, tmp_path / "again", 2, total=5, seed=7,
                         progress=False)
    assert _shard_keys(again) == before
    other = build_shards(target, seqs, LAYERS, tmp_path / "other", 2, total=5, seed=8,
                         progress=False)
    assert _shard_keys(other) != before


def test_interrupted_shard_resumes(target, tmp_path, monkeypatch):
    """A build stopped inside its second shard resumes there and ends with the shards of an
    uninterrupted build."""
    seqs = _sequences()
    fresh = build_shards(target, seqs, LAYERS, tmp_path / "fresh", 4, seed=1, batch_size=2,
                         progress=False)
    monkeypatch.setattr(features_module._Store, "SAVE_SECONDS", 0.0)
    real, calls = features_module._backbone, []

    def stop(*args):
        if len(calls) == 3:  # shard 000: batches 1, 2; shard 001: batch 1 saved, then stopped
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(features_module, "_backbone", stop)
    folder = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        build_shards(target, seqs, LAYERS, folder, 4, seed=1, batch_size=2, progress=False)
    assert sorted(p.name for p in folder.iterdir()) == ["000", "001"]
    monkeypatch.setattr(features_module, "_backbone", real)
    assert (folder / "001" / "progress.json").read_text() == '{"batches": 1, "complete": false}'
    resumed = build_shards(target, seqs, LAYERS, folder, 4, seed=1, batch_size=2, progress=False)
    assert [len(s) for s in resumed.shards] == [4, 4, 1]
    assert _shard_keys(resumed) == _shard_keys(fresh)
    for i in range(len(seqs)):
        assert torch.equal(resumed.sequence(i)[1], fresh.sequence(i)[1])


def test_trains_on_shards(target, tmp_path):
    seqs = _sequences()
    shards = build_shards(target, seqs, LAYERS, tmp_path, 5, seed=0, topk=3, progress=False)
    options = TrainOptions(num_layers=1, block_size=8, target_layer_ids=LAYERS, emb_dim=16,
                           gru_hidden_dim=32, steps=3, batch_size=2, seq_len=48, anchors=4,
                           lr=3e-3, warmup=0.0, soft_weight=0.5, seed=0)
    drafter, info = train_drafter(target, shards, options, progress=False)
    assert info["step"] == 3 and all(torch.isfinite(torch.tensor(info["losses"])))


def test_bad_shards_are_refused(target, tmp_path):
    seqs = _sequences()
    with pytest.raises(ValueError, match="shard_sequences must be >= 1"):
        build_shards(target, seqs, LAYERS, tmp_path / "a", 0, progress=False)
    with pytest.raises(ValueError, match="no sequences"):
        build_shards(target, [], LAYERS, tmp_path / "a", 2, progress=False)
    with pytest.raises(ValueError, match="no feature shards under"):
        FeatureShards.load(tmp_path / "nothing")
    with pytest.raises(ValueError, match="at least one shard"):
        FeatureShards([])
    # a shard of other data: named, not silently mixed in
    build_shards(target, seqs[:4], LAYERS, tmp_path / "b", 2, progress=False)
    with pytest.raises(ValueError, match="000 holds 2 sequences that are not in this data set"):
        build_shards(target, seqs[4:], LAYERS, tmp_path / "b", 2, progress=False)
    one = FeatureCache.build(target, seqs[:2], [1], progress=False)
    two = FeatureCache.build(target, seqs[2:4], LAYERS, progress=False)
    with pytest.raises(ValueError, match="shard 1 .*differs from shard 0"):
        FeatureShards([one, two])
