"""dartree's custom ops: thin wrappers over torch.ops.dartree.* with fake kernels.

Each public function here has a plain-PyTorch twin in `dartree.reference` (the oracle for tests).
When the compiled extension `dartree._C` is missing, or `use_reference(True)` is in force, the
wrappers run the reference instead, so the package works from a source tree without a build.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
import logging

import numpy as np
import torch

from . import reference

log = logging.getLogger(__name__)

try:
    from . import _C  # noqa: F401  (registers torch.ops.dartree.*)

    HAS_EXTENSION = True
except ImportError as exc:  # a source tree without `pip install`
    HAS_EXTENSION = False
    log.info("dartree._C not built (%s): using the PyTorch reference ops", exc)

# The CUDA kernels are compiled in when torch is a CUDA build and nvcc was found at build time.
HAS_CUDA_KERNELS = HAS_EXTENSION and torch._C._dispatch_has_kernel_for_dispatch_key(
    "dartree::kv_commit", "CUDA")

_force_reference = False


def use_reference(enabled: bool = True) -> None:
    """Route every op to its plain-PyTorch reference (True) or to the compiled kernels (False)."""
    global _force_reference
    _force_reference = bool(enabled)


@contextlib.contextmanager
def reference_ops(enabled: bool = True):
    """Context manager form of `use_reference`."""
    previous = _force_reference
    use_reference(enabled)
    try:
        yield
    finally:
        use_reference(previous)


def _native(*tensors: torch.Tensor) -> bool:
    """True when the compiled kernels should run for these inputs."""
    if _force_reference or not HAS_EXTENSION:
        return False
    return all(t.device.type in ("cpu", "cuda") for t in tensors)


# ---------------------------------------------------------------------------------------------
# kv_commit


def kv_commit(kv: torch.Tensor, prefix_len: int, accepted: torch.Tensor, check: bool = True) -> None:
    """Keep only the accepted branch of a verified tree in a static KV cache, in place.

    kv:        [..., S, D] contiguous (e.g. the whole cache [L, 2, B, Hkv, S, D]): one launch moves
               the rows of every layer, K and V.
    accepted:  int64 [A] tree indices of the accepted path, strictly increasing, accepted[0] == 0.
    Effect:    kv[..., prefix_len + j, :] = kv[..., prefix_len + accepted[j], :] for j < A.
    check:     validate the index values too (reads them on the host: one sync on a GPU). The
               engine passes False for indices produced by `verify_tree`.

    >>> kv = torch.arange(8.).reshape(1, 4, 2)
    >>> kv_commit(kv, 1, torch.tensor([0, 2]))
    >>> kv[0, :3].tolist()
    [[0.0, 1.0], [2.0, 3.0], [6.0, 7.0]]
    """
    native = _native(kv, accepted)
    if not native or (check and kv.device.type != "cpu"):  # the CPU kernel checks values itself
        _check_kv_commit(kv, prefix_len, accepted, values=check)
    if native:
        torch.ops.dartree.kv_commit.default(kv, prefix_len, accepted)
    else:
        reference.kv_commit(kv, prefix_len, accepted)


def _check_kv_commit(kv, prefix_len, accepted, values):
    if kv.dim() < 2 or not kv.is_contiguous():
        raise ValueError(f"kv_commit: kv must be a contiguous [..., S, D] tensor, got {tuple(kv.shape)}")
    if accepted.dim() != 1 or accepted.dtype != torch.int64 or accepted.numel() == 0:
        raise ValueError("kv_commit: accepted must be a non-empty 1-D int64 tensor, got "
                         f"{accepted.dtype} {tuple(accepted.shape)}")
    if accepted.device != kv.device:
        raise ValueError(f"kv_commit: accepted is on {accepted.device} but kv is on {kv.device}")
    seq = kv.shape[-2]
    if prefix_len < 0 or prefix_len + accepted.numel() > seq:
        raise ValueError(f"kv_commit: prefix_len {prefix_len} + {accepted.numel()} accepted rows "
                         f"exceeds the cache length {seq}")
    if not values:
        return
    idx = accepted.tolist()
    if idx[0] != 0:
        raise ValueError(f"kv_commit: accepted[0] must be 0 (the root), got {idx[0]}")
    if any(b <= a for a, b in zip(idx, idx[1:])):
        raise ValueError(f"kv_commit: accepted must be strictly increasing, got {idx}")
    if prefix_len + idx[-1] >= seq:
        raise ValueError(f"kv_commit: accepted index {idx[-1]} at prefix_len {prefix_len} is "
                         f"outside the cache length {seq}")


# ---------------------------------------------------------------------------------------------
# write_rows


def write_rows(cache: torch.Tensor, layer: int, start: int, key: torch.Tensor,
               value: torch.Tensor) -> None:
    """cache[layer, 0 | 1, ..., start:start + T, :] = key | value, in place (rows along dim -2).

    cache: [L, 2, ..., S, D], a whole static KV cache; key, value: [..., T, D] matching
    cache[layer, 0]'s leading dims (or broadcast to them). Eager, two slice copies; inside a graph
    being compiled, one mutating op (`dartree::write_rows`) on the whole cache: there a slice write
    is functionalised into a copy of the whole cache per layer (bench/results/compile.md: 460 vs
    2.5 ms per verify of a two-layer model with 65,536 cache rows), and the op's mutation of a
    view (cache[layer]) does not reach the cache, while the whole cache's is written in place."""
    (_write_rows if torch.compiler.is_compiling() else _copy_rows)(cache, layer, start, key, value)


