"""Greedy rounds' output layer on a CPU: each row's argmax without the whole float32 product.

A greedy round reads one token of each verified row, the argmax of its logits. In float32 the
output layer is a fifth of a verify row's arithmetic (SmolLM2: 49,152 x 576 of ~135M weights),
and a row past the first runs at the FMA rate. `GreedyHead` keeps an int8 copy of a packed output
layer (one scale per column: 28 MB for SmolLM2) from which `ops.greedy_head` bounds every logit of
a row with VPDPBUSD (64 products an instruction against an FMA's 16) and computes only the columns
that can win exactly, with packed_linear's own bits: the token is the one the whole product would
give, bit for bit the same decision (the bound and why it holds:
csrc/include/dartree/cpu/greedy_head.h).

It applies to a bias-free `PackedLinear` taking float32 on a CPU with AVX512-VNNI (and
DARTREE_EXACT_ISA allowing AVX-512); elsewhere the target keeps the whole product.
"""

from __future__ import annotations

import os
import weakref

import torch

from . import gguf_blocks, hardware, ops
from .gguf import PackedLinear

_COLS = 16
_CHUNK = 16384  # rows dequantised at a time: a 151,936-row head never exists in float32 at once


def head_codes(packed: torch.Tensor, qtype: str | int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 copy greedy_head reads, of packed rows [V, row bytes] (uint8, GGUF `qtype`):

    codes uint8 [G, K / 4, 64], G = ceil(V / 16): byte (g, k4, 4 j + t) = q[16 g + j, 4 k4 + t] + 128
    stats float32 [3, 16 G]: scale s_c = max_k |w[c, k]| / 127, err_c = |w_c - s_c q_c|_2 and
          qnorm_c = |s_c q_c|_2 (rounded up), with q = round(w / s_c); zero past V.
    Raises ValueError for weights that are not all finite (their logits are not bounded)."""
    block = gguf_blocks.block_type(qtype)
    if K % 32:
        raise ValueError(f"head_codes: K must be a multiple of 32, got {K}")
    V = packed.shape[0]
    G = -(-V // _COLS)
    codes = torch.empty(G, K // 4, 4 * _COLS, dtype=torch.uint8)
    stats = torch.zeros(3, G * _COLS, dtype=torch.float32)
    for start in range(0, G * _COLS, _CHUNK):
        end = min(start + _CHUNK, G * _COLS)
        w = torch.zeros(end - start, K)
        if start < V:
            w[:min(end, V) - start] = gguf_blocks.dequantize(packed[start:min(end, V)], block.name, K)
        if not torch.isfinite(w).all():
            raise ValueError("head_codes: the output layer holds a NaN or an infinity")
        scale = w.abs().amax(1) / 127
        q = torch.where(scale[:, None] > 0, torch.round(w / scale[:, None]).clamp(-127, 127), 0.0)
        approx = scale.double()[:, None] * q.double()
        stats[0, start:end] = scale
        stats[1, start:end] = _rounded_up((w.double() - approx).norm(dim=1))
        stats[2, start:end] = _rounded_up(approx.norm(dim=1))
        codes[start // _COLS:end // _COLS] = (q + 128).to(torch.uint8).reshape(
            -1, _COLS, K // 4, 4).permute(0, 2, 1, 3).reshape(-1, K // 4, 4 * _COLS)
    return codes, stats


def _rounded_up(v: torch.Tensor) -> torch.Tensor:
    """float64 -> the float32 at or above each value (a bound must not shrink)."""
    low = v.float()
    return torch.where(low.double() < v, torch.nextafter(low, torch.tensor(torch.inf)), low)


def fast_available() -> bool:
    """Whether ops.greedy_head takes its int8 pass here (else it runs the whole product)."""
    cap = os.environ.get("DARTREE_EXACT_ISA", "")
    return (ops.HAS_EXTENSION and "avx512_vnni" in hardware.cpu_flags()
            and cap not in ("avx2", "portable"))


class GreedyHead:
    """The argmax of a packed output layer's rows: head(x [T, K] float32) -> int64 [T]."""

    def __init__(self, layer: PackedLinear):
        if not applies(layer, torch.float32):
            raise ValueError("GreedyHead needs a bias-free PackedLinear on the CPU")
        self.layer = layer
        self.codes, self.stats = head_codes(layer.packed, layer.qtype, layer.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        return torch.ops.dartree.greedy_head.default(x, self.codes, self.stats, layer.packed,
                                                     layer.ggml_type, layer.in_features)


_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> (its rows' identity, head)


def head_of(layer: PackedLinear) -> GreedyHead:
    """The layer's GreedyHead, one for every target over it (28 MB for SmolLM2's), built again
    when its packed rows are replaced or written in place."""
    key = (layer.packed.data_ptr(), layer.packed._version)
    cached = _HEADS.get(layer)
    if cached is None or cached[0] != key:
        cached = _HEADS[layer] = (key, GreedyHead(layer))
    return cached[1]


def applies(layer, dtype: torch.dtype) -> bool:
    """Whether a GreedyHead pays for `layer` taking activations of `dtype`: a bias-free packed
    layer, float32, on a CPU whose greedy_head takes the int8 pass."""
    return (type(layer) is PackedLinear and layer.bias is None and dtype == torch.float32
            and layer.packed.device.type == "cpu" and layer.in_features % 32 == 0 and fast_available())
