"""dartree's custom ops: thin wrappers over torch.ops.dartree.* with fake kernels.

Each public function here has a plain-PyTorch twin in `dartree.reference` (the oracle for tests).
When the compiled extension `dartree._C` is missing, or `use_reference(True)` is in force, the
wrappers run the reference instead, so the package works from a source tree without a build.
"""

from __future__ import annotations

import contextlib
import logging

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


# ---------------------------------------------------------------------------------------------
# ops with only a reference so far (kernels land with the kernels issue)


def candidate_topk(logits, num_candidates):
    """Top-C tokens per draft slot and the full-vocabulary logsumexp; see `dartree.reference`."""
    return reference.candidate_topk(logits, num_candidates)


def expand_level(parent_scores, parent_states, z, w_s, cand_w2, cand_b2, cand_base, cand_ids,
                 num_expand, num_select, input_table=None, w_hh=None, b_hh=None):
    """One DARTree level (score, select, GRU step); see `dartree.reference.expand_level`."""
    return reference.expand_level(parent_scores, parent_states, z, w_s, cand_w2, cand_b2, cand_base,
                                  cand_ids, num_expand, num_select, input_table, w_hh, b_hh)


def prune_tree(parents, depths, scores, budget, depth_bonus):
    """Keep the root and the best `budget` nodes; see `dartree.reference.prune_tree`."""
    return reference.prune_tree(parents, depths, scores, budget, depth_bonus)


def verify_tree(parents, tokens, target_tokens):
    """The accepted root path of a verified tree and the bonus; see `dartree.reference.verify_tree`."""
    return reference.verify_tree(parents, tokens, target_tokens)


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


def candidate_topk(logits, num_candidates):
    """Top-C tokens of every draft slot; see `dartree.reference.candidate_topk`."""
    return reference.candidate_topk(logits, num_candidates)


def expand_level(*args, **kwargs):
    """One DARTree level; see `dartree.reference.expand_level`."""
    return reference.expand_level(*args, **kwargs)


def prune_tree(parents, depths, scores, budget, depth_bonus):
    """Keep the best `budget` nodes; see `dartree.reference.prune_tree`."""
    return reference.prune_tree(parents, depths, scores, budget, depth_bonus)


def verify_tree(parents, tokens, target_tokens):
    """The accepted root-to-node walk; see `dartree.reference.verify_tree`."""
    return reference.verify_tree(parents, tokens, target_tokens)