def _copy_rows(cache, layer, start, key, value):
    size = key.shape[-2]
    cache[layer, 0].narrow(-2, start, size).copy_(key)
    cache[layer, 1].narrow(-2, start, size).copy_(value)


@torch.library.custom_op("dartree::write_rows", mutates_args=("cache",))
def _write_rows(cache: torch.Tensor, layer: int, start: int, key: torch.Tensor,
                value: torch.Tensor) -> None:
    _copy_rows(cache, layer, start, key, value)


# ---------------------------------------------------------------------------------------------
# tree_attention

# Head dims and dtypes the CUDA kernel is built for; other CUDA inputs run the reference.
_CUDA_TREE_ATTENTION_DIMS = (64, 128)
_CUDA_TREE_ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HAS_CUDA_TREE_ATTENTION = HAS_EXTENSION and torch._C._dispatch_has_kernel_for_dispatch_key(
    "dartree::tree_attention", "CUDA")


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree_mask: torch.Tensor,
                   prefix_len: int, scale: float | None = None) -> torch.Tensor:
    """Attention of T draft-tree queries over a static KV cache (the target's verify pass).

    q:          [B, Hq, T, D] float32, float64 (CPU), float16 or bfloat16; any strides
    k, v:       [B, Hkv, S, D] in q's dtype, e.g. one layer of the whole static cache; rows
                [0, prefix_len) are the committed prefix, [prefix_len, prefix_len + T) the tree's own
                keys; rows after are never read (they may hold anything). Hq % Hkv == 0.
    tree_mask:  bool [B, T, T], True where key j is query i itself or one of its ancestors
    prefix_len: P, 0 <= P and P + T <= S
    scale:      softmax scale, default D ** -0.5
    returns     a new contiguous [B, Hq, T, D] in q's dtype: query i attends to every prefix key and
                to the tree keys of row i of tree_mask. A query that sees no key at all gets zeros.

    The CPU kernel covers every case; the CUDA kernel covers D in (64, 128) and 16/32-bit floats,
    other CUDA inputs run `dartree.reference.tree_attention`.

    >>> q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    >>> chain = torch.ones(3, 3, dtype=torch.bool).tril()[None]
    >>> tree_attention(q, k, v, chain, prefix_len=5).shape
    torch.Size([1, 4, 3, 8])
    """
    if _native(q, k, v, tree_mask) and _tree_attention_kernel_covers(q, k, v, tree_mask):
        return torch.ops.dartree.tree_attention.default(q, k, v, tree_mask, prefix_len, scale)
    _check_tree_attention(q, k, v, tree_mask, prefix_len)
    return reference.tree_attention(q, k, v, tree_mask, prefix_len, scale)


