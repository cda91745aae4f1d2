"""Draft trees: data structure, tree ops, and fast builders against their literal references."""

import itertools
import math

import pytest
import torch

from dartree import reference
from dartree.tree import (
    HEAD_ATTRIBUTES,
    DraftBlock,
    DraftTree,
    build_chain,
    build_dartree,
    build_dartree_reference,
    build_ddtree,
    build_ddtree_reference,
    dartree_schedule,
    dartree_sizes,
)


class TinyHead:
    """A stand-in Domino head with the attributes and methods the builders use."""

    def __init__(self, vocab, hidden=12, gru=10, rank=6, bias=True, seed=0, dtype=torch.float64):
        gen = torch.Generator().manual_seed(seed)

        def rand(*shape):
            return torch.randn(*shape, generator=gen, dtype=dtype) * 0.7

        self.embedding = rand(vocab, hidden)
        self.cell = torch.nn.GRUCell(hidden, gru, bias=bias).to(dtype)
        with torch.no_grad():
            for p in self.cell.parameters():
                p.copy_(rand(*p.shape))
        self.W_z, self.W_s, self.W_2 = rand(rank, hidden), rand(rank, gru), rand(vocab, rank) * 2
        self.b_1 = rand(rank) if bias else None
        self.b_2 = rand(vocab) if bias else None
        self.W_hh = self.cell.weight_hh.detach()
        self.b_hh = self.cell.bias_hh.detach() if bias else None
        b_ih = self.cell.bias_ih.detach() if bias else 0
        self.input_table = self.embedding @ self.cell.weight_ih.detach().T + b_ih

    def gru_step(self, tokens, g):
        with torch.no_grad():
            return self.cell(self.embedding[tokens], g)

    def root_state(self, bonus):
        bonus = torch.as_tensor(bonus).view(1)
        return self.gru_step(bonus, self.W_s.new_zeros(1, self.W_s.shape[1]))

    def project(self, h):
        z = h @ self.W_z.T
        return z if self.b_1 is None else z + self.b_1

    def correction(self, z, g, cand):
        w2 = self.W_2 if cand is None else self.W_2[cand]
        out = torch.nn.functional.silu(z + g @ self.W_s.T) @ w2.T
        if self.b_2 is not None:
            out = out + (self.b_2 if cand is None else self.b_2[cand])
        return out


def make_block(seed, slots, vocab, head=True, prefix_len=1, dtype=torch.float64, scale=2.0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(slots, vocab, generator=gen, dtype=torch.float64) * scale).to(dtype)
    root = int(torch.randint(vocab, (1,), generator=gen))
    if not head:
        return DraftBlock(root, logits)
    tiny = TinyHead(vocab, seed=seed, bias=bias, dtype=dtype)
    hidden = torch.randn(slots, tiny.W_z.shape[1], generator=gen, dtype=dtype)
    return DraftBlock(root, logits, tiny, tiny.project(hidden), prefix_len)


def assert_same_tree(a, b, exact_scores=False):
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.parents, b.parents)
    assert torch.equal(a.depths, b.depths)
    if exact_scores:
        assert torch.equal(a.scores, b.scores)
    else:
        torch.testing.assert_close(a.scores, b.scores.to(a.scores.dtype), rtol=1e-9, atol=1e-9)


def check_well_formed(tree, root):
    tree.validate()
    assert int(tree.tokens[0]) == root
    assert len(tree.paths()) == tree.num_nodes - 1  # no duplicate siblings
    parents = tree.parents.tolist()
    scores = tree.scores.tolist()
    assert all(scores[i] <= scores[parents[i]] for i in range(1, tree.num_nodes))


# ---------------------------------------------------------------------------------------------
# DraftTree


