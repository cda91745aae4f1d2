"""Draft trees: the data structure, and the builders that turn one drafter pass into a tree.

A `DraftTree` holds the root (the bonus token) at index 0 and the draft nodes after it, parents
before children. Builders take a `DraftBlock` (what the drafter produced for one round):

  build_chain     one node per slot: DFlash (argmax of the base logits) or Domino (corrected chain)
  build_ddtree    DDTree: the `budget` most likely prefixes under the product of slot marginals
  build_dartree   DARTree: a level-wise beam with the Domino correction batched over each level,
                  then (pruned variant) the `budget` best nodes by path score + depth bonus

`build_ddtree_reference` (the heapq algorithm of the DDTree paper) and `build_dartree_reference`
(a literal loop over levels, parents and candidates) are the oracles of the fast builders; the fast
builders go through `dartree.ops` (build_dartree: candidate_topk, then every level and the pruning in
one `ops.build_dartree` call).

Tie rules (shared by the fast builders, the references and the kernels behind `dartree.ops`):
  - candidates of a slot: base logit descending, equal logits by lower token id;
  - DDTree: score descending, equal scores by the lexicographic order of the rank tuples (the heap's
    order), which is also the order of the nodes in the tree;
  - DARTree level: score descending, equal scores by lower parent position then lower candidate
    position; pruning: key descending, equal keys by lower node index.
The public references order exact ties with `torch.topk`, whose order is unspecified (and differs
between devices); dartree's rule is fixed so that CPU, CUDA and reference paths agree.
"""

from __future__ import annotations

import heapq
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from . import ops, reference

# What the tree builders read from a Domino head (`dartree.drafter.DominoHead`), besides its
# methods `root_state(bonus) -> [1, G]`, `gru_step(tokens [n], g [n, G]) -> [n, G]` and
# `correction(z, g, cand) -> [n, C or V]`.
HEAD_ATTRIBUTES = ("input_table", "W_s", "W_2", "b_2", "W_hh", "b_hh")


class CorrectionHead(Protocol):
    """The part of a Domino head the builders use (G = GRU width, r = rank, V = vocabulary)."""

    input_table: torch.Tensor  # [V, 3G]  E·W_ihᵀ (+ b_ih)
    W_s: torch.Tensor  # [r, G]  state half of embed_proj.0
    W_2: torch.Tensor  # [V, r]  embed_proj.2.weight
    b_2: torch.Tensor | None  # [V]  embed_proj.2.bias
    W_hh: torch.Tensor  # [3G, G]  prefix_gru.weight_hh_l0
    b_hh: torch.Tensor | None  # [3G]  prefix_gru.bias_hh_l0

    def root_state(self, bonus: torch.Tensor) -> torch.Tensor: ...

    def gru_step(self, tokens: torch.Tensor, g: torch.Tensor) -> torch.Tensor: ...

    def correction(self, z: torch.Tensor, g: torch.Tensor, cand: torch.Tensor | None) -> torch.Tensor: ...