def _tree_attention_kernel_covers(q, k, v, tree_mask):
    """Whether the compiled kernel takes these inputs (its own checks then name any problem)."""
    device = q.device
    if k.device != device or v.device != device or tree_mask.device != device:
        return False  # mixed devices: the Python check below names them
    if device.type == "cpu":
        return True
    return (HAS_CUDA_TREE_ATTENTION and q.dtype in _CUDA_TREE_ATTENTION_DTYPES
            and q.dim() == 4 and q.shape[-1] in _CUDA_TREE_ATTENTION_DIMS)


def _check_tree_attention(q, k, v, tree_mask, prefix_len):
    """The C++ checks (csrc/checks.h::check_tree_attention) for the reference path."""
    if q.dim() != 4:
        raise ValueError(f"tree_attention: q must be [B, Hq, T, D], got {tuple(q.shape)}")
    if k.dim() != 4:
        raise ValueError(f"tree_attention: k must be [B, Hkv, S, D], got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"tree_attention: v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if q.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise ValueError(f"tree_attention: q must be float32, float64, float16 or bfloat16, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"tree_attention: k and v must have q's dtype {q.dtype}, got {k.dtype} "
                         f"and {v.dtype}")
    for name, tensor in (("k", k), ("v", v), ("tree_mask", tree_mask)):
        if tensor.device != q.device:
            raise ValueError(f"tree_attention: {name} is on {tensor.device} but q is on {q.device}")
    batch, heads, size, dim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"tree_attention: k has batch {k.shape[0]}, q has {batch}")
    if k.shape[3] != dim:
        raise ValueError(f"tree_attention: k has head dim {k.shape[3]}, q has {dim}")
    if dim < 1:
        raise ValueError(f"tree_attention: head dim must be >= 1, got {dim}")
    if k.shape[1] < 1 or heads % k.shape[1]:
        raise ValueError(f"tree_attention: Hq {heads} is not a multiple of Hkv {k.shape[1]}")
    if tree_mask.dtype != torch.bool:
        raise ValueError(f"tree_attention: tree_mask must be bool, got {tree_mask.dtype}")
    if tree_mask.shape != (batch, size, size):
        raise ValueError(f"tree_attention: tree_mask must be [{batch}, {size}, {size}], got "
                         f"{tuple(tree_mask.shape)}")
    if prefix_len < 0 or prefix_len + size > k.shape[2]:
        raise ValueError(f"tree_attention: prefix_len {prefix_len} + T {size} exceeds the key length "
                         f"{k.shape[2]}")


if HAS_EXTENSION:

    @torch.library.register_fake("dartree::kv_commit")
    def _kv_commit_fake(kv, prefix_len, accepted):
        torch._check(accepted.dim() == 1, lambda: "accepted must be 1-D")
        return None

    @torch.library.register_fake("dartree::tree_attention")
    def _tree_attention_fake(q, k, v, tree_mask, prefix_len, scale=None):
        torch._check(q.dim() == 4, lambda: f"tree_attention: q must be [B, Hq, T, D], got {q.shape}")
        torch._check(k.dim() == 4 and v.shape == k.shape,
                     lambda: f"tree_attention: k and v must be [B, Hkv, S, D], got {k.shape}, {v.shape}")
        torch._check(q.shape[1] % k.shape[1] == 0, lambda: "tree_attention: Hq must be a multiple of Hkv")
        return q.new_empty(q.shape)