def test_chain_and_ancestor_mask():
    tree = DraftTree.chain(torch.tensor([5, 1, 2, 3]), torch.tensor([0.0, -1.0, -2.0, -2.5]))
    tree.validate()
    assert tree.num_nodes == 4
    assert tree.parents.tolist() == [-1, 0, 1, 2] and tree.depths.tolist() == [0, 1, 2, 3]
    assert torch.equal(tree.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert tree.paths() == {(1,), (1, 2), (1, 2, 3)}


def test_ancestor_mask_matches_literal_walk():
    parents = [-1, 0, 0, 1, 1, 2, 4, 6, 0]
    tree = DraftTree(torch.arange(9), torch.tensor(parents), torch.tensor([0, 1, 1, 2, 2, 2, 3, 4, 1]),
                     torch.zeros(9))
    tree.validate()
    expect = torch.zeros(9, 9, dtype=torch.bool)
    for i in range(9):
        j = i
        while j >= 0:
            expect[i, j] = True
            j = parents[j]
    assert torch.equal(tree.ancestor_mask(), expect)
    assert torch.equal(DraftTree.chain(torch.tensor([3])).ancestor_mask(), torch.ones(1, 1, dtype=torch.bool))


def test_a_mask_given_with_the_tree_is_returned_and_checked():
    """A builder that knows the mask on the host passes it (no pointer doubling); validate() holds
    it to the derived one."""
    chain = DraftTree.chain(torch.tensor([5, 1, 2, 3, 4]))
    assert chain.mask is not None
    derived = DraftTree(chain.tokens, chain.parents, chain.depths, chain.scores).ancestor_mask()
    assert derived is not chain.ancestor_mask() and torch.equal(derived, chain.ancestor_mask())
    parents = torch.tensor([-1, 0, 0, 1])
    tree = DraftTree(torch.arange(4), parents, torch.tensor([0, 1, 1, 2]), torch.zeros(4))
    wrong = tree.ancestor_mask().clone()
    wrong[3, 2] = True  # node 2 is not an ancestor of node 3
    for bad in (wrong, wrong[:3, :3], tree.ancestor_mask().int()):
        with pytest.raises(ValueError, match="not the ancestor mask"):
            DraftTree(tree.tokens, parents, tree.depths, tree.scores, bad).validate()
    DraftTree(tree.tokens, parents, tree.depths, tree.scores, tree.ancestor_mask().clone()).validate()


@pytest.mark.parametrize("parents, depths, message", [
    ([-1, 0, 2], [0, 1, 2], "parents\\[2\\]"),
    ([-1, 0, 1], [0, 1, 1], "depths\\[2\\]"),
    ([0, 0, 1], [0, 1, 2], "root"),
])
def test_validate_rejects_malformed(parents, depths, message):
    tree = DraftTree(torch.arange(3), torch.tensor(parents), torch.tensor(depths), torch.zeros(3))
    with pytest.raises(ValueError, match=message):
        tree.validate()


def test_validate_rejects_wrong_dtype_and_shape():
    with pytest.raises(ValueError, match="parents must be int64"):
        DraftTree(torch.arange(2), torch.tensor([-1, 0], dtype=torch.int32), torch.arange(2),
                  torch.zeros(2)).validate()
    with pytest.raises(ValueError, match="scores must have shape"):
        DraftTree(torch.arange(2), torch.tensor([-1, 0]), torch.arange(2), torch.zeros(3)).validate()


# ---------------------------------------------------------------------------------------------
# ops: candidate_topk, expand_level, prune_tree, verify_tree


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_candidate_topk_matches_sort_with_ties(dtype):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(-3, 3, (5, 37), generator=gen).to(dtype)  # many ties
    values, ids, lse = reference.candidate_topk(logits, 11)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    assert values.dtype == lse.dtype == compute and ids.dtype == torch.int64
    for row in range(5):
        data = logits[row].float().tolist()
        expect = sorted(range(37), key=lambda t: (-data[t], t))[:11]
        assert ids[row].tolist() == expect
        assert values[row].tolist() == [data[t] for t in expect]
    torch.testing.assert_close(lse, torch.logsumexp(logits.to(compute), dim=-1))
    with pytest.raises(ValueError, match="num_candidates"):
        reference.candidate_topk(logits, 38)


@pytest.mark.parametrize("n", [0, 1, 5, 50, 624, 625, 626, 5000])
def test_stable_topk_orders_ties_by_index(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randint(-20, 20, (3, 5000), generator=gen).float()  # ties at and above any threshold
    x[1, :] = 0.0
    got = reference.stable_topk(x, n)
    for row in range(3):
        data = x[row].tolist()
        assert got[row].tolist() == sorted(range(5000), key=lambda i: (-data[i], i))[:n]
    assert reference.stable_topk(x[0], n).tolist() == got[0].tolist()


def test_candidate_topk_large_vocabulary():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randint(-50, 50, (4, 6000), generator=gen).float()
    values, ids, _ = reference.candidate_topk(logits, 64)
    for row in range(4):
        data = logits[row].tolist()
        assert ids[row].tolist() == sorted(range(6000), key=lambda t: (-data[t], t))[:64]
    assert torch.equal(values, logits.gather(1, ids))


def literal_expand(parent_scores, states, z, head, cand_base, cand_ids, num_expand, num_select):
    """Scores of every pair by loops, then a sort by (-score, parent, candidate)."""
    pairs = []
    for p in range(parent_scores.shape[0]):
        row = cand_base.clone()
        if z is not None:
            row = row + head.correction(z, states[p:p + 1], cand_ids)[0]
        log_z = torch.logsumexp(row, 0)
        for j in range(num_expand):
            pairs.append((float(parent_scores[p] + (row[j] - log_z)), p, j))
    pairs.sort(key=lambda x: (-x[0], x[1], x[2]))
    return pairs[:num_select]


@pytest.mark.parametrize("corrected", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_expand_level_matches_loops(corrected, bias):
    vocab, count, width, expand, select = 50, 5, 13, 9, 17
    head = TinyHead(vocab, bias=bias, seed=3)
    gen = torch.Generator().manual_seed(4)
    states = torch.randn(count, 10, generator=gen, dtype=torch.float64)
    scores = -torch.rand(count, generator=gen, dtype=torch.float64) * 3
    cand_ids = torch.randperm(vocab, generator=gen)[:width]
    cand_base = torch.sort(torch.randn(width, generator=gen, dtype=torch.float64), descending=True).values
    z = torch.randn(6, generator=gen, dtype=torch.float64) if corrected else None
    out = reference.expand_level(
        scores, states, z, head.W_s if corrected else None, head.W_2[cand_ids] if corrected else None,
        head.b_2[cand_ids] if corrected and bias else None, cand_base, cand_ids, expand, select,
        head.input_table, head.W_hh, head.b_hh)
    parent_pos, tokens, new_scores, new_states = out
    expect = literal_expand(scores, states, z, head, cand_base, cand_ids, expand, select)
    assert parent_pos.tolist() == [p for _, p, _ in expect]
    assert tokens.tolist() == [int(cand_ids[j]) for _, _, j in expect]
    torch.testing.assert_close(new_scores, torch.tensor([s for s, _, _ in expect], dtype=torch.float64))
    torch.testing.assert_close(new_states, head.gru_step(tokens, states[parent_pos]))


def test_expand_level_ties_prefer_lower_parent_then_candidate():
    scores = torch.zeros(3)
    out = reference.expand_level(scores, None, None, None, None, None, torch.zeros(4),
                                 torch.tensor([7, 8, 9, 6]), 4, 6)
    assert out[0].tolist() == [0, 0, 0, 0, 1, 1]
    assert out[1].tolist() == [7, 8, 9, 6, 7, 8]
    assert out[3] is None
    with pytest.raises(ValueError, match="num_select"):
        reference.expand_level(scores, None, None, None, None, None, torch.zeros(4),
                               torch.arange(4), 2, 7)


def random_scored_tree(seed, size):
    gen = torch.Generator().manual_seed(seed)
    parents, depths, scores = [-1], [0], [0.0]
    for node in range(1, size):
        parent = int(torch.randint(node, (1,), generator=gen))
        parents.append(parent)
        depths.append(depths[parent] + 1)
        scores.append(scores[parent] - float(torch.rand(1, generator=gen)) * 2)
    return torch.tensor(parents), torch.tensor(depths), torch.tensor(scores)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget, bonus", [(1, -0.2), (7, -0.2), (20, 0.0), (40, -1.0), (100, -0.2)])
def test_prune_tree_matches_sorted_selection(seed, budget, bonus):
    parents, depths, scores = random_scored_tree(seed, 40)
    kept, new_parents = reference.prune_tree(parents, depths, scores, budget, bonus)
    keys = [float(scores[i] + bonus * depths[i].float()) for i in range(40)]
    expect = [0] + sorted(sorted(range(1, 40), key=lambda i: (-keys[i], i))[:budget])
    assert kept.tolist() == expect
    for new, old in enumerate(expect[1:], start=1):  # prefix-closed and remapped
        assert expect[new_parents[new]] == int(parents[old])
    assert new_parents[0] == -1


def test_prune_tree_of_the_root_alone():
    kept, new_parents = reference.prune_tree(torch.tensor([-1]), torch.tensor([0]), torch.zeros(1), 4, -0.2)
    assert kept.tolist() == [0] and new_parents.tolist() == [-1]


def test_prune_tree_ties_keep_lower_index_and_refuse_non_monotone_scores():
    parents = torch.tensor([-1, 0, 0, 0, 1])
    depths = torch.tensor([0, 1, 1, 1, 2])
    kept, new_parents = reference.prune_tree(parents, depths, torch.tensor([0.0, -1, -1, -1, -1]), 2, 0.0)
    assert kept.tolist() == [0, 1, 2] and new_parents.tolist() == [-1, 0, 0]
    with pytest.raises(ValueError, match="parent was pruned"):
        reference.prune_tree(parents, depths, torch.tensor([0.0, -3, -1, -1, -0.5]), 1, 0.0)
    with pytest.raises(ValueError, match="budget"):
        reference.prune_tree(parents, depths, torch.zeros(5), 0, 0.0)


def verify(tree, target):
    accepted, bonus = reference.verify_tree(tree.parents, tree.tokens, torch.tensor(target))
    return accepted.tolist(), int(bonus)


def test_verify_tree_walks():
    chain = DraftTree.chain(torch.tensor([9, 1, 2, 3]))
    assert verify(chain, [1, 2, 3, 4]) == ([0, 1, 2, 3], 4)
    assert verify(chain, [1, 2, 5, 4]) == ([0, 1, 2], 5)
    assert verify(chain, [7, 2, 3, 4]) == ([0], 7)
    star = DraftTree(torch.tensor([9, 4, 5, 6]), torch.tensor([-1, 0, 0, 0]), torch.tensor([0, 1, 1, 1]),
                     torch.zeros(4))
    assert verify(star, [6, 0, 0, 8]) == ([0, 3], 8)
    assert verify(star, [7, 0, 0, 8]) == ([0], 7)
    assert verify(DraftTree.chain(torch.tensor([9])), [3]) == ([0], 3)
    # a deeper tree: root -> {a: 1, b: 2}, a -> {c: 3}, b -> {d: 3, e: 4}, e -> {f: 5}
    tree = DraftTree(torch.tensor([0, 1, 2, 3, 3, 4, 5]), torch.tensor([-1, 0, 0, 1, 2, 2, 5]),
                     torch.tensor([0, 1, 1, 2, 2, 2, 3]), torch.zeros(7))
    assert verify(tree, [2, 0, 4, 0, 0, 5, 6]) == ([0, 2, 5, 6], 6)
    assert verify(tree, [1, 3, 4, 8, 0, 5, 6]) == ([0, 1, 3], 8)


def test_verify_tree_rejects_bad_input():
    with pytest.raises(ValueError, match="target_tokens"):
        reference.verify_tree(torch.tensor([-1, 0]), torch.tensor([1, 2]), torch.tensor([1]))
    with pytest.raises(ValueError, match="parents"):
        reference.verify_tree(torch.tensor([-1, 1]), torch.tensor([1, 2]), torch.tensor([1, 2]))


# ---------------------------------------------------------------------------------------------
# chains


def test_dflash_chain_is_argmax_with_cumulative_scores():
    block = make_block(0, 5, 30, head=False)
    tree = build_chain(block, temperature=1.0)  # DFlash chains are argmax at any temperature
    assert tree.tokens[1:].tolist() == block.base_logits.argmax(-1).tolist()
    steps = torch.log_softmax(block.base_logits, -1).max(-1).values
    torch.testing.assert_close(tree.scores, torch.cat([torch.zeros(1, dtype=torch.float64), steps.cumsum(0)]))
    check_well_formed(tree, block.root)


@pytest.mark.parametrize("prefix_len", [0, 1, 3])
def test_domino_chain_matches_literal_loop(prefix_len):
    block = make_block(2, 6, 40, prefix_len=prefix_len)
    head = block.head
    tree = build_chain(block, corrected=True)
    tokens, g = [], head.root_state(block.root)
    for slot in range(6):
        row = block.base_logits[slot].clone()
        if slot >= prefix_len:
            row += (head.W_2 @ torch.nn.functional.silu(block.z[slot] + head.W_s @ g[0])) + head.b_2
        tokens.append(int(row.argmax()))
        g = head.cell(head.embedding[tokens[-1:]], g).detach()
    assert tree.tokens.tolist() == [block.root] + tokens
    check_well_formed(tree, block.root)


def test_domino_chain_sampling_uses_generator():
    block = make_block(3, 5, 40)
    first = build_chain(block, 0.7, torch.Generator().manual_seed(5), corrected=True)
    again = build_chain(block, 0.7, torch.Generator().manual_seed(5), corrected=True)
    assert torch.equal(first.tokens, again.tokens)
    cold = build_chain(block, 1e-4, torch.Generator().manual_seed(5), corrected=True)
    assert torch.equal(cold.tokens, build_chain(block, corrected=True).tokens)
    with pytest.raises(ValueError, match="needs a head"):
        build_chain(make_block(3, 5, 40, head=False), corrected=True)


# ---------------------------------------------------------------------------------------------
# DDTree


DDTREE_CASES = [(k, v, b) for k in (1, 3, 6) for v in (5, 61) for b in (1, 2, 9, 33, 100)]


@pytest.mark.parametrize("slots, vocab, budget", DDTREE_CASES)
def test_ddtree_fast_equals_heap(slots, vocab, budget):
    for seed in range(3):
        block = make_block(seed, slots, vocab, head=False, dtype=torch.float32)
        fast, heap = build_ddtree(block, budget), build_ddtree_reference(block, budget)
        assert_same_tree(fast, heap, exact_scores=True)
        check_well_formed(fast, block.root)
        assert fast.num_nodes - 1 == min(budget, sum(vocab ** d for d in range(1, slots + 1)))


@pytest.mark.parametrize("seed", range(4))
def test_ddtree_ties_follow_the_heap(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-2, 1, (4, 6), generator=gen).float()  # scores tie everywhere
    # identical slots with a certain top token: log q = 0 there, so nodes of different depths tie
    certain = torch.tensor([[100.0, 1, 1, 0, 0]]).repeat(4, 1)
    for block in (DraftBlock(0, logits), DraftBlock(0, certain)):
        for budget in (3, 10, 40):
            fast, heap = build_ddtree(block, budget), build_ddtree_reference(block, budget)
            assert_same_tree(fast, heap, exact_scores=True)


@pytest.mark.parametrize("seed", range(5))
def test_ddtree_is_the_top_prefixes(seed):
    slots, vocab, budget = 3, 4, 13
    block = make_block(seed, slots, vocab, head=False)
    log_q = torch.log_softmax(block.base_logits, -1).tolist()
    prefixes = [p for d in range(1, slots + 1) for p in itertools.product(range(vocab), repeat=d)]
    prob = {p: sum(log_q[i][t] for i, t in enumerate(p)) for p in prefixes}
    best = sorted(prefixes, key=lambda p: -prob[p])[:budget]
    tree = build_ddtree(block, budget)
    assert tree.paths() == set(best)
    for node, path in enumerate(_node_paths(tree), start=1):
        assert math.isclose(float(tree.scores[node]), prob[path], abs_tol=1e-9)


def _node_paths(tree):
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = [()]
    for node in range(1, tree.num_nodes):
        paths.append(paths[parents[node]] + (tokens[node],))
    return paths[1:]


# ---------------------------------------------------------------------------------------------
# DARTree


def test_dartree_schedule():
    assert dartree_schedule(16, 64, 12, 64, fixed=False) == [12] * 16
    assert dartree_schedule(16, 64, 12, 64, fixed=True) == [4] * 16
    assert dartree_schedule(4, 3, 12, 64, fixed=True) == [3, 9, 26, 26]
    assert dartree_schedule(4, 64, 12, 2, fixed=True) == [1, 1]
    assert dartree_schedule(3, 5, 12, 10, fixed=False) == [5, 5, 5]  # width capped by E
    assert dartree_sizes(vocab=100, candidates=64, expansion_k=64, budget=16) == (64, 16)
    assert dartree_sizes(vocab=40, candidates=64, expansion_k=64, budget=64) == (40, 40)


DARTREE_CASES = [
    # slots, vocab, width, candidates, budget, expansion_k, prefix_len, fixed
    (5, 40, 3, 7, 9, None, 1, False),  # W * C = 21
    (6, 60, 5, 12, 16, None, 0, False),
    (4, 30, 4, 10, 100, None, 1, False),  # budget > supertree: no pruning
    (4, 30, 4, 10, 1, None, 1, False),  # budget 1
    (5, 50, 10, 20, 8, None, 2, False),  # E = budget < C, width capped by E
    (5, 50, 6, 20, 30, 5, 1, False),  # expansion_k < candidates
    (5, 25, 3, 9, 30, None, 1, True),
    (6, 40, 3, 7, 11, None, 0, True),
    (3, 8, 3, 20, 64, None, 1, True),  # fixed quotas > E, C = V
    (4, 30, 3, 10, 1, None, 1, True),
    (5, 40, 4, 9, 15, None, 9, False),  # no corrected slot
    (1, 20, 3, 5, 4, None, 0, False),  # one slot, corrected, no GRU step after it
    (1, 20, 3, 5, 4, None, 1, True),
]


@pytest.mark.parametrize("case", DARTREE_CASES)
@pytest.mark.parametrize("head", [True, False])
def test_dartree_fast_equals_literal(case, head):
    slots, vocab, width, candidates, budget, expansion_k, prefix_len, fixed = case
    for seed in range(3):
        block = make_block(seed, slots, vocab, head=head, prefix_len=prefix_len, bias=seed != 1)
        kwargs = dict(width=width, candidates=candidates, budget=budget, depth_bonus=-0.3 * seed,
                      fixed=fixed, expansion_k=expansion_k)
        fast = build_dartree(block, **kwargs)
        literal = build_dartree_reference(block, **kwargs)
        assert fast.paths() == literal.paths()
        assert_same_tree(fast, literal)
        check_well_formed(fast, block.root)

        # budgets and widths
        _, expand = dartree_sizes(vocab, candidates, expansion_k or candidates, budget)
        plan = dartree_schedule(slots, expand, width, budget, fixed)
        per_depth = torch.bincount(fast.depths[1:], minlength=slots + 1)[1:].tolist()
        assert fast.num_nodes - 1 == min(budget, sum(plan))
        if fixed:
            assert per_depth[:len(plan)] == plan and sum(plan) <= budget
        assert all(count <= min(width, expand) or fixed for count in per_depth)


@pytest.mark.parametrize("fixed", [False, True])
def test_dartree_ties_follow_the_literal_order(fixed):
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        block = DraftBlock(1, torch.randint(-2, 1, (4, 9), generator=gen).double())  # ties everywhere
        for budget in (1, 5, 12):
            kwargs = dict(width=4, candidates=6, budget=budget, depth_bonus=0.0 if seed % 2 else -0.5,
                          fixed=fixed)
            assert_same_tree(build_dartree(block, **kwargs), build_dartree_reference(block, **kwargs))


def test_dartree_float32_matches_literal_as_sets():
    for seed in range(4):
        block = make_block(seed, 6, 80, dtype=torch.float32)
        fast = build_dartree(block, width=5, candidates=16, budget=20)
        literal = build_dartree_reference(block, width=5, candidates=16, budget=20)
        assert fast.paths() == literal.paths()
        torch.testing.assert_close(fast.scores, literal.scores, rtol=1e-5, atol=1e-5)
        assert fast.scores.dtype == torch.float32


def test_dartree_prefix_is_uncorrected_and_renormalised_over_candidates():
    block = make_block(7, 3, 30, prefix_len=1)
    tree = build_dartree(block, width=4, candidates=8, budget=100)
    cand = reference.candidate_topk(block.base_logits, 8)[0][0]
    torch.testing.assert_close(tree.scores[1:5], (cand - torch.logsumexp(cand, 0))[:4])


def test_dartree_without_head_is_a_base_beam():
    block = make_block(8, 4, 30, head=False)
    tree = build_dartree(block, width=3, candidates=30, budget=100)
    log_q = torch.log_softmax(block.base_logits, -1)
    for node, path in enumerate(_node_paths(tree), start=1):
        expect = sum(log_q[i, t] for i, t in enumerate(path))
        assert math.isclose(float(tree.scores[node]), float(expect), abs_tol=1e-9)


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=0), "budget must be >= 1, got 0"),
    (dict(width=0), "width must be >= 1"),
    (dict(candidates=0), "candidates must be >= 1"),
    (dict(depth_bonus=0.5), "depth_bonus must be <= 0"),
])
def test_dartree_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_dartree(make_block(0, 3, 20), **kwargs)