@dataclass
class DraftTree:
    """A draft tree whose row 0 is the root (bonus) token.

    tokens  int64 [T]  tokens[0] = root
    parents int64 [T]  parents[0] = -1, parents[i] < i
    depths  int64 [T]  depths[0] = 0, depths[i] = depths[parents[i]] + 1
    scores  float [T]  path log-score of each node (root 0.0)
    mask    bool [T, T] or None: `ancestor_mask()`, where the builder knew it on the host (a
            chain, a candidate tree: the pointer doubling's ops cost 0.1-0.2 ms a round on a CPU)
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    mask: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def num_nodes(self) -> int:
        """T: the number of rows, the root included."""
        return self.tokens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @classmethod
    def chain(cls, tokens: torch.Tensor, scores: torch.Tensor | None = None) -> DraftTree:
        """A chain root -> tokens[1] -> ... ; tokens [T] include the root, scores [T] (default 0)."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64)
        size = tokens.shape[0]
        steps = torch.arange(size, device=tokens.device)
        if scores is None:
            scores = torch.zeros(size, device=tokens.device)
        mask = torch.ones(size, size, dtype=torch.bool, device=tokens.device).tril_()
        return cls(tokens, steps - 1, steps, scores, mask)

    def ancestor_mask(self) -> torch.Tensor:
        """bool [T, T]: True where key j is node i itself or one of its ancestors.

        Pointer doubling: after k steps row i holds the ancestors within distance 2**(k+1) - 1, so
        ceil(log2 T) - 1 steps suffice. The step count comes from T alone: no host read of the
        depths (a sync on CUDA), and the same ops every round for a tree of the same size. A tree
        built with its `mask` returns that."""
        if self.mask is not None:
            return self.mask
        size = self.num_nodes
        eye = torch.eye(size, dtype=torch.bool, device=self.device)
        jump = self.parents  # ancestor at distance 1, 2, 4, ... (-1: none)
        mask = eye | (eye[jump.clamp_min(0)] & (jump >= 0)[:, None])  # distances 0..1
        for _ in range(max(math.ceil(math.log2(size)) - 1, 0) if size else 0):
            jump = torch.where(jump >= 0, jump[jump.clamp_min(0)], jump)
            mask = mask | (mask[jump.clamp_min(0)] & (jump >= 0)[:, None])
        return mask

    def paths(self) -> set[tuple[int, ...]]:
        """Every node's token path from the root (root excluded), for set comparisons."""
        tokens, parents = self.tokens.tolist(), self.parents.tolist()
        paths: list[tuple[int, ...]] = [()]
        for node in range(1, len(tokens)):
            paths.append(paths[parents[node]] + (tokens[node],))
        return set(paths[1:])

    def validate(self) -> None:
        """Raise ValueError unless the four tensors describe a well-formed tree."""
        size = self.num_nodes
        for name in ("tokens", "parents", "depths", "scores"):
            tensor = getattr(self, name)
            if tensor.dim() != 1 or tensor.shape[0] != size:
                raise ValueError(f"DraftTree.{name} must have shape [{size}], got {tuple(tensor.shape)}")
            if tensor.device != self.device:
                raise ValueError(f"DraftTree.{name} is on {tensor.device}, tokens on {self.device}")
        for name in ("tokens", "parents", "depths"):
            if getattr(self, name).dtype != torch.int64:
                raise ValueError(f"DraftTree.{name} must be int64, got {getattr(self, name).dtype}")
        if not self.scores.is_floating_point():
            raise ValueError(f"DraftTree.scores must be floating point, got {self.scores.dtype}")
        if size == 0:
            raise ValueError("DraftTree must hold at least the root")
        parents, depths = self.parents.tolist(), self.depths.tolist()
        if parents[0] != -1 or depths[0] != 0:
            raise ValueError(f"DraftTree root must have parent -1 and depth 0, got {parents[0]}, {depths[0]}")
        for node in range(1, size):
            if not 0 <= parents[node] < node:
                raise ValueError(f"DraftTree.parents[{node}] = {parents[node]} is not in [0, {node})")
            if depths[node] != depths[parents[node]] + 1:
                raise ValueError(f"DraftTree.depths[{node}] = {depths[node]} is not its parent's depth + 1")
        if self.mask is not None:
            derived = DraftTree(self.tokens, self.parents, self.depths, self.scores).ancestor_mask()
            if self.mask.shape != derived.shape or self.mask.dtype != torch.bool or \
                    self.mask.device != self.device or not torch.equal(self.mask, derived):
                raise ValueError("DraftTree.mask is not the ancestor mask of its parents")