# ---------------------------------------------------------------------------------------------
# draft-tree ops: candidate_topk, expand_level, build_dartree, prune_tree (+ layout), verify_tree
#
# The compiled ops take preallocated outputs and return nothing (CUDA-graph friendly); these
# wrappers allocate the outputs. Values are computed in the compute dtype T: float64 for float64
# inputs, float32 otherwise.


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


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
    dtype = _compute_dtype(logits.dtype)
    values = torch.empty(rows, num_candidates, dtype=dtype, device=logits.device)
    ids = torch.empty(rows, num_candidates, dtype=torch.int64, device=logits.device)
    lse = torch.empty(rows if with_lse else 0, dtype=dtype, device=logits.device)
    torch.ops.dartree.candidate_topk.default(logits.contiguous(), values, ids, lse)
    return values, ids, (lse if with_lse else None)


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


if HAS_EXTENSION:

    @torch.library.register_fake("dartree::candidate_topk")
    def _candidate_topk_fake(logits, values, ids, lse):
        torch._check(logits.dim() == 2, lambda: "logits must be [k, V]")
        return None

    @torch.library.register_fake("dartree::expand_level")
    def _expand_level_fake(parent_scores, parent_states, z, w_s, cand_w2, cand_b2, cand_base,
                           cand_ids, num_expand, input_table, w_hh, b_hh, parent_pos, tokens,
                           scores, states):
        torch._check(parent_scores.dim() == 1, lambda: "parent_scores must be [f]")
        return None

    @torch.library.register_fake("dartree::build_dartree")
    def _build_dartree_fake(cand_values, cand_ids, root, root_state, z, w_s, w_2, b_2,
                            input_table, w_hh, b_hh, num_expand, plan, prefix_len, depth_bonus,
                            tokens, parents, depths, scores, status):
        torch._check(cand_values.dim() == 2, lambda: "cand_values must be [k, C]")
        return None

    @torch.library.register_fake("dartree::prune_tree")
    def _prune_tree_fake(parents, depths, scores, depth_bonus, kept, new_parents, new_depths,
                         ancestors, first_child, next_sibling, status):
        torch._check(parents.dim() == 1, lambda: "parents must be [M]")
        return None

    @torch.library.register_fake("dartree::verify_tree")
    def _verify_tree_fake(parents, tokens, target_tokens, first_child, next_sibling, accepted,
                          num_accepted, bonus):
        torch._check(parents.dim() == 1, lambda: "parents must be [T]")
        return None


# ---------------------------------------------------------------------------------------------
# batch-invariant ("exact") ops: exact_linear, exact_tree_attention
#
# Every output row is a function of that row's inputs alone, bitwise: row i of a batch equals the
# row computed alone, and a tree row equals the same query decoded one token at a time. The
# plain-PyTorch fallbacks (no extension, or a device without a kernel) give the same values within
# rounding but not that guarantee; `dartree.exact()` refuses to run on them.

HAS_CUDA_EXACT_LINEAR = HAS_EXTENSION and torch._C._dispatch_has_kernel_for_dispatch_key(
    "dartree::exact_linear", "CUDA")
