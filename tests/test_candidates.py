"""dartree.candidates: one tree from the drafter's and the lookup's candidates, scored on one
scale, the best N kept; the calibrator that learns edge acceptance."""

import math
import random

import pytest
import torch

from dartree.candidates import AcceptanceCalibrator, CandidateTree
from dartree.lookup import Continuation
from dartree.tree import DraftTree


def drafter_tree():
    """root 9 -> 1 (q .6) -> 2 (q .5); root -> 3 (q .3)"""
    logq = [0.0, math.log(0.6), math.log(0.6) + math.log(0.5), math.log(0.3)]
    return DraftTree(torch.tensor([9, 1, 2, 3]), torch.tensor([-1, 0, 1, 0]),
                     torch.tensor([0, 1, 2, 1]), torch.tensor(logq))


def test_paths_merge_where_tokens_agree():
    cands = CandidateTree(9)
    cands.add_continuations([Continuation((1, 2, 5), 3, False), Continuation((1, 4), 2, False)])
    cands.add_draft(drafter_tree())
    paths = {}
    for i, node in enumerate(cands.nodes[1:], 1):
        path, j = [], i
        while j:
            path.append(cands.nodes[j].token)
            j = cands.nodes[j].parent
        paths[tuple(reversed(path))] = node.sources
    # 1 and 1-2 proposed by both; 1-2-5, 1-4 by the lookup; 3 by the drafter
    assert paths == {(1,): 3, (1, 2): 3, (1, 2, 5): 2, (1, 4): 2, (3,): 1}
    node_12 = next(n for n in cands.nodes if n.token == 2)
    assert node_12.lookup == AcceptanceCalibrator.lookup_kind(match=3, depth=2, share=0.5, support=1)


@pytest.mark.parametrize("seed", range(20))
def test_select_keeps_the_best_n_as_a_valid_tree(seed):
    rng = random.Random(seed)
    cands = CandidateTree(rng.randrange(50))
    conts = [Continuation(tuple(rng.randrange(4) for _ in range(rng.randrange(1, 7))),
                          rng.randrange(1, 5), rng.random() < 0.3) for _ in range(rng.randrange(1, 9))]
    cands.add_continuations(conts)
    calibrator = AcceptanceCalibrator()
    curve = cands.expected_tokens(calibrator)
    assert len(curve) == cands.size + 1 and curve[0] == 1.0
    assert all(b >= a for a, b in zip(curve, curve[1:]))
    estimates = [1.0]
    for i in range(1, len(cands.nodes)):
        p = cands.edge_p(i, calibrator)
        assert 0 < p < 1
        estimates.append(estimates[cands.nodes[i].parent] * p)
    for n in range(cands.size + 1):
        tree, rows = cands.select(n, "cpu")
        tree.validate()
        assert tree.num_nodes == n + 1 and rows[0] == 0
        assert tree.tokens.tolist() == [cands.nodes[r].token for r in rows]
        # the kept nodes are N of largest estimate (a tree: every parent kept before its child)
        kept = sorted((estimates[r] for r in rows[1:]), reverse=True)
        best = sorted(estimates[1:], reverse=True)[:n]
        assert kept == pytest.approx(best)
        assert curve[n] == pytest.approx(1 + sum(best))
        torch.testing.assert_close(tree.scores[1:].exp(), torch.tensor([estimates[r] for r in rows[1:]]))


@pytest.mark.parametrize("seed", range(10))
def test_merged_nodes_are_ranked_by_their_edge_products(seed):
    """A tree of both sources: every node's score is the product of edge_p along its path, and
    the rows are the N best (ties: shallower first), parents before children."""
    rng = random.Random(seed)
    cands = CandidateTree(9)
    cands.add_continuations([Continuation(tuple(rng.randrange(1, 5) for _ in range(rng.randrange(1, 6))),
                                          rng.randrange(1, 9), False) for _ in range(rng.randrange(1, 6))])
    cands.add_draft(drafter_tree())
    calibrator = AcceptanceCalibrator()
    for _ in range(rng.randrange(40)):  # some kinds learned, so the estimates differ from the guesses
        node = cands.nodes[rng.randrange(1, len(cands.nodes))]
        for kind in node.kinds:
            calibrator.observe(kind, rng.random() < 0.5)
    curve = cands.expected_tokens(calibrator)
    estimates = [1.0]
    for i in range(1, len(cands.nodes)):
        estimates.append(estimates[cands.nodes[i].parent] * cands.edge_p(i, calibrator))
    ranked = sorted(range(1, len(cands.nodes)), key=lambda i: (-estimates[i], cands.nodes[i].depth, i))
    for n in range(cands.size + 1):
        tree, rows = cands.select(n, "cpu")
        tree.validate()
        assert rows == [0] + sorted(ranked[:n], key=lambda i: (cands.nodes[i].depth, i))
        assert curve[n] == pytest.approx(1 + sum(estimates[i] for i in ranked[:n]))
        assert tree.scores[1:].tolist() == pytest.approx([math.log(estimates[r]) for r in rows[1:]])


