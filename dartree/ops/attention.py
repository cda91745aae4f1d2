"""Tree-attention ops: `tree_attention` (the target's verify pass) and `exact_tree_attention`, its
batch-invariant twin for exact mode.

References: `dartree.reference.tree_attention` and `dartree.reference.exact_tree_attention`. The
argument checks are shared: both ops take the same arguments.
"""

from __future__ import annotations

import torch

from .. import reference
from ._dispatch import HAS_CUDA_EXACT_TREE_ATTENTION, HAS_CUDA_TREE_ATTENTION, _fake, _native

# Head dims and dtypes the CUDA kernel is built for; other CUDA inputs run the reference.
_CUDA_TREE_ATTENTION_DIMS = (64, 128)
_CUDA_TREE_ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


@_fake("tree_attention")
def _tree_attention_fake(q, k, v, tree_mask, prefix_len, scale=None):
    torch._check(q.dim() == 4, lambda: f"tree_attention: q must be [B, Hq, T, D], got {q.shape}")
    torch._check(k.dim() == 4 and v.shape == k.shape,
                 lambda: f"tree_attention: k and v must be [B, Hkv, S, D], got {k.shape}, {v.shape}")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: "tree_attention: Hq must be a multiple of Hkv")
    return q.new_empty(q.shape)


# Batch-invariant: the reference (no extension, or float64 on CUDA) gives the same values within
# rounding but not that guarantee; `dartree.exact()` refuses to run on it (exact_kernels_available).
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


@_fake("exact_tree_attention")
def _exact_tree_attention_fake(q, k, v, tree_mask, prefix_len, scale=None):
    torch._check(q.dim() == 4, lambda: f"exact_tree_attention: q must be [B, Hq, T, D], got {q.shape}")
    torch._check(k.dim() == 4 and v.shape == k.shape,
                 lambda: f"exact_tree_attention: k and v must be [B, Hkv, S, D], got {k.shape}, {v.shape}")
    return q.new_empty(q.shape)
