"""A static KV cache: every layer's keys and values in one tensor, indexed by position.

    cache = StaticKVCache(num_layers=30, num_kv_heads=3, head_dim=64, batch_dims=(1,))
    cache.allocate(512, torch.bfloat16, torch.device("cpu"))   # tensor [30, 2, 1, 3, 512, 64]
    # a pass writes its rows from cache.length on: ops.write_rows(cache.tensor, layer, cache.length, k, v)
    cache.commit(accepted)                                      # keep the accepted rows of a tree

One tensor (not one per layer) so that a commit moves the rows of every layer in one launch
(`ops.kv_commit`) and a compiled pass takes the whole cache as one input. Rows [0, length) hold
the committed positions; a pass writes its new rows after them (the target's verify tree, the
drafter's context and block rows), and what is not committed is overwritten by the next pass.
"""

from __future__ import annotations

import torch

from . import ops


class StaticKVCache:
    """Keys and values of positions [0, max_len) for every layer: `tensor`
    [L, 2, *batch_dims, Hkv, max_len, D] (index 0 of dim 1: keys, 1: values).

    num_layers, num_kv_heads, head_dim: L, Hkv, D
    batch_dims: dims between K/V and the heads: (1,) for a batch-1 [B, H, S, D] attention layout,
                () for [H, S, D]
    zeros:      allocate zero-filled (rows never written read as zeros) rather than uninitialised
    length:     rows of committed positions; set by its owner (prefill, a drafter's context) or
                grown by `commit`
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 batch_dims: tuple[int, ...] = (), zeros: bool = True):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.batch_dims = tuple(batch_dims)
        self.zeros = zeros
        self.tensor: torch.Tensor | None = None
        self.max_len = 0
        self.length = 0

    def shape(self, max_len: int) -> tuple[int, ...]:
        """The tensor's shape for `max_len` positions."""
        return (self.num_layers, 2, *self.batch_dims, self.num_kv_heads, max_len, self.head_dim)

    def allocate(self, max_len: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Room for positions [0, max_len) in `dtype` on `device`; length = 0.

        The tensor is kept when its shape, dtype and device already match (returns False, its rows
        as they were); else the old one is freed first and a new one made (returns True)."""
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        shape, old = self.shape(max_len), self.tensor
        fresh = old is None or old.shape != shape or old.dtype != dtype or old.device != device
        if fresh:
            self.tensor = None  # free the old cache before allocating the new one
            make = torch.zeros if self.zeros else torch.empty
            self.tensor = make(shape, dtype=dtype, device=device)
        self.max_len, self.length = max_len, 0
        return fresh

    def free(self) -> None:
        """Drop the tensor (allocate makes a new one)."""
        self.tensor, self.max_len, self.length = None, 0, 0

    def mark_dynamic(self) -> None:
        """Let torch.compile trace the position dim as a symbol: one graph for every max_len."""
        torch._dynamo.maybe_mark_dynamic(self.tensor, self.tensor.dim() - 2)

    def check_allocated(self) -> None:
        """Refuse to run before `allocate`."""
        if self.tensor is None:
            raise RuntimeError("no KV cache: call allocate(max_len) first")

    def check_fits(self, length: int) -> None:
        """Refuse a context of `length` positions that the cache cannot hold."""
        if length > self.max_len:
            raise ValueError(f"context of {length} tokens exceeds the cache (max_len {self.max_len})")

    def commit(self, accepted: torch.Tensor) -> None:
        """Keep the accepted rows of the last pass: rows length + accepted[j] move to length + j in
        every layer, then length += len(accepted).

        accepted: int64 [a] on the cache's device, strictly increasing, accepted[0] == 0, within
                  the rows the pass wrote (the caller checks: `ops.kv_commit` runs unchecked)."""
        ops.kv_commit(self.tensor, self.length, accepted, check=False)
        self.length += accepted.numel()
