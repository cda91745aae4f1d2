"""GGUF quantisation blocks: their layout, and their float32 values in plain PyTorch.

A GGUF tensor of a block type stores each weight row of K values as K / block_size blocks of
`type_size` bytes. `dequantize` rebuilds the float32 weights with exactly the arithmetic of
gguf-py's `gguf.quants.dequantize`, which transformers' GGUF loader runs: float16 scales widened to
float32, then separate multiplies and adds, each rounded (never fused), so

    dequantize(blocks, qtype, K) == torch.from_numpy(gguf.quants.dequantize(blocks, qtype))

bit for bit (tests/test_gguf_blocks.py). It is the reference of the packed-weight linear kernels,
which rebuild the same values inside their tiles.

Layouts (bytes of one block, little-endian; fp16 = IEEE half):
  Q4_0 [32]   d fp16 | 16 B of nibbles: value i < 16 in the low nibble of byte i, i >= 16 in the
              high nibble of byte i - 16;                          w = d * (q - 8)
  Q4_1 [32]   d fp16 | m fp16 | 16 B nibbles as Q4_0;              w = d * q + m
  Q5_0 [32]   d fp16 | qh u32 (bit i: 5th bit of value i) | 16 B nibbles;   w = d * (q - 16)
  Q5_1 [32]   d fp16 | m fp16 | qh u32 | 16 B nibbles;             w = d * q + m
  Q8_0 [32]   d fp16 | 32 x int8;                                  w = q * d
  Q4_K [256]  d fp16 | dmin fp16 | 12 B of 6-bit (scale, min) pairs for 8 sub-blocks of 32 |
              128 B nibbles (sub-block 2j low nibbles, 2j+1 high nibbles of bytes 32j..32j+31);
              w = (d * sc) * q - (dmin * mn)
  Q5_K [256]  as Q4_K, with 32 B of high bits (bit j of byte i: 5th bit of value 32j + i) before
              the nibbles;                                         w = (d * sc) * q - (dmin * mn)
  Q6_K [256]  128 B low nibbles | 64 B high 2-bit pairs | 16 x int8 scales | d fp16;
              w = (d * scale) * (q - 32), one scale per 16 values
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockType:
    name: str
    ggml_type: int     # GGMLQuantizationType value in the file
    block_size: int    # values per block
    type_size: int     # bytes per block


QK_K = 256
BLOCK_TYPES = {t.name: t for t in (
    BlockType("Q4_0", 2, 32, 2 + 16),
    BlockType("Q4_1", 3, 32, 2 + 2 + 16),
    BlockType("Q5_0", 6, 32, 2 + 4 + 16),
    BlockType("Q5_1", 7, 32, 2 + 2 + 4 + 16),
    BlockType("Q8_0", 8, 32, 2 + 32),
    BlockType("Q4_K", 12, QK_K, 2 + 2 + 12 + QK_K // 2),
    BlockType("Q5_K", 13, QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    BlockType("Q6_K", 14, QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
)}
_BY_GGML = {t.ggml_type: t for t in BLOCK_TYPES.values()}


def block_type(qtype: str | int) -> BlockType:
    """The block type named `qtype` (e.g. "Q4_K") or with that GGML type number; any other type
    is refused, naming it."""
    found = BLOCK_TYPES.get(qtype) if isinstance(qtype, str) else _BY_GGML.get(int(qtype))
    if found is None:
        raise ValueError(f"GGUF block type {qtype!r} is not supported; supported: "
                         f"{', '.join(BLOCK_TYPES)}")
    return found


def row_bytes(qtype: str | int, K: int) -> int:
    """Bytes of one packed row of K values; K must be a whole number of blocks."""
    t = block_type(qtype)
    if K <= 0 or K % t.block_size:
        raise ValueError(f"K must be a positive multiple of {t.name}'s block size "
                         f"{t.block_size}, got {K}")
    return K // t.block_size * t.type_size


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] float32 (the exact widening of a float16)."""
    return b.clone().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """[n, B] uint8 -> [n, 2B] uint8: for each run of `group` bytes, the low nibbles, then the
    high nibbles."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(n, -1)


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """[n, 4] uint8 (a little-endian u32) -> [n, 32] uint8: bit i of the word."""
    byte_shift = torch.tensor([0, 8, 16, 24], device=packed.device)
    word = (packed.to(torch.int64) << byte_shift).sum(dim=1, keepdim=True)
    bit = torch.arange(count, dtype=torch.int64, device=packed.device)
    return ((word >> bit) & 1).to(torch.uint8)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins, [n, 8] uint8 each."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _dequantize_blocks(blocks: torch.Tensor, t: BlockType) -> torch.Tensor:
    """[n, type_size] uint8 -> [n, block_size] float32."""
    n = blocks.shape[0]
    if t.name == "Q4_0":
        return _f16(blocks[:, :2]) * (_nibbles(blocks[:, 2:], 16).to(torch.int8) - 8).float()
    if t.name == "Q4_1":
        return _f16(blocks[:, :2]) * _nibbles(blocks[:, 4:], 16).float() + _f16(blocks[:, 2:4])
    if t.name == "Q5_0":
        q = _nibbles(blocks[:, 6:], 16) | (_bits(blocks[:, 2:6], 32) << 4)
        return _f16(blocks[:, :2]) * (q.to(torch.int8) - 16).float()
    if t.name == "Q5_1":
        q = _nibbles(blocks[:, 8:], 16) | (_bits(blocks[:, 4:8], 32) << 4)
        return _f16(blocks[:, :2]) * q.float() + _f16(blocks[:, 2:4])
    if t.name == "Q8_0":
        return blocks[:, 2:].clone().view(torch.int8).float() * _f16(blocks[:, :2])
    if t.name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scale_min(blocks[:, 4:16])
        scale = (d * sc.float()).reshape(n, 8, 1)
        offset = (dmin * mn.float()).reshape(n, 8, 1)
        if t.name == "Q4_K":
            q = _nibbles(blocks[:, 16:], 32)
        else:
            bit = torch.arange(8, dtype=torch.uint8, device=blocks.device).reshape(1, 8, 1)
            qh = blocks[:, 16:48].reshape(n, 1, 32) >> bit
            q = _nibbles(blocks[:, 48:], 32) | ((qh & 1).reshape(n, -1) << 4)
        return (scale * q.reshape(n, 8, 32).float() - offset).reshape(n, QK_K)
    if t.name == "Q6_K":
        ql = blocks[:, :128].reshape(n, 2, 1, 64)
        ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 8, 32)
        shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device)
        shift = shift.reshape(1, 1, 4, 1)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> shift
        qh = (qh & 0x03).reshape(n, 8, 32)
        q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
        scales = blocks[:, 192:208].clone().view(torch.int8).float()
        d = (_f16(blocks[:, 208:210]) * scales).reshape(n, 16, 1)
        return (d * q).reshape(n, QK_K)
    raise AssertionError(t.name)


def dequantize(packed: torch.Tensor, qtype: str | int, K: int) -> torch.Tensor:
    """Float32 weights [N, K] of packed rows [N, row_bytes(qtype, K)] (uint8, on any device)."""
    t = block_type(qtype)
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D uint8 tensor, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    if packed.shape[1] != row_bytes(t.name, K):
        raise ValueError(f"packed rows of {t.name} with K={K} have {row_bytes(t.name, K)} bytes, "
                         f"got {packed.shape[1]}")
    N = packed.shape[0]
    blocks = packed.reshape(N * (K // t.block_size), t.type_size)
    return _dequantize_blocks(blocks, t).reshape(N, K)