def test_blocks_are_validated():
    with pytest.raises(ValueError, match="root must be a token id"):
        build_ddtree(DraftBlock(20, torch.zeros(3, 20)), 4)
    with pytest.raises(ValueError, match="base_logits must be a float"):
        build_ddtree(DraftBlock(0, torch.zeros(3, 20, dtype=torch.int64)), 4)
    block = make_block(0, 3, 20)
    with pytest.raises(ValueError, match="z must be"):
        build_dartree(DraftBlock(0, block.base_logits, block.head, block.z[:2], 1))
    with pytest.raises(ValueError, match="budget must be >= 1"):
        build_ddtree(block, 0)


def test_head_attributes_are_documented():
    head = TinyHead(10)
    assert all(hasattr(head, name) for name in HEAD_ATTRIBUTES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.cuda
def test_builders_on_cuda_match_cpu():
    block = make_block(5, 6, 300, prefix_len=1)
    head = block.head
    for name in ("embedding", "W_z", "W_s", "W_2", "b_2", "W_hh", "b_hh", "input_table"):
        setattr(head, name, getattr(head, name).cuda())
    head.cell = head.cell.cuda()
    gpu = DraftBlock(block.root, block.base_logits.cuda(), head, block.z.cuda(), 1)
    for fixed in (False, True):
        got = build_dartree(gpu, width=5, candidates=24, budget=20, fixed=fixed)
        assert got.tokens.is_cuda
        want = build_dartree_reference(gpu, width=5, candidates=24, budget=20, fixed=fixed)
        assert_same_tree(got, want)
    plain = DraftBlock(block.root, block.base_logits.cuda())
    assert_same_tree(build_ddtree(plain, 50), build_ddtree_reference(plain, 50), exact_scores=True)
    tree = build_chain(gpu, corrected=True)
    accepted, bonus = reference.verify_tree(tree.parents, tree.tokens, torch.roll(tree.tokens, -1))
    assert accepted.tolist() == list(range(tree.num_nodes)) and bonus.is_cuda


@pytest.mark.parametrize("bias", [False, True])
def test_dartree_with_the_real_domino_head(bias):
    from dartree.drafter import DominoHead

    torch.manual_seed(0)
    vocab, hidden = 70, 16
    head = DominoHead(hidden, vocab, emb_dim=8, gru_hidden_dim=12, gru_bias=bias, w1_bias=bias,
                      w2_bias=bias).double()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.6)
    head.build_input_table(torch.randn(vocab, hidden, dtype=torch.float64))
    logits = torch.randn(5, vocab, dtype=torch.float64) * 2
    z = head.project(torch.randn(5, hidden, dtype=torch.float64))
    block = DraftBlock(torch.tensor(3), logits, head, z, 1)
    for fixed in (False, True):
        fast = build_dartree(block, width=4, candidates=10, budget=12, fixed=fixed)
        assert_same_tree(fast, build_dartree_reference(block, width=4, candidates=10, budget=12, fixed=fixed))
        assert not fast.scores.requires_grad and int(fast.tokens[0]) == 3
    chain = build_chain(block, corrected=True)
    assert chain.num_nodes == 6


def _trimmed(block, slots):
    return DraftBlock(block.root, block.base_logits[:slots], block.head,
                      None if block.z is None else block.z[:slots], block.prefix_len)


@pytest.mark.parametrize("seed", range(3))
def test_trees_of_budget_b_read_only_the_first_b_slots(seed):
    """A tree of `budget` draft nodes is at most `budget` deep, so every builder gives the same tree
    from the block's first min(budget, k) slots (what the decoder computes base logits for)."""
    gen = torch.Generator().manual_seed(seed)
    ties = DraftBlock(2, torch.randint(-2, 1, (10, 9), generator=gen).double())
    for block in (make_block(seed, 10, 40, prefix_len=seed % 3), make_block(seed, 10, 40, head=False), ties):
        for budget in (1, 2, 5, 9):
            short = _trimmed(block, budget)
            assert_same_tree(build_ddtree(block, budget), build_ddtree(short, budget), exact_scores=True)
            for fixed, bonus in ((False, -0.3), (False, 0.0), (True, 0.0)):
                kwargs = dict(width=3, candidates=6, budget=budget, depth_bonus=bonus, fixed=fixed)
                assert_same_tree(build_dartree(block, **kwargs), build_dartree(short, **kwargs),
                                 exact_scores=True)
