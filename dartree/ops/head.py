"""Output-layer ops: `greedy_head`, the argmax of each row of a packed output layer without its
whole float32 product, and `greedy_head_bounds`, the bounds it reads (kernels and the bound:
csrc/include/dartree/cpu/greedy_head.h; the codes: `dartree.greedy_head.head_codes`).
"""

from __future__ import annotations

import torch

from .. import gguf_blocks, reference
from ._dispatch import _fake, _native

_COLS = 16  # output columns a code group holds


def greedy_head(x: torch.Tensor, codes: torch.Tensor, stats: torch.Tensor, packed: torch.Tensor,
                qtype: str | int, K: int) -> torch.Tensor:
    """The token each row of `packed_linear(x, packed, qtype, K)` puts first, without the product.

    x:      [T, K] float32 (CPU)
    codes, stats: `dartree.greedy_head.head_codes(packed, qtype, K)`
    returns int64 [T]: the first largest logit of each row (a NaN wins), exactly as
            `sample_keyed(packed_linear(...), positions, 0, 0.0)` picks it. On an AVX512-VNNI CPU
            an int8 pass bounds every logit and only the few columns that can win are computed
            exactly; elsewhere the whole product runs.

    >>> from dartree import gguf_blocks, greedy_head as gh
    >>> packed = torch.zeros(20, gguf_blocks.row_bytes("Q8_0", 64), dtype=torch.uint8)
    >>> codes, stats = gh.head_codes(packed, "Q8_0", 64)
    >>> greedy_head(torch.randn(3, 64), codes, stats, packed, "Q8_0", 64).tolist()  # all ties
    [0, 0, 0]
    """
    block = gguf_blocks.block_type(qtype)
    _check(x, codes, stats, packed.shape[0] if packed.dim() == 2 else -1, "greedy_head")
    if _native(x, codes, stats, packed) and x.device.type == "cpu":
        return torch.ops.dartree.greedy_head.default(x, codes, stats, packed, block.ggml_type, K)
    return reference.greedy_head(x, packed, block.name, K)


def greedy_head_bounds(x: torch.Tensor, codes: torch.Tensor, stats: torch.Tensor,
                       V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(upper, lower) float32 [T, V]: lower <= logit <= upper for every exact float32 logit of x
    against the weights `codes` were built from; rows of x with a NaN or an infinity: +inf, -inf."""
    _check(x, codes, stats, V, "greedy_head_bounds")
    if _native(x, codes, stats) and x.device.type == "cpu":
        return torch.ops.dartree.greedy_head_bounds.default(x, codes, stats, V)
    return reference.greedy_head_bounds(x, codes, stats, V)


def _check(x, codes, stats, V, op):
    """The C++ checks (csrc/cpu/greedy_head.cpp), for every path."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"{op}: x must be float32 [T, K], got {x.dtype} {tuple(x.shape)}")
    K = x.shape[1]
    if K <= 0 or K % 32:
        raise ValueError(f"{op}: K must be a positive multiple of 32, got {K}")
    if V <= 0:
        raise ValueError(f"{op}: V must be positive, got {V}")
    G = -(-V // _COLS)
    if codes.dim() != 3 or codes.dtype != torch.uint8 or tuple(codes.shape) != (G, K // 4, 4 * _COLS):
        raise ValueError(f"{op}: codes must be uint8 [{G}, {K // 4}, 64] for V = {V} and K = {K}, got "
                         f"{codes.dtype} {tuple(codes.shape)}")
    if stats.dtype != torch.float32 or tuple(stats.shape) != (3, G * _COLS):
        raise ValueError(f"{op}: stats must be float32 [3, {G * _COLS}], got {stats.dtype} {tuple(stats.shape)}")
    for t in (x, codes, stats):
        if t.device.type != "cpu":
            raise ValueError(f"{op}: every tensor must be on the CPU, got {t.device}")


@_fake("greedy_head")
def _greedy_head_fake(x, codes, stats, packed, qtype, K):
    return x.new_empty(x.shape[0], dtype=torch.int64)


@_fake("greedy_head_bounds")
def _greedy_head_bounds_fake(x, codes, stats, V):
    return x.new_empty(x.shape[0], V), x.new_empty(x.shape[0], V)
