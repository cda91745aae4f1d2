"""dartree's draft trees as SGLang's tree-verify arrays (plain torch; no SGLang import).

SGLang verifies a batch of trees of exactly n nodes each (``speculative_num_draft_tokens``),
node 0 the request's last committed token, parents before children, through these arrays (the
contract of its ``reconstruct_indices_from_tree_mask`` kernel, which its n-gram worker runs):

    draft_tokens           int64 [bs * n]       node tokens, request after request
    tree_mask              bool [bs * n * n]    (b, i, j) row-major: j is i or an ancestor of i
    positions              int64 [bs * n]       seq_lens[b] + depth
    retrieve_index         int64 [bs, n]        b * n + i: the node's row in the verify pass
    retrieve_next_token    int64 [bs, n]        the node's first child (lowest index), else -1
    retrieve_next_sibling  int64 [bs, n]        the next child of its parent after it, else -1

Its greedy walk (``verify_tree_greedy``) starts at the root and, at each node, takes the first
child in (next_token, next_sibling) order whose token is the target's token at the node: the child
of lowest index, as `dartree.reference.verify_tree`. A dartree tree with fewer than n nodes (a
small vocabulary, a shallow drafter) is padded with leaves under the root that no link reaches:
the target computes their rows, the walk never visits them, and the accepted path is the tree's
own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import DraftTree


@dataclass
class SglangVerifyArrays:
    """The arrays of one verify pass (shapes above); what SGLang's ``NgramVerifyInput`` holds."""

    draft_tokens: torch.Tensor
    tree_mask: torch.Tensor
    positions: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor


def pad_tree(tree: DraftTree, num_nodes: int) -> DraftTree:
    """`tree` with exactly `num_nodes` nodes: the extra ones are leaves under the root holding the
    root's token (`to_sglang` links none of them, so their token is never compared)."""
    size = tree.num_nodes
    if size > num_nodes:
        raise ValueError(f"the tree has {size} nodes, more than the {num_nodes} SGLang verifies "
                         "per request (speculative_num_draft_tokens)")
    extra = num_nodes - size
    if extra == 0:
        return tree
    ones = torch.ones(extra, dtype=torch.int64, device=tree.device)
    return DraftTree(tokens=torch.cat([tree.tokens, tree.tokens[:1].expand(extra)]),
                     parents=torch.cat([tree.parents, ones * 0]),
                     depths=torch.cat([tree.depths, ones]),
                     scores=torch.cat([tree.scores, tree.scores.new_full((extra,), -torch.inf)]))


def to_sglang(trees: list[DraftTree], seq_lens: torch.Tensor, num_nodes: int) -> SglangVerifyArrays:
    """SGLang's verify arrays for one tree per request (each padded to `num_nodes`, see `pad_tree`).

    trees: the round's tree of each request, root = its last committed token; seq_lens int [bs]:
    tokens before each root (the root sits at position seq_lens[b]).
    """
    if len(trees) != seq_lens.shape[0]:
        raise ValueError(f"got {len(trees)} trees for {seq_lens.shape[0]} requests")
    if not trees:
        raise ValueError("to_sglang needs at least one tree")
    n, device = num_nodes, trees[0].device
    padded = [pad_tree(tree, n) for tree in trees]
    bs = len(padded)
    nodes = torch.arange(n, device=device)
    real = nodes[None, :] < torch.tensor([t.num_nodes for t in trees], device=device)[:, None]
    # links over the real nodes only: a padding node is nobody's child or sibling (parent -2)
    parents = torch.where(real, torch.stack([t.parents for t in padded]), -2)  # [bs, n]
    mask = torch.stack([t.ancestor_mask() for t in padded])  # [bs, n, n]
    depths = torch.stack([t.depths for t in padded])
    # first child: the lowest node whose parent is this one; next sibling: the lowest later node
    # with the same parent (the root and padding nodes have none)
    is_child = parents[:, None, :] == nodes[None, :, None]  # [bs, parent, node]
    first_child = torch.where(is_child, nodes, n).amin(-1)
    later_same = (parents[:, None, :] == parents[:, :, None]) & (nodes[None, :] > nodes[:, None])
    next_sibling = torch.where(later_same, nodes, n).amin(-1)
    next_sibling = torch.where(parents < 0, n, next_sibling)
    none = torch.full_like(parents, -1)
    return SglangVerifyArrays(
        draft_tokens=torch.stack([t.tokens for t in padded]).reshape(-1),
        tree_mask=mask.reshape(-1),
        positions=(depths + seq_lens.to(device=device, dtype=torch.int64)[:, None]).reshape(-1),
        retrieve_index=torch.arange(bs * n, device=device).view(bs, n),
        retrieve_next_token=torch.where(first_child < n, first_child, none),
        retrieve_next_sibling=torch.where(next_sibling < n, next_sibling, none),
    )