def test_select_needs_the_ranking_first():
    cands = CandidateTree(1)
    with pytest.raises(RuntimeError, match="expected_tokens"):
        cands.select(0, "cpu")


def test_calibrator_learns_the_observed_rate():
    cal = AcceptanceCalibrator(prior=2.0, max_count=256.0)
    kind = cal.lookup_kind(match=3, depth=1, share=1.0, support=1)
    guess = cal.p(kind)
    for i in range(400):
        cal.observe(kind, accepted=i % 10 == 0)  # 10% accepted
    assert guess > 0.3 and cal.p(kind) == pytest.approx(0.1, abs=0.03)
    other = cal.drafter_kind(q=0.95, depth=1)
    assert cal.p(other) == pytest.approx(0.8 * 0.95, abs=1e-9)  # untouched: its own guess


def test_lookup_edges_of_longer_copies_are_kinds_of_their_own():
    """The effective match (the suffix matched + the depth) is binned one by one up to 8, then
    9-12, 13-20 and 21 or more: a copy that has held for 16 tokens is not a fresh 8-token one."""
    kind = lambda match, depth: AcceptanceCalibrator.lookup_kind(match, depth, 1.0, 1)  # noqa: E731
    assert kind(5, 4) == kind(8, 1) != kind(9, 1) == kind(4, 9) == kind(12, 1)
    assert kind(12, 1) != kind(13, 1) == kind(16, 5) != kind(16, 6) == kind(40, 3)
    assert len({kind(m, 1) for m in range(1, 40)}) == 11


def test_store_edges_are_kinds_of_their_own():
    """An edge every continuation through which came from the store (earlier requests' outputs)
    is learned apart from the context's, starting lower; one the context proposes too is the
    context's."""
    cands = CandidateTree(9)
    cands.add_continuations([Continuation((1, 2), 3, True), Continuation((1, 4), 3, False),
                             Continuation((5, 6), 3, True)])
    kind = {cands.nodes[i].token: cands.nodes[i].lookup for i in range(1, len(cands.nodes))}
    stored = lambda depth, share: AcceptanceCalibrator.lookup_kind(3, depth, share, 1, stored=True)  # noqa: E731
    assert kind[1] == AcceptanceCalibrator.lookup_kind(3, 1, 2 / 3, 2)  # both: the context's
    assert kind[4] == AcceptanceCalibrator.lookup_kind(3, 2, 0.5, 1)
    assert kind[2] == stored(2, 0.5) and kind[5] == stored(1, 1 / 3) and kind[6] == stored(2, 1.0)
    cal = AcceptanceCalibrator()
    mine, theirs = cal.lookup_kind(3, 2, 1.0, 1), cal.lookup_kind(3, 2, 1.0, 1, stored=True)
    assert mine != theirs and cal.p(theirs) < cal.p(mine)
    for _ in range(50):
        cal.observe(theirs, accepted=True)
    assert cal.p(theirs) > 0.9 and cal.p(mine) == pytest.approx(AcceptanceCalibrator().p(mine))


def test_observe_teaches_edges_below_the_accepted_path_and_counts_sources():
    cands = CandidateTree(9)
    cands.add_continuations([Continuation((1, 2), 4, False)])
    cands.add_draft(drafter_tree())
    cal = AcceptanceCalibrator()
    cands.expected_tokens(cal)
    tree, rows = cands.select(cands.size, "cpu")
    row_of = {cands.nodes[r].token: i for i, r in enumerate(rows)}
    before = dict(cal._cells)
    # the target took 1 then 2 (both sources); 3 (drafter) was tried and missed
    taken = cands.observe(rows, [0, row_of[1], row_of[2]], cal)
    assert taken == {"drafter": 0, "lookup": 0, "both": 2}
    learned = {k: v for k, v in cal._cells.items() if k not in before}
    # edges 1, 2 as drafter and lookup edges (accepted), 3 as a drafter edge (missed)
    assert sorted(v[0] for v in learned.values()) == [0.0, 1.0, 1.0, 1.0, 1.0]
