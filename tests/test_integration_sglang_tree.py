"""dartree.integrations.sglang_tree: dartree's trees as SGLang's verify arrays. The arrays must
meet the contract SGLang derives from a tree mask (its reconstruct_indices_from_tree_mask), and
SGLang's greedy walk over them must accept exactly the path dartree's reference walk accepts."""

import random

import pytest
import torch

from dartree import reference
from dartree.integrations.sglang_tree import pad_tree, to_sglang
from dartree.tree import DraftBlock, DraftTree, build_ddtree


def _random_tree(rng, size, vocab):
    parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    depths = [0]
    for i in range(1, size):
        depths.append(depths[parents[i]] + 1)
    tokens = [rng.randrange(vocab) for _ in range(size)]  # a small vocabulary: repeated siblings
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths),
                     torch.zeros(size))


def _contract(mask, seq_len, n, size):
    """SGLang's arrays from one request's [n, n] mask, by the definitions of its kernel, for a
    tree of `size` real nodes: padding nodes (after them) are linked to nothing."""
    n_all, n = n, size
    anc = [[bool(mask[i, j]) and j < i for j in range(n)] for i in range(n)]
    parent = [max([j for j in range(i) if anc[i][j]], default=-1) for i in range(n)]
    positions = [seq_len + sum(anc[i]) for i in range(n)]
    next_token = [min([k for k in range(t + 1, n) if anc[k][t]], default=-1) for t in range(n)]
    next_sibling = [-1 if parent[t] < 0 else
                    min([k for k in range(t + 1, n) if parent[k] == parent[t]], default=-1)
                    for t in range(n)]
    positions += [seq_len + 1] * (n_all - n)  # padding: leaves under the root
    return positions, next_token + [-1] * (n_all - n), next_sibling + [-1] * (n_all - n)


def _sglang_greedy_walk(arrays, target_predict, b, n):
    """SGLang's verify_tree_greedy for request b: (accepted node indices, bonus token)."""
    candidates = arrays.draft_tokens.view(-1, n)[b].tolist()
    index = arrays.retrieve_index[b].tolist()
    next_token = arrays.retrieve_next_token[b].tolist()
    next_sibling = arrays.retrieve_next_sibling[b].tolist()
    flat = target_predict.reshape(-1).tolist()
    last, accepted = index[0], [index[0]]
    cur = 0
    for _ in range(1, n):
        cur = next_token[cur]
        want = flat[last]
        while cur != -1 and candidates[cur] != want:
            cur = next_sibling[cur]
        if cur == -1:
            break
        last = index[cur]
        accepted.append(last)
    return [i - b * n for i in accepted], flat[last]


@pytest.mark.parametrize("seed", range(4))
def test_arrays_meet_sglang_contract_and_walk_agrees(seed):
    rng = random.Random(seed)
    n, bs = 12, 6
    trees = [_random_tree(rng, rng.randrange(1, n + 1), vocab=3) for _ in range(bs)]
    seq_lens = torch.tensor([rng.randrange(0, 100) for _ in range(bs)])
    arrays = to_sglang(trees, seq_lens, n)
    assert arrays.draft_tokens.shape == (bs * n,) and arrays.tree_mask.shape == (bs * n * n,)
    masks = arrays.tree_mask.view(bs, n, n)
    for b in range(bs):
        positions, next_token, next_sibling = _contract(masks[b], int(seq_lens[b]), n,
                                                        trees[b].num_nodes)
        assert arrays.positions.view(bs, n)[b].tolist() == positions
        assert arrays.retrieve_next_token[b].tolist() == next_token
        assert arrays.retrieve_next_sibling[b].tolist() == next_sibling
        assert arrays.retrieve_index[b].tolist() == list(range(b * n, (b + 1) * n))
    for _ in range(20):
        target = torch.randint(0, 3, (bs, n))
        for b, tree in enumerate(trees):
            path, bonus = _sglang_greedy_walk(arrays, target, b, n)
            # the target's tokens of the original nodes (padding nodes sit after them)
            want_path, want_bonus = reference.verify_tree(tree.parents, tree.tokens,
                                                          target[b, :tree.num_nodes])
            assert path == want_path.tolist()
            assert bonus == int(want_bonus)


def test_ddtree_trees_round_trip():
    """Trees from a builder (fewer nodes than asked when the vocabulary is small: padded)."""
    torch.manual_seed(0)
    n = 10
    trees = [build_ddtree(DraftBlock(root=1, base_logits=torch.randn(slots, vocab)), budget=n - 1)
             for slots, vocab in ((2, 2), (4, 50))]
    assert trees[0].num_nodes < n == trees[1].num_nodes
    arrays = to_sglang(trees, torch.tensor([5, 9]), n)
    for b, tree in enumerate(trees):
        for _ in range(10):
            target = torch.randint(0, 2, (2, n))
            target[b, :tree.num_nodes] = torch.where(torch.rand(tree.num_nodes) < 0.7,
                                                     _child_tokens(tree), target[b, :tree.num_nodes])
            path, bonus = _sglang_greedy_walk(arrays, target, b, n)
            want_path, want_bonus = reference.verify_tree(tree.parents, tree.tokens,
                                                          target[b, :tree.num_nodes])
            assert path == want_path.tolist() and bonus == int(want_bonus)


def _child_tokens(tree):
    """For each node, the token of its first child (its own token for a leaf): a target that
    agrees with the draft, so that walks go deep."""
    out = tree.tokens.clone()
    for node in reversed(range(1, tree.num_nodes)):
        out[tree.parents[node]] = tree.tokens[node]
    return out


def test_padding_keeps_the_tree_and_refuses_overflow():
    tree = _random_tree(random.Random(1), 5, vocab=4)
    padded = pad_tree(tree, 8)
    assert padded.num_nodes == 8
    padded.validate()
    assert padded.tokens[:5].tolist() == tree.tokens.tolist()
    assert padded.parents[5:].tolist() == [0, 0, 0]
    # a root-only tree: its padding is never accepted, whatever the target says
    root = DraftTree.chain(torch.tensor([3]))
    arrays = to_sglang([root], torch.tensor([0]), 4)
    assert _sglang_greedy_walk(arrays, torch.full((1, 4), 3), 0, 4) == ([0], 3)
    with pytest.raises(ValueError, match="more than the 4 SGLang verifies"):
        pad_tree(tree, 4)
    with pytest.raises(ValueError, match="2 trees for 3 requests"):
        to_sglang([tree, tree], torch.tensor([1, 2, 3]), 8)
