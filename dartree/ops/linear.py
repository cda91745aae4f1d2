"""Linear ops: `exact_linear`, the batch-invariant matrix product of exact mode;
`packed_linear`, the same product over weights kept as GGUF blocks; and
`exact_kernels_available`, whether exact mode has its compiled kernels on a device.

Batch-invariant: every output row is a function of that row's inputs alone, bitwise: row i of a
batch equals the row computed alone. The reference (`dartree.reference.exact_linear`: no extension,
or a device without a kernel) gives the same values within rounding but not that guarantee;
`dartree.exact()` refuses to run on it.
"""

from __future__ import annotations

import torch

from .. import gguf_blocks, reference
from ._dispatch import (HAS_CUDA_EXACT_LINEAR, HAS_CUDA_EXACT_TREE_ATTENTION, HAS_CUDA_PACKED_LINEAR,
                        _fake, _native)

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
    _check_bias("exact_linear", bias, weight.shape[0], x)


@_fake("exact_linear")
def _exact_linear_fake(x, weight, bias=None):
    torch._check(x.dim() == 2 and weight.dim() == 2, lambda: "exact_linear: x [M, K], weight [N, K]")
    torch._check(x.shape[1] == weight.shape[1], lambda: "exact_linear: x and weight disagree on K")
    return x.new_empty(x.shape[0], weight.shape[0])


def packed_linear(x: torch.Tensor, packed: torch.Tensor, qtype: str | int, K: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """A linear layer whose weight stays as GGUF blocks: x @ W.T + bias, batch-invariant.

    x:      [..., K] float32, float16 or bfloat16
    packed: [N, gguf_blocks.row_bytes(qtype, K)] uint8, each row K / block_size blocks of `qtype`
            (a name such as "Q4_K" or its GGML number; Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
            Q6_K: any other is refused by name)
    bias:   [N] in x's dtype, or None
    returns [..., N] in x's dtype, bit for bit `exact_linear(x, W.to(x.dtype), bias)` where W is
            `gguf_blocks.dequantize(packed, qtype, K)`, the float32 weights transformers' GGUF
            loader makes: the kernels rebuild W's rows in x's dtype inside the call and run
            exact_linear's own tiles over them (no float copy of W is kept).

    >>> from dartree import gguf_blocks
    >>> packed = torch.zeros(3, gguf_blocks.row_bytes("Q8_0", 64), dtype=torch.uint8)
    >>> packed_linear(torch.randn(2, 64), packed, "Q8_0", 64).shape
    torch.Size([2, 3])
    """
    block = gguf_blocks.block_type(qtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    _check_packed_linear(x2, packed, block, K, bias)
    if _native(x2, packed, *(() if bias is None else (bias,))) and (
            x.device.type == "cpu" or HAS_CUDA_PACKED_LINEAR):
        out = torch.ops.dartree.packed_linear.default(x2, packed, block.ggml_type, K, bias)
    else:
        out = reference.packed_linear(x2, packed, block.name, K, bias)
    return out.reshape(*lead, packed.shape[0])


def _check_packed_linear(x, packed, block, K, bias):
    """The C++ checks (csrc/packed_checks.h), for every path."""
    row_bytes = gguf_blocks.row_bytes(block.name, K)  # K a positive multiple of the block
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"packed_linear: x must be [..., {K}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"packed_linear: x must be float32, float16 or bfloat16, got {x.dtype}")
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != row_bytes:
        raise ValueError(f"packed_linear: packed must be uint8 [N, {row_bytes}] ({block.name}, "
                         f"K = {K}), got {packed.dtype} {tuple(packed.shape)}")
    if packed.device != x.device:
        raise ValueError(f"packed_linear: packed is on {packed.device} but x is on {x.device}")
    _check_bias("packed_linear", bias, packed.shape[0], x)


def _check_bias(op: str, bias, n: int, x) -> None:
    """bias [n] in x's dtype on x's device, or None."""
    if bias is None:
        return
    if bias.shape != (n,):
        raise ValueError(f"{op}: bias must be [{n}], got {tuple(bias.shape)}")
    if bias.dtype != x.dtype:
        raise ValueError(f"{op}: bias must have x's dtype {x.dtype}, got {bias.dtype}")
    if bias.device != x.device:
        raise ValueError(f"{op}: bias is on {bias.device} but x is on {x.device}")


@_fake("packed_linear")
def _packed_linear_fake(x, packed, qtype, K, bias=None):
    torch._check(x.dim() == 2 and packed.dim() == 2, lambda: "packed_linear: x [M, K], packed [N, B]")
    return x.new_empty(x.shape[0], packed.shape[0])


def packed_kernel_available(device: torch.device) -> bool:
    """Whether packed_linear has a compiled kernel on this device type (else: the reference)."""
    return _native() and (torch.device(device).type == "cpu" or HAS_CUDA_PACKED_LINEAR)


def exact_kernels_available(device: torch.device) -> bool:
    """Whether both exact ops have compiled kernels on this device type."""
    device = torch.device(device)
    if not _native():  # no extension, or the reference switch is on
        return False
    return device.type == "cpu" or (device.type == "cuda" and HAS_CUDA_EXACT_LINEAR
                                    and HAS_CUDA_EXACT_TREE_ATTENTION)