@dataclass
class DraftBlock:
    """What the drafter gives the tree builder for one round.

    root        the bonus token b: an int, or a one-element int64 tensor (kept on its device, not
                range-checked, so that no host sync is needed)
    base_logits float [k, V]: ℓ_i, slot i predicts the token at depth i + 1
    head        Domino head (see `CorrectionHead`), or None for a plain DFlash drafter
    z           [k, r]: W_z h_i (+ b1) for every slot, or None when head is None
    prefix_len  P: slots i < P take no correction
    """

    root: int | torch.Tensor
    base_logits: torch.Tensor
    head: Any = None
    z: torch.Tensor | None = None
    prefix_len: int = 0

    @property
    def num_slots(self) -> int:
        return self.base_logits.shape[0]

    def validate(self) -> None:
        """Raise ValueError unless the block is usable by the builders."""
        logits = self.base_logits
        if logits.dim() != 2 or not logits.is_floating_point() or 0 in logits.shape:
            raise ValueError(f"base_logits must be a float [k, V] tensor with k, V >= 1, got "
                             f"{logits.dtype} {tuple(logits.shape)}")
        vocab = logits.shape[1]
        if isinstance(self.root, torch.Tensor):
            if self.root.numel() != 1 or self.root.dtype != torch.int64:
                raise ValueError(f"root must be an int or a one-element int64 tensor, got "
                                 f"{self.root.dtype} {tuple(self.root.shape)}")
        elif not 0 <= operator.index(self.root) < vocab:
            raise ValueError(f"root must be a token id in [0, {vocab}), got {self.root}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {self.prefix_len}")
        if self.head is None:
            return
        missing = [name for name in HEAD_ATTRIBUTES if not hasattr(self.head, name)]
        if missing:
            raise ValueError(f"head lacks the attributes {missing} that the tree builders need")
        rank = self.head.W_s.shape[0]
        if self.z is None or tuple(self.z.shape) != (logits.shape[0], rank):
            raise ValueError(f"z must be [{logits.shape[0]}, {rank}] with a head, got "
                             f"{None if self.z is None else tuple(self.z.shape)}")
        if self.head.W_2.shape[0] != vocab:
            raise ValueError(f"head vocabulary {self.head.W_2.shape[0]} != base_logits vocabulary {vocab}")

    def _root_tensor(self) -> torch.Tensor:
        """int64 [1] on the logits' device."""
        if isinstance(self.root, torch.Tensor):
            return self.root.reshape(1).to(self.base_logits.device)
        return torch.tensor([operator.index(self.root)], dtype=torch.int64, device=self.base_logits.device)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if operator.index(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


# ---------------------------------------------------------------------------------------------
# chains (DFlash, Domino)


@torch.no_grad()
def build_chain(block: DraftBlock, temperature: float = 0.0, generator: torch.Generator | None = None,
                corrected: bool = False, seed: int | None = None, position: int = 0) -> DraftTree:
    """A chain of k draft nodes, one per slot.

    corrected=False (DFlash): d_{i+1} = argmax ℓ_i at any temperature (ties: lowest token id).
    corrected=True (Domino, needs a head): slots i < P use ℓ_i, later slots ℓ_i + Δ_i(g) over the
    whole vocabulary with g = GRU over [b, d_1 .. d_i]; at temperature > 0 each token is drawn from
    softmax(logits / T) with `generator`, else argmax. With a seed instead, slot i's token is the
    position-keyed sample at `position` + i (`position` = the root's absolute position): the noise
    the target uses at the depth-i node, so a drafter close to the target proposes the target's
    own sample (coupled draws: higher acceptance, output unchanged).
    scores: cumulative log_softmax (untempered, full vocabulary) of the logits each token came from.
    """
    block.validate()
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = block.base_logits.to(reference.compute_dtype(block.base_logits.dtype))
    root = block._root_tensor()
    if not corrected:
        tokens = logits.argmax(dim=-1)
        steps = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    else:
        if block.head is None:
            raise ValueError("a corrected (Domino) chain needs a head, got head=None")
        head = block.head
        state = head.root_state(root)
        picked, step_scores = [], []
        for slot in range(block.num_slots):
            row = logits[slot]
            if slot >= block.prefix_len:
                row = row + head.correction(block.z[slot], state, None)[0].to(row.dtype)
            if temperature > 0 and seed is not None:
                key = torch.full((1,), position + slot, device=row.device)
                token = ops.sample_keyed(row[None], key, seed, temperature)
            elif temperature > 0:
                probs = torch.softmax(row / temperature, dim=-1)
                token = torch.multinomial(probs, 1, generator=generator)
            else:
                token = row.argmax().view(1)
            picked.append(token)
            step_scores.append(torch.log_softmax(row, dim=-1)[token])
            if slot + 1 < block.num_slots:
                state = head.gru_step(token, state)
        tokens, steps = torch.cat(picked), torch.cat(step_scores)
    scores = torch.cat([steps.new_zeros(1), steps.cumsum(0)])
    return DraftTree.chain(torch.cat([root, tokens]), scores)


# ---------------------------------------------------------------------------------------------
# DDTree


@torch.no_grad()
def build_ddtree(block: DraftBlock, budget: int) -> DraftTree:
    """DDTree: the `budget` most likely prefixes under Q(y) = Π_i softmax(ℓ_i)(y_i) (head unused).

    Exact and equal, node for node, to `build_ddtree_reference` (the heap): top-K tokens per slot
    with K = min(budget, V); at each depth keep the best `budget` children of the nodes kept at the
    previous depth (they hold every depth-d node of the answer, which is prefix-closed), then the
    best `budget` of all kept nodes. Nodes are in heap pop order: score descending, equal scores
    by the lexicographic order of their rank tuples. Fewer nodes when fewer prefixes exist.
    """
    block.validate()
    _check_positive(budget=budget)
    slots, vocab = block.base_logits.shape
    top = min(budget, vocab)
    values, ids, lse = ops.candidate_topk(block.base_logits, top)
    log_q = values - lse[:, None]  # [k, K]
    device = log_q.device

    # Per depth, nodes are kept in lexicographic order of their rank tuples, so that a flat index
    # parent_row * K + rank is the within-depth lexicographic key and a stable sort breaks ties.
    scores = [log_q[0]]
    ranks = [torch.arange(top, device=device)]
    rows = [torch.full((top,), -1, dtype=torch.int64, device=device)]  # parent row at depth d - 1
    for depth in range(2, slots + 1):
        flat = (scores[-1][:, None] + log_q[depth - 1]).reshape(-1)
        keep = min(budget, flat.shape[0])
        best = reference.stable_topk(flat, keep)
        best = torch.sort(best).values  # back to lexicographic order
        scores.append(flat[best])
        ranks.append(best % top)
        rows.append(torch.div(best, top, rounding_mode="floor"))

    # Global ids: root 0, then depth by depth. Rank tuples padded with 0 (rank r stored as r + 1)
    # sort lexicographically like Python tuples: a prefix before its extensions.
    sizes = [s.shape[0] for s in scores]
    starts = [1 + sum(sizes[:d]) for d in range(len(sizes))]
    total = sum(sizes)
    tuples = torch.zeros(total, slots, dtype=torch.int64, device=device)
    parent_ids = torch.empty(total, dtype=torch.int64, device=device)
    for d, (rank, row) in enumerate(zip(ranks, rows)):
        span = slice(starts[d] - 1, starts[d] - 1 + sizes[d])
        if d:
            tuples[span] = tuples[starts[d - 1] - 1 + row]
            parent_ids[span] = starts[d - 1] + row
        else:
            parent_ids[span] = 0
        tuples[span, d] = rank + 1
    all_scores = torch.cat(scores)
    order = torch.arange(total, device=device)
    for col in reversed(range(len(sizes))):
        order = order[torch.sort(tuples[order, col], stable=True).indices]
    order = order[torch.sort(all_scores[order], descending=True, stable=True).indices][:budget]

    depth_of = torch.cat([torch.full((n,), d + 1, dtype=torch.int64, device=device)
                          for d, n in enumerate(sizes)])
    node_depths = depth_of[order]
    node_tokens = ids[node_depths - 1, torch.cat(ranks)[order]]
    position = torch.full((total + 1,), -1, dtype=torch.int64, device=device)
    position[0] = 0
    position[order + 1] = torch.arange(1, order.shape[0] + 1, device=device)
    node_parents = position[parent_ids[order]]
    return DraftTree(
        tokens=torch.cat([block._root_tensor(), node_tokens]),
        parents=torch.cat([node_parents.new_full((1,), -1), node_parents]),
        depths=torch.cat([node_depths.new_zeros(1), node_depths]),
        scores=torch.cat([all_scores.new_zeros(1), all_scores[order]]),
    )


@torch.no_grad()
def build_ddtree_reference(block: DraftBlock, budget: int) -> DraftTree:
    """DDTree Algorithm 1, literally: best-first search with a heap over rank tuples.

    Heap entries are (-score, rank tuple); every pop emits a node and pushes its next sibling and its
    first child. A node's score is its parent's score + log q_d(rank), in the compute dtype.
    """
    block.validate()
    _check_positive(budget=budget)
    slots, vocab = block.base_logits.shape
    top = min(budget, vocab)
    values, ids, lse = ops.candidate_topk(block.base_logits, top)
    log_q = (values - lse[:, None]).cpu().numpy()
    token_ids = ids.cpu().tolist()
    zero = log_q.dtype.type(0)
    # (-score, ranks, parent node, depth, rank, score, parent score)
    heap = [(-log_q[0, 0], (0,), 0, 1, 0, log_q[0, 0], zero)]
    tokens, parents, depths, scores = [], [], [], []
    while heap and len(tokens) < budget:
        _, ranks, parent, depth, rank, score, parent_score = heapq.heappop(heap)
        tokens.append(token_ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        scores.append(score)
        node = len(tokens)
        if rank + 1 < top:
            sibling = parent_score + log_q[depth - 1, rank + 1]
            heapq.heappush(heap, (-sibling, ranks[:-1] + (rank + 1,), parent, depth, rank + 1,
                                  sibling, parent_score))
        if depth < slots:
            child = score + log_q[depth, 0]
            heapq.heappush(heap, (-child, ranks + (0,), node, depth + 1, 0, child, score))
    device = block.base_logits.device
    return DraftTree(
        tokens=torch.cat([block._root_tensor(), torch.tensor(tokens, dtype=torch.int64, device=device)]),
        parents=torch.tensor([-1] + parents, dtype=torch.int64, device=device),
        depths=torch.tensor([0] + depths, dtype=torch.int64, device=device),
        scores=torch.from_numpy(np.array([zero] + scores, dtype=log_q.dtype)).to(device),
    )


# ---------------------------------------------------------------------------------------------
# DARTree


def dartree_sizes(vocab: int, candidates: int, expansion_k: int, budget: int) -> tuple[int, int]:
    """(C, E): candidates per slot C = min(V, max(candidates, expansion_k)); candidates a parent may
    expand E = min(expansion_k, V, budget) — as in the DARTree reference's CUDA-graph path: each
    parent expands its first E candidates in base order, and uncorrected (i < P) levels are
    renormalised over the C candidates. Its eager CPU fallback differs only when E < C (it takes the
    top E by corrected logit) or P >= 2 (full-vocabulary normalisation on prefix levels)."""
    return min(vocab, max(candidates, expansion_k)), min(expansion_k, vocab, budget)


def dartree_schedule(slots: int, num_expand: int, width: int, budget: int, fixed: bool) -> list[int]:
    """Nodes selected at each depth (the frontier of depth d + 1 is entry d).

    pruned: min(width, E) at every one of the k depths (a supertree of k * min(width, E) nodes);
    fixed:  with `remaining` = budget minus the nodes placed so far,
            min(max(1, min(remaining, ceil(remaining / (k - d + 1)))), frontier * E) at depth d,
            stopping once the budget is used.
    Depends only on sizes, so a caller can plan buffers (or CUDA graphs) before the round.
    """
    if not fixed:
        return [max(1, min(width, num_expand))] * slots
    plan, used, frontier = [], 0, 1
    for depth in range(1, slots + 1):
        if used >= budget:
            break
        remaining = budget - used
        quota = max(1, min(remaining, -(-remaining // (slots - depth + 1))))
        count = min(quota, frontier * num_expand)
        plan.append(count)
        used, frontier = used + count, count
    return plan


def _standard_root_state(head) -> bool:
    """True when head.root_state is DominoHead's: one GRU step from 0 through input_table."""
    from .drafter import DominoHead

    return getattr(type(head), "root_state", None) is DominoHead.root_state


def _check_dartree_args(block, width, candidates, budget, depth_bonus, fixed, expansion_k) -> int:
    block.validate()
    expansion_k = candidates if expansion_k is None else expansion_k
    _check_positive(width=width, candidates=candidates, budget=budget, expansion_k=expansion_k)
    if not fixed and depth_bonus > 0:
        raise ValueError(f"depth_bonus must be <= 0 for the pruned tree, got {depth_bonus}")
    return expansion_k


@torch.no_grad()
def build_dartree(block: DraftBlock, width: int = 12, candidates: int = 64, budget: int = 64,
                  depth_bonus: float = -0.2, fixed: bool = False,
                  expansion_k: int | None = None) -> DraftTree:
    """DARTree: a level-wise beam over corrected candidates, then (pruned) the best `budget` nodes.

    Per round: C candidates per slot from the base logits (`dartree_sizes`); the root's GRU state
    g = GRU(b, 0). For depth d = 1..k (slot i = d - 1) every frontier parent p scores its first E
    candidates with lp = log_softmax over the C candidates of ℓ_i + Δ_i(g_p) (Δ = 0 for slots i < P
    or without a head), S = S_p + lp; the best Q pairs (`dartree_schedule`) become the next
    frontier and take a GRU step. Pruned (fixed=False): when the supertree exceeds `budget`, keep
    the `budget` nodes with the largest S + depth_bonus * depth in their original order; fixed:
    the per-level quotas already sum to at most `budget` and depth_bonus is unused.
    scores: the path scores S (without the depth bonus). Node order: depth by depth, within a depth
    by score descending (ties: lower parent position, then lower candidate position).
    """
    expansion_k = _check_dartree_args(block, width, candidates, budget, depth_bonus, fixed, expansion_k)
    slots, vocab = block.base_logits.shape
    num_cand, num_expand = dartree_sizes(vocab, candidates, expansion_k, budget)
    plan = dartree_schedule(slots, num_expand, width, budget, fixed)
    values, ids, _ = ops.candidate_topk(block.base_logits, num_cand, with_lse=False)
    dtype = values.dtype
    root = block._root_tensor()
    head = block.head
    correction, gru, root_state = (None,) * 4, (None,) * 3, None
    if head is not None and block.prefix_len < len(plan):  # some level is corrected
        # the Domino head's own root state is GRU(input_table[b], 0): the op computes it (a dozen
        # small torch ops less per round); any other head's root_state is called
        root_state = None if _standard_root_state(head) else head.root_state(root).to(dtype)
        # W_2 / b_2 are read by candidate id inside the op; a head in another dtype is gathered
        # first so that only the k * C rows get converted
        w_2, b_2 = head.W_2, head.b_2
        if w_2.dtype != dtype:
            w_2, b_2 = w_2[ids].to(dtype), None if b_2 is None else b_2[ids].to(dtype)
        correction = (block.z.to(dtype), head.W_s, w_2, b_2)
        gru = (head.input_table, head.W_hh, head.b_hh)  # no step after the last level
    # one call for every level and the pruning (fixed: the quotas already fit the budget)
    tokens, parents, depths, scores = ops.build_dartree(
        values, ids, root, root_state, *correction, *gru, num_expand, plan, block.prefix_len,
        budget, depth_bonus, check=False)
    return DraftTree(tokens, parents, depths, scores)


@torch.no_grad()
def build_dartree_reference(block: DraftBlock, width: int = 12, candidates: int = 64, budget: int = 64,
                            depth_bonus: float = -0.2, fixed: bool = False,
                            expansion_k: int | None = None) -> DraftTree:
    """`build_dartree`, literally: Python loops over levels, parents and candidates.

    Uses the head's own `root_state`, `gru_step` and `correction` (not the fused op), and sorts
    plain Python lists. Same tie rules and node order as `build_dartree`.
    """
    expansion_k = _check_dartree_args(block, width, candidates, budget, depth_bonus, fixed, expansion_k)
    slots, vocab = block.base_logits.shape
    num_cand = min(vocab, max(candidates, expansion_k))
    num_expand = min(expansion_k, vocab, budget)
    logits = block.base_logits.to(reference.compute_dtype(block.base_logits.dtype))
    dtype, device = logits.dtype, logits.device
    cand_ids, cand_base = [], []
    for slot in range(slots):
        row = logits[slot].tolist()
        order = sorted(range(vocab), key=lambda t: (-row[t], t))[:num_cand]
        cand_ids.append(torch.tensor(order, dtype=torch.int64, device=device))
        cand_base.append(logits[slot, cand_ids[-1]])

    head = block.head
    root_state = None if head is None else head.root_state(block._root_tensor())[0]
    # node: (token, parent, depth, score (0-dim tensor), GRU state)
    nodes = [(int(block._root_tensor()), -1, 0, torch.zeros((), dtype=dtype, device=device), root_state)]
    level_width = max(1, min(width, num_expand))
    supertree = slots * level_width if not fixed else budget
    frontier, placed = [0], 0
    for depth in range(1, slots + 1):
        if not frontier or placed >= supertree:
            break
        slot, remaining = depth - 1, supertree - placed
        quota = level_width if not fixed else -(-remaining // max(1, slots - depth + 1))
        quota = min(max(1, min(remaining, quota)), len(frontier) * num_expand)
        pairs = []
        for position, parent in enumerate(frontier):
            _, _, _, parent_score, parent_state = nodes[parent]
            row = cand_base[slot]
            if head is not None and slot >= block.prefix_len:
                delta = head.correction(block.z[slot], parent_state[None], cand_ids[slot])[0]
                row = row + delta.to(dtype)
            log_z = torch.logsumexp(row, dim=0)
            for j in range(num_expand):
                pairs.append((parent_score + (row[j] - log_z), position, j, parent))
        pairs.sort(key=lambda pair: (-float(pair[0]), pair[1], pair[2]))
        frontier = []
        for score, _, j, parent in pairs[:quota]:
            token = int(cand_ids[slot][j])
            state = None
            if head is not None:
                state = head.gru_step(cand_ids[slot][j].view(1), nodes[parent][4][None])[0]
            nodes.append((token, parent, depth, score, state))
            frontier.append(len(nodes) - 1)
        placed += quota

    keep = list(range(len(nodes)))
    if not fixed and placed > budget:
        bonus = torch.tensor(depth_bonus, dtype=dtype, device=device)

        def key(node: int) -> tuple[float, int]:
            score, depth = nodes[node][3], nodes[node][2]
            return -float(score + bonus * torch.tensor(float(depth), dtype=dtype, device=device)), node

        keep = [0] + sorted(sorted(range(1, len(nodes)), key=key)[:budget])
    new_index = {old: new for new, old in enumerate(keep)}
    return DraftTree(
        tokens=torch.tensor([nodes[i][0] for i in keep], dtype=torch.int64, device=device),
        parents=torch.tensor([-1] + [new_index[nodes[i][1]] for i in keep[1:]], dtype=torch.int64,
                             device=device),
        depths=torch.tensor([nodes[i][2] for i in keep], dtype=torch.int64, device=device),
        scores=torch.stack([nodes[i][3] for i in keep]),
    )
