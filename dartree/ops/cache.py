"""KV-cache ops: `kv_commit` keeps the accepted branch of a verified tree, `write_rows` writes a
layer's new rows into the whole static cache.

References: `dartree.reference.kv_commit`; `write_rows` is two slice copies (its op form exists
only for torch.compile, see its docstring).
"""

from __future__ import annotations

import torch

from .. import reference
from ._dispatch import _fake, _native


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


@_fake("kv_commit")
def _kv_commit_fake(kv, prefix_len, accepted):
    torch._check(accepted.dim() == 1, lambda: "accepted must be 1-D")
    return None


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