_EXACT_LINEAR_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A linear layer whose rows do not depend on the batch: x @ weight.T + bias.

    x:      [M, K] float32, float64, float16 or bfloat16; any strides
    weight: [N, K] in x's dtype (nn.Linear's layout)
    bias:   [N] in x's dtype, or None
    returns [M, N] in x's dtype, accumulated in float32 (float64 for float64). Each element's
            reduction order is fixed by K alone, so row m has the same bits for every M and every
            batch around it (CPU: AVX512-BF16 / AVX-512 / AVX2 / portable, chosen once per
            machine; CUDA: no split of K).

    >>> x, w = torch.randn(5, 7), torch.randn(3, 7)
    >>> torch.equal(exact_linear(x, w)[2:3], exact_linear(x[2:3], w))
    True
    """
    if _native(x, weight, *(() if bias is None else (bias,))) and _exact_linear_kernel_covers(x, weight):
        return torch.ops.dartree.exact_linear.default(x, weight, bias)
    _check_exact_linear(x, weight, bias)
    return reference.exact_linear(x, weight, bias)


def exact_kernels_available(device: torch.device) -> bool:
    """Whether both exact ops have compiled kernels on this device type."""
    device = torch.device(device)
    if _force_reference or not HAS_EXTENSION:
        return False
    return device.type == "cpu" or (device.type == "cuda" and HAS_CUDA_EXACT_LINEAR
                                    and HAS_CUDA_EXACT_TREE_ATTENTION)


def _exact_linear_kernel_covers(x, weight):
    if weight.device != x.device:
        return False
    return x.device.type == "cpu" or (HAS_CUDA_EXACT_LINEAR and x.dtype != torch.float64)


def _check_exact_linear(x, weight, bias):
    """The C++ checks (csrc/exact_checks.h) for the reference path."""
    if x.dim() != 2:
        raise ValueError(f"exact_linear: x must be [M, K], got {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"exact_linear: weight must be [N, K], got {tuple(weight.shape)}")
    if x.dtype not in _EXACT_LINEAR_DTYPES:
        raise ValueError(f"exact_linear: x must be float32, float64, float16 or bfloat16, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise ValueError(f"exact_linear: weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"exact_linear: weight is on {weight.device} but x is on {x.device}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"exact_linear: x has K = {x.shape[1]} but weight is {tuple(weight.shape)} ([N, K])")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"exact_linear: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise ValueError(f"exact_linear: bias must have x's dtype {x.dtype}, got {bias.dtype}")
        if bias.device != x.device:
            raise ValueError(f"exact_linear: bias is on {bias.device} but x is on {x.device}")


HAS_CUDA_EXACT_TREE_ATTENTION = HAS_EXTENSION and torch._C._dispatch_has_kernel_for_dispatch_key(
    "dartree::exact_tree_attention", "CUDA")


def exact_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree_mask: torch.Tensor,
                         prefix_len: int, scale: float | None = None) -> torch.Tensor:
    """`tree_attention` (same arguments, same result within rounding) whose rows depend only on
    their logical key list: the prefix keys, then the row's ancestors and itself in index order.

    A tree row therefore equals, bitwise, the same query run as a chain of one-token steps
    (T = 1, prefix_len = its position), for any T, prefix length, tree around it or thread count.
    A causal prefill is the chain mask with prefix_len = S - T.

    >>> q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    >>> chain = torch.ones(3, 3, dtype=torch.bool).tril()[None]
    >>> alone = exact_tree_attention(q[:, :, 2:], k, v, chain[:, 2:, 2:], prefix_len=7)
    >>> torch.equal(exact_tree_attention(q, k, v, chain, prefix_len=5)[:, :, 2:], alone)
    True
    """
    on_device = k.device == q.device and v.device == q.device and tree_mask.device == q.device
    covered = q.device.type == "cpu" or (HAS_CUDA_EXACT_TREE_ATTENTION and q.dtype != torch.float64)
    if _native(q, k, v, tree_mask) and on_device and covered:
        return torch.ops.dartree.exact_tree_attention.default(q, k, v, tree_mask, prefix_len, scale)
    _check_tree_attention(q, k, v, tree_mask, prefix_len)
    return reference.exact_tree_attention(q, k, v, tree_mask, prefix_len, scale)

# sample_keyed

_LOGIT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def sample_keyed(logits: torch.Tensor, positions: torch.Tensor, seed: int,
                 temperature: float) -> torch.Tensor:
    """Position-keyed sampling: one token per row of logits, by Gumbel-max with keyed noise.

    logits:      [T, V] float32, float64, float16 or bfloat16 (read as float32)
    positions:   int64 [T]: row t is the logits of the token at absolute position positions[t]
                 (it predicts the token after it); any int64 is a valid key
    seed:        int in [0, 2^64)
    temperature: 0 means argmax (ties: lowest id); > 0 samples softmax(logits / temperature)
    returns      int64 [T]: argmax_v fl(fl(logits[t, v] * float32(1 / T)) + g(seed, positions[t], v)),
                 g Gumbel noise from a counter-based hash (`reference.keyed_gumbel`), computed on
                 the fly. Ties: lowest id; a NaN logit wins.

    Row t's token depends only on (logits[t], seed, positions[t], temperature): the same on the
    CPU, CUDA and the reference, bit for bit, whatever else is in the batch. So a verify row at
    position p samples exactly what a one-token step at p samples with that seed.

    >>> logits = torch.zeros(2, 5)
    >>> a = sample_keyed(logits, torch.tensor([7, 8]), seed=1, temperature=1.0)
    >>> b = sample_keyed(logits[1:], torch.tensor([8]), seed=1, temperature=1.0)
    >>> bool(a[1] == b[0])
    True
    """
    _check_sample_keyed(logits, positions, seed, temperature)
    signed_seed = seed - (1 << 64) if seed >= 1 << 63 else seed
    if not _native(logits, positions):
        return reference.sample_keyed(logits, positions, seed, float(temperature))
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    torch.ops.dartree.sample_keyed.default(logits.contiguous(), positions.contiguous(), signed_seed,
                                           float(temperature), tokens)
    return tokens


def _check_sample_keyed(logits, positions, seed, temperature):
    """The C++ checks (csrc/sample_checks.h) plus the seed's range, before either path."""
    if logits.dim() != 2 or logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"sample_keyed: logits must be a float32/float64/float16/bfloat16 [T, V] "
                         f"tensor, got {logits.dtype} {tuple(logits.shape)}")
    if logits.shape[1] < 1:
        raise ValueError("sample_keyed: logits must have at least one token (V >= 1)")
    if (positions.dim() != 1 or positions.dtype != torch.int64
            or positions.shape[0] != logits.shape[0]):
        raise ValueError(f"sample_keyed: positions must be int64 [{logits.shape[0]}] (one per "
                         f"logits row), got {positions.dtype} {tuple(positions.shape)}")
    if positions.device != logits.device:
        raise ValueError(f"sample_keyed: positions is on {positions.device} but logits is on "
                         f"{logits.device}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ValueError(f"sample_keyed: seed must be an int in [0, 2**64), got {seed!r}")
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature) or temperature < 0):
        raise ValueError(f"sample_keyed: temperature must be a finite number >= 0, got {temperature!r}")
    if temperature > 0:
        with np.errstate(over="ignore", under="ignore"):  # the kernels' float32 1 / temperature
            inv = float(np.float32(1.0 / temperature))
        if not math.isfinite(inv) or inv < torch.finfo(torch.float32).tiny:
            raise ValueError(f"sample_keyed: temperature {temperature} is out of range: "
                             "1 / temperature must be a normal float32")


if HAS_EXTENSION:

    @torch.library.register_fake("dartree::exact_linear")
    def _exact_linear_fake(x, weight, bias=None):
        torch._check(x.dim() == 2 and weight.dim() == 2, lambda: "exact_linear: x [M, K], weight [N, K]")
        torch._check(x.shape[1] == weight.shape[1], lambda: "exact_linear: x and weight disagree on K")
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("dartree::exact_tree_attention")
    def _exact_tree_attention_fake(q, k, v, tree_mask, prefix_len, scale=None):
        torch._check(q.dim() == 4, lambda: f"exact_tree_attention: q must be [B, Hq, T, D], got {q.shape}")
        torch._check(k.dim() == 4 and v.shape == k.shape,
                     lambda: f"exact_tree_attention: k and v must be [B, Hkv, S, D], got {k.shape}, {v.shape}")
        return q.new_empty(q.shape)

    @torch.library.register_fake("dartree::sample_keyed")
    def _sample_keyed_fake(logits, positions, seed, temperature, tokens):
        torch._check(logits.dim() == 2, lambda: "sample_keyed: logits must be [T, V]")
        torch._check(positions.shape[0] == logits.shape[0],
                     lambda: "sample_keyed: positions must have one entry per logits row")
        return None
