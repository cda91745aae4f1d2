"""bench/drafter_acceptance.py: per-depth top-t hits of a drafter's blocks and their summary."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from drafter_acceptance import (EXPANDS, TOPS, _outside_base, depth_hits, summarise,  # noqa: E402
                                summarise_outside)
from helpers import make_drafter, tiny_target  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_summary_by_hand():
    # 3 blocks, 2 depths; columns: top1, top4, top16, has a label
    hits = torch.tensor([[[1, 1, 1, 1], [1, 1, 1, 1]],
                         [[0, 1, 1, 1], [1, 1, 1, 1]],
                         [[1, 1, 1, 1], [0, 0, 0, 0]]], dtype=torch.bool)   # block 3: depth 2 past the end
    r = summarise(hits)
    assert r["top1"] == [round(2 / 3, 4), 1.0] and r["top4"] == [1.0, 1.0]
    assert r["chain"] == [round(2 / 3, 4), 0.5]  # block 2 stops at depth 1: its depth 2 does not count
    assert r["tau_chain"] == round(1 + (2 + 0 + 1) / 3, 3) and r["blocks"] == 3


@pytest.mark.parametrize("domino", [True, False])
def test_hits_of_a_random_drafter(domino):
    torch.manual_seed(0)
    target = tiny_target(kind="llama", layers=2)
    drafter = make_drafter(target, domino=domino)
    ids = torch.randint(0, target.config.vocab_size, (30,)).tolist()
    hits = depth_hits(drafter, target, ids, start=20, chunk=4)
    assert set(hits) == ({"base", "corrected", "outside_base"} if domino else {"base"})
    k = drafter.num_slots
    if domino:
        outside = hits.pop("outside_base")
        assert outside.shape == (9, k, len(EXPANDS) + 1)
        assert torch.equal(outside[..., -1], hits["corrected"][..., -1])
        assert (outside[..., 0] >= outside[..., 1]).all() and (outside[..., 1] >= outside[..., 2]).all()
        assert not (outside[..., :-1] & ~hits["corrected"][..., :1]).any()  # only corrected top-1 hits
    for h in hits.values():
        assert h.shape == (9, k, len(TOPS) + 1)  # a block at positions 20 .. 28
        valid = h[..., -1]
        # block at a has labels a + 1 .. a + k inside the 30 tokens only
        assert valid.sum(-1).tolist() == [min(k, 29 - a) for a in range(20, 29)]
        assert not (h[..., :-1] & ~valid[..., None]).any()
        assert (h[..., 0] <= h[..., 1]).all() and (h[..., 1] <= h[..., 2]).all()  # top-1 in top-4 in top-16


def test_outside_base_by_hand():
    """The label is the corrected top-1; its base rank decides which E miss it."""
    V = 70
    base = torch.arange(V, 0, -1).float()[None, None].repeat(1, 3, 1)   # base rank of token t = t
    corrected = torch.zeros(1, 3, V)
    labels = torch.tensor([[2, 10, 65]])
    corrected[0, 0, 2] = corrected[0, 1, 10] = corrected[0, 2, 0] = 1.0  # depth 3: label not top-1
    got = _outside_base(base, corrected, labels)
    assert got[0].tolist() == [[False, False, False], [True, False, False], [False, False, False]]
    hits = torch.cat([got, torch.ones(1, 3, 1, dtype=torch.bool)], -1)
    assert summarise_outside(hits)["outside_base_top4"] == [0.0, 1.0, 0.0]
    corrected[0, 2, 65] = 2.0                                           # base rank 65 >= every E
    assert _outside_base(base, corrected, labels)[0, 2].tolist() == [True, True, True]


def test_hits_over_a_draft_vocabulary():
    """With a draft vocabulary, ranks are taken over its tokens only (as the drafter drafts): the
    labelled depths are the same, a label outside it is a miss at every t, and one inside it is a
    top-1 hit exactly when it is the argmax of the whole-vocabulary logits masked to the vocabulary."""
    torch.manual_seed(1)
    target = tiny_target(kind="llama", layers=2)
    drafter = make_drafter(target, domino=True)
    V = target.config.vocab_size
    ids = torch.randint(0, V, (30,)).tolist()
    full = depth_hits(drafter, target, ids, start=20, chunk=4)
    labels = torch.tensor(ids)
    vocab = torch.tensor(sorted(set(ids[21::2]) | set(range(0, V, 3))))
    drafter.set_draft_vocab(vocab)
    sub = depth_hits(drafter, target, ids, start=20, chunk=4)
    inside = torch.zeros(V, dtype=torch.bool)
    inside[vocab] = True
    k = drafter.num_slots
    for kind in ("base", "corrected"):
        assert torch.equal(sub[kind][..., -1], full[kind][..., -1])
        for i, a in enumerate(range(20, 29)):
            for m in range(min(k, 29 - a)):
                label = int(labels[a + 1 + m])
                if not inside[label]:
                    assert not sub[kind][i, m, :-1].any()
    # top-1 against the masked argmax, from the drafter's own logits
    from dartree.train.features import target_features
    from dartree.train.objective import block_logits

    drafter.set_draft_vocab(None)
    tokens = labels[None]
    features = target_features(target, tokens, drafter.config.target_layer_ids)
    anchors = torch.arange(20, 29)[None]
    with torch.no_grad():
        h = drafter(features, tokens.gather(1, anchors), anchors)
        _, corrected = block_logits(drafter, h, tokens, anchors)
    top = corrected[0].masked_fill(~inside, float("-inf")).argmax(-1)      # [A, k]
    for i, a in enumerate(range(20, 29)):
        for m in range(min(k, 29 - a)):
            label = int(labels[a + 1 + m])
            assert bool(sub["corrected"][i, m, 0]) == (inside[label] and int(top[i, m]) == label)
