"""Draft-tree ops: `candidate_topk`, `expand_level`, `build_dartree`, `prune_tree` (+ its verify
layout, `TreeLayout`) and `verify_tree` (+ the sync-free `verify_tree_padded`).

The compiled ops take preallocated outputs and return nothing (CUDA-graph friendly); these wrappers
allocate the outputs. Values are computed in the compute dtype T: float64 for float64 inputs,
float32 otherwise. References: the functions of the same names in `dartree.reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import reference
from ._dispatch import _fake, _native


# Sizes beyond which the CUDA kernels hand over to the reference (one block selects at most
# _CUDA_MAX_SELECT entries; the verify walk keeps its tree in shared memory).
_CUDA_MAX_SELECT = 1024
_CUDA_MAX_VERIFY = 4000


def _too_big_for_cuda(device: torch.device, select: int = 0, nodes: int = 0) -> bool:
    return device.type == "cuda" and (select > _CUDA_MAX_SELECT or nodes > _CUDA_MAX_VERIFY)


def _opt(t, dtype=None):
    """None stays None; a tensor is cast to `dtype` (a no-op when it already is)."""
    if t is None:
        return None
    return t if dtype is None else t.to(dtype)


def _rows(t, dtype):
    """A matrix in `dtype` with unit stride along its last dim (rows may stay strided)."""
    if t is None:
        return None
    t = t.to(dtype)
    return t if t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1) else t.contiguous()


def candidate_topk(logits: torch.Tensor, num_candidates: int, with_lse: bool = True):
    """The C best tokens of every draft slot and each slot's log-normaliser.

    logits [k, V] float32/float64/float16/bfloat16; 1 <= C = num_candidates <= V.
    returns (values [k, C] T descending, ids [k, C] int64 (equal values: lower id first),
    lse [k] T = logsumexp of the whole row, or None when with_lse is False).

    >>> candidate_topk(torch.tensor([[0., 2., 1., 2.]]), 2)[1].tolist()
    [[1, 3]]
    """
    if (not _native(logits) or not isinstance(num_candidates, int)
            or _too_big_for_cuda(logits.device, select=num_candidates)):
        values, ids, lse = reference.candidate_topk(logits, num_candidates)
        return values, ids, (lse if with_lse else None)
    if logits.dim() == 2 and logits.is_floating_point() and not 1 <= num_candidates <= logits.shape[1]:
        raise ValueError(f"candidate_topk: num_candidates must be in [1, {logits.shape[1]}], "
                         f"got {num_candidates}")
    rows = logits.shape[0] if logits.dim() == 2 else 0
    dtype = reference.compute_dtype(logits.dtype)
    values = torch.empty(rows, num_candidates, dtype=dtype, device=logits.device)
    ids = torch.empty(rows, num_candidates, dtype=torch.int64, device=logits.device)
    lse = torch.empty(rows if with_lse else 0, dtype=dtype, device=logits.device)
    torch.ops.dartree.candidate_topk.default(logits.contiguous(), values, ids, lse)
    return values, ids, (lse if with_lse else None)


@_fake("candidate_topk")
def _candidate_topk_fake(logits, values, ids, lse):
    torch._check(logits.dim() == 2, lambda: "logits must be [k, V]")
    return None


def expand_level(parent_scores, parent_states, z, w_s, cand_w2, cand_b2, cand_base, cand_ids,
                 num_expand, num_select, input_table=None, w_hh=None, b_hh=None):
    """One DARTree level: score every (parent, candidate) pair, keep the best Q, step the GRU.

    Shapes and semantics: `dartree.reference.expand_level` (f parents, C candidates, rank r, GRU
    width G). Float inputs are cast to parent_scores' dtype (float32 or float64) except
    input_table [V, 3G], read in its own dtype. returns (parent_pos [Q] int64, tokens [Q] int64,
    scores [Q] T, states [Q, G] T or None without input_table).
    """
    tensors = [t for t in (parent_scores, parent_states, z, w_s, cand_w2, cand_b2, cand_base,
                           cand_ids, input_table, w_hh, b_hh) if t is not None]
    dtype = parent_scores.dtype
    if (not _native(*tensors) or dtype not in (torch.float32, torch.float64)
            or _too_big_for_cuda(parent_scores.device, select=num_select)):
        return reference.expand_level(parent_scores, parent_states, z, w_s, cand_w2, cand_b2,
                                      cand_base, cand_ids, num_expand, num_select, input_table,
                                      w_hh, b_hh)
    count = parent_scores.shape[0] if parent_scores.dim() == 1 else 0
    if count == 0:
        raise ValueError("expand_level: the frontier is empty (parent_scores has 0 entries)")
    width = cand_base.shape[0] if cand_base.dim() == 1 else 0
    if not 1 <= num_expand <= width:
        raise ValueError(f"expand_level: num_expand must be in [1, {width}], got {num_expand}")
    if not 1 <= num_select <= count * num_expand:
        raise ValueError(f"expand_level: num_select must be in [1, {count * num_expand}], got {num_select}")
    device = parent_scores.device
    corrected = z is not None
    states_in = None if parent_states is None else parent_states.to(dtype).contiguous()
    gru_width = states_in.shape[-1] if input_table is not None and states_in is not None else 0
    parent_pos = torch.empty(num_select, dtype=torch.int64, device=device)
    tokens = torch.empty(num_select, dtype=torch.int64, device=device)
    scores = torch.empty(num_select, dtype=dtype, device=device)
    states = torch.empty((num_select, gru_width) if input_table is not None else (0,), dtype=dtype,
                         device=device)
    torch.ops.dartree.expand_level.default(
        parent_scores.contiguous(), states_in,
        _opt(z, dtype).contiguous() if corrected else None,
        _rows(w_s, dtype) if corrected else None,
        _rows(cand_w2, dtype) if corrected else None,
        _opt(cand_b2, dtype).contiguous() if corrected and cand_b2 is not None else None,
        cand_base.to(dtype).contiguous(), cand_ids.contiguous(), num_expand,
        None if input_table is None else _rows(input_table, input_table.dtype),
        _rows(w_hh, dtype) if input_table is not None else None,
        _opt(b_hh, dtype).contiguous() if input_table is not None and b_hh is not None else None,
        parent_pos, tokens, scores, states)
    return parent_pos, tokens, scores, (states if input_table is not None else None)


@_fake("expand_level")
def _expand_level_fake(parent_scores, parent_states, z, w_s, cand_w2, cand_b2, cand_base,
                       cand_ids, num_expand, input_table, w_hh, b_hh, parent_pos, tokens,
                       scores, states):
    torch._check(parent_scores.dim() == 1, lambda: "parent_scores must be [f]")
    return None


def build_dartree(cand_values, cand_ids, root, root_state, z, w_s, w_2, b_2, input_table,
                  w_hh, b_hh, num_expand: int, plan: list[int], prefix_len: int, budget: int,
                  depth_bonus: float, check: bool = True):
    """The whole DARTree build of one round in one call (every level, then the pruning).

    Arguments and result: `dartree.reference.build_dartree`, which this equals (index outputs
    exactly, scores within the dtype's tolerance). w_2 may be the head's whole W_2 [V, r] (rows
    are read by candidate id inside the op: no gather) or the gathered rows [k, C, r]. Returns (tokens, parents, depths [N] int64,
    scores [N] T), N = 1 + min(budget, sum(plan)). On the CPU a malformed result (a kept node whose
    parent was pruned: impossible for depth_bonus <= 0) raises; on CUDA the kernel raises a flag
    that `check` reads (one host sync), or nobody reads when check is False.
    """
    tensors = [t for t in (cand_values, cand_ids, root, root_state, z, w_s, w_2, b_2,
                           input_table, w_hh, b_hh) if t is not None]
    dtype = cand_values.dtype
    plan = [int(count) for count in plan]
    widest = max(plan + [min(budget, sum(plan))]) if plan else 0
    if (not _native(*tensors) or dtype not in (torch.float32, torch.float64)
            or _too_big_for_cuda(cand_values.device, select=widest)):
        return reference.build_dartree(cand_values, cand_ids, root, root_state, z, w_s, w_2,
                                       b_2, input_table, w_hh, b_hh, num_expand, plan,
                                       prefix_len, budget, depth_bonus)
    if budget < 1:
        raise ValueError(f"build_dartree: budget must be >= 1, got {budget}")
    size = 1 + min(budget, sum(plan))
    device = cand_values.device
    tokens = torch.empty(size, dtype=torch.int64, device=device)
    parents = torch.empty(size, dtype=torch.int64, device=device)
    depths = torch.empty(size, dtype=torch.int64, device=device)
    scores = torch.empty(size, dtype=dtype, device=device)
    status = torch.empty(1, dtype=torch.int32, device=device)
    corrected, gru = z is not None, input_table is not None
    torch.ops.dartree.build_dartree.default(
        cand_values.contiguous(), cand_ids.contiguous(), root.reshape(1),
        None if root_state is None else root_state.to(dtype).contiguous(),
        z.to(dtype).contiguous() if corrected else None,
        _rows(w_s, dtype) if corrected else None,
        (_rows(w_2, dtype) if w_2.dim() == 2 else w_2.to(dtype).contiguous()) if corrected else None,
        b_2.to(dtype).contiguous() if corrected and b_2 is not None else None,
        _rows(input_table, input_table.dtype) if gru else None,
        _rows(w_hh, dtype) if gru else None,
        b_hh.to(dtype).contiguous() if gru and b_hh is not None else None,
        num_expand, plan, prefix_len, float(depth_bonus), tokens, parents, depths, scores, status)
    if check and device.type != "cpu":
        flag = int(status[0])
        if flag == 2:
            raise ValueError("build_dartree: a candidate id is outside the W_2 / input_table vocabulary")
        if flag != 0:
            raise ValueError("build_dartree: a kept node's parent was pruned; scores + depth_bonus * "
                             "depths must not increase from a parent to its child")
    return tokens, parents, depths, scores


@_fake("build_dartree")
def _build_dartree_fake(cand_values, cand_ids, root, root_state, z, w_s, w_2, b_2,
                        input_table, w_hh, b_hh, num_expand, plan, prefix_len, depth_bonus,
                        tokens, parents, depths, scores, status):
    torch._check(cand_values.dim() == 2, lambda: "cand_values must be [k, C]")
    return None


@dataclass
class TreeLayout:
    """A pruned tree and what the verify pass needs of it (all on the input's device).

    kept         int64 [N]  old indices of the kept nodes, ascending, kept[0] == 0
    parents      int64 [N]  indices into kept, parents[0] == -1
    depths       int64 [N]  verify position of node i = prefix length + depths[i]
    ancestors    int32 [N, ceil(N / 32)]  bit j % 32 of word j // 32 of row i: j is i or an ancestor
    first_child  int64 [N]  lowest-index child, -1 for a leaf
    next_sibling int64 [N]  next higher-index child of the same parent, -1 for the last
    status       int32 [1]  0; 1 when a kept node's parent was pruned (CUDA reports, CPU raises)
    """

    kept: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    status: torch.Tensor


def prune_tree(parents, depths, scores, budget, depth_bonus, check: bool = True):
    """Keep the root and the `budget` best nodes by score + depth_bonus * depth.

    Contract: `dartree.reference.prune_tree`; returns (kept [N'] int64, new_parents [N'] int64).
    check: on CUDA, read the op's status flag and raise like the reference (one host sync); with
    check=False an invalid tree shows only as -1 entries in new_parents[1:].
    """
    layout = prune_tree_layout(parents, depths, scores, budget, depth_bonus, check)
    return layout.kept, layout.parents


def prune_tree_layout(parents, depths, scores, budget: int, depth_bonus: float,
                      check: bool = True) -> TreeLayout:
    """`prune_tree` plus the verify layout of the kept tree, in one op (see `TreeLayout`).

    parents [M] int64 (parents[0] == -1, 0 <= parents[i] < i), depths [M] int64, scores [M] float.
    N = 1 + min(budget, M - 1). A kept node whose parent was pruned raises ValueError, on CUDA
    only when `check` (which reads the status flag: one host sync).
    """
    tensors = (parents, depths, scores)
    if budget < 1:
        raise ValueError(f"prune_tree: budget must be >= 1, got {budget}")
    total = parents.shape[0] if parents.dim() == 1 else 0
    if (not _native(*tensors) or scores.dtype not in (torch.float32, torch.float64)
            or _too_big_for_cuda(parents.device, select=min(budget, total))):
        kept, new_parents = reference.prune_tree(parents, depths, scores, budget, depth_bonus)
        ancestors, first_child, next_sibling = reference.tree_layout(new_parents)
        return TreeLayout(kept, new_parents, depths[kept], ancestors, first_child, next_sibling,
                          torch.zeros(1, dtype=torch.int32, device=parents.device))
    size = 1 + min(budget, max(total - 1, 0))
    device = parents.device
    out = TreeLayout(*(torch.empty(size, dtype=torch.int64, device=device) for _ in range(3)),
                     torch.empty(size, -(-size // 32), dtype=torch.int32, device=device),
                     torch.empty(size, dtype=torch.int64, device=device),
                     torch.empty(size, dtype=torch.int64, device=device),
                     torch.empty(1, dtype=torch.int32, device=device))
    torch.ops.dartree.prune_tree.default(
        parents.contiguous(), depths.contiguous(), scores.contiguous(), float(depth_bonus), out.kept,
        out.parents, out.depths, out.ancestors, out.first_child, out.next_sibling, out.status)
    if check and device.type != "cpu":
        status = int(out.status[0])
        if status == 2:
            raise ValueError("prune_tree: parents must satisfy parents[0] == -1 and "
                             "0 <= parents[i] < i (a parent index is out of range)")
        if status != 0:
            raise ValueError("prune_tree: a kept node's parent was pruned; scores + depth_bonus * "
                             "depths must not increase from a parent to its child")
    return out


@_fake("prune_tree")
def _prune_tree_fake(parents, depths, scores, depth_bonus, kept, new_parents, new_depths,
                     ancestors, first_child, next_sibling, status):
    torch._check(parents.dim() == 1, lambda: "parents must be [M]")
    return None


def verify_tree_padded(parents, tokens, target_tokens, first_child=None, next_sibling=None):
    """The verify walk without a host sync: fixed-size outputs.

    parents, tokens, target_tokens [T] int64; first_child / next_sibling [T] int64 from
    `prune_tree_layout` (built from parents when None). returns (accepted [T] int64: the path then
    -1, num_accepted [] int64, bonus [] int64). On CUDA a malformed tree gives num_accepted 0; on
    the CPU it raises ValueError.
    """
    tensors = [t for t in (parents, tokens, target_tokens, first_child, next_sibling) if t is not None]
    if not _native(*tensors) or _too_big_for_cuda(parents.device, nodes=parents.shape[0]):
        path, bonus = reference.verify_tree(parents, tokens, target_tokens)
        accepted = torch.full((parents.shape[0],), -1, dtype=torch.int64, device=parents.device)
        accepted[:path.shape[0]] = path
        return accepted, torch.tensor(path.shape[0], device=parents.device), bonus
    size = parents.shape[0] if parents.dim() == 1 else 0
    device = parents.device
    accepted = torch.empty(size, dtype=torch.int64, device=device)
    count = torch.empty((), dtype=torch.int64, device=device)
    bonus = torch.empty((), dtype=torch.int64, device=device)
    torch.ops.dartree.verify_tree.default(
        parents.contiguous(), tokens.contiguous(), target_tokens.contiguous(),
        None if first_child is None else first_child.contiguous(),
        None if next_sibling is None else next_sibling.contiguous(), accepted, count, bonus)
    return accepted, count, bonus


def verify_tree(parents, tokens, target_tokens, first_child=None, next_sibling=None):
    """The longest root path the target agrees with, and the bonus token.

    Contract: `dartree.reference.verify_tree`; returns (accepted [a] int64, bonus [] int64). The
    slice to length a reads the count (a host sync on CUDA); `verify_tree_padded` does not.

    >>> verify_tree(torch.tensor([-1, 0, 0]), torch.tensor([9, 4, 5]), torch.tensor([5, 0, 7]))
    (tensor([0, 2]), tensor(7))
    """
    accepted, count, bonus = verify_tree_padded(parents, tokens, target_tokens, first_child,
                                                next_sibling)
    size = int(count)
    if size == 0:
        raise ValueError("verify_tree: parents must have parents[0] == -1 and 0 <= parents[i] < i, "
                         "and first_child / next_sibling must list the children in index order")
    return accepted[:size], bonus


@_fake("verify_tree")
def _verify_tree_fake(parents, tokens, target_tokens, first_child, next_sibling, accepted,
                      num_accepted, bonus):
    torch._check(parents.dim() == 1, lambda: "parents must be [T]")
    return None
