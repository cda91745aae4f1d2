"""The CUDA batch-invariant linear kernel (csrc/include/dartree/exact.cuh: exact_linear_kernel with
its DenseW and PackedW loaders) run unchanged on the CPU under the fiber emulator
(tests/cuda_emu/exact_linear_emu.cpp), launched as csrc/cuda/exact.cu launches it, race detector
on, outputs poisoned first. For every GGUF block type and float32/float16/bfloat16 it checks
packed_linear's contract (csrc/ops.cpp: bit for bit exact_linear on gguf-py's dequantised weights
rounded to x's dtype), that a row's bits do not depend on the other rows of the call, and that
both kernels stay within the float32-accumulation error bound of a float64 product."""

import pytest
import torch

import cuda_emulator as emu
from dartree import gguf_blocks

from dartree.testing import random_packed

pytestmark = emu.needs_gxx

TYPES = list(gguf_blocks.BLOCK_TYPES)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (M, N, K blocks, bias): M over one, two and three 16-row tiles (33: a lone row in the last);
# N never a multiple of 16; K one block, or several (3 x 32 or 2 x 256: several 32-wide k tiles)
SHAPES = [(1, 7, "one", True), (3, 20, "several", False), (17, 5, "several", True), (33, 19, "one", False)]
ALONE = (0, 16, 32)  # rows of the 33-row call rerun alone: one from each row tile
UNIT = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def linear(op, x, bias, n, **weight):
    out = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype)
    return emu.run("exact_linear_emu", op, dict(x=x, bias=bias, out=out, **weight))["out"]


def packed_linear(x, packed, qtype, K, bias):
    return linear("packed_linear", x, bias, packed.shape[0], packed=packed,
                  qtype=gguf_blocks.block_type(qtype).ggml_type, K=K)


def exact_linear(x, w, bias):
    return linear("exact_linear", x, bias, w.shape[0], weight=w)


def bits(t):
    """The tensor's bit patterns (torch.equal takes -0 for +0)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_within_bound(out, x, w, bias):
    """|out - x @ w^T - bias| (in float64) within the rounding of the output to its dtype plus
    (K + 1) float32 roundings of the terms' magnitudes: a skipped, doubled or misplaced term, or
    a weight read from the wrong place, breaks it; summation order and fma do not."""
    u = UNIT[x.dtype]
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    if bias is not None:
        exact, scale = exact + bias.double(), scale + bias.double().abs()
    bound = (u * exact.abs() + (x.shape[1] + 1) * 2.0 ** -24 * scale) * (1 + u) + \
        torch.finfo(x.dtype).smallest_normal * u  # float16 subnormals: absolute rounding
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_kernel_is_the_dense_kernel_on_the_dequantised_weights(qtype, dtype):
    block = gguf_blocks.block_type(qtype).block_size
    for i, (m, n, blocks, with_bias) in enumerate(SHAPES):
        K = block * ((3 if block == 32 else 2) if blocks == "several" else 1)
        g = torch.Generator().manual_seed(1000 * i + TYPES.index(qtype) * 10 + DTYPES.index(dtype))
        x = torch.randn(m, K, generator=g).to(dtype)
        packed = random_packed(qtype, n, K, seed=int(torch.randint(1 << 30, (), generator=g)))
        bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
        w = gguf_blocks.dequantize(packed, qtype, K).to(dtype)

        got = packed_linear(x, packed, qtype, K, bias)
        dense = exact_linear(x, w, bias)
        assert got.dtype == dtype and got.shape == (m, n)
        assert torch.equal(bits(got), bits(dense)), (m, n, K)
        assert_within_bound(got, x, w, bias)  # and so no poison (NaN) left
        assert_within_bound(dense, x, w, bias)
        if m == 33:
            for row in ALONE:
                alone = packed_linear(x[row:row + 1], packed, qtype, K, bias)
                assert torch.equal(bits(alone), bits(got[row:row + 1])), row


def test_dense_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(33, 300, generator=g), torch.randn(21, 300, generator=g)
    bias = torch.randn(21, generator=g)
    out = exact_linear(x, w, bias)
    assert_within_bound(out, x, w, bias)
    for row in ALONE:
        assert torch.equal(bits(exact_linear(x[row:row + 1], w, bias)), bits(out[row:row + 1])), row
    for rows in (slice(0, 3), slice(15, 18)):  # neighbours across a tile edge
        assert torch.equal(bits(exact_linear(x[rows], w, bias)), bits(out[rows]))


def test_products_accumulate_by_fused_multiply_add():
    """acc = fmaf(x1, w1, fmaf(x0, w0, 0)): x0 w0 = -(1 + 2^-11) and x1 w1 = 1 + 2^-11 + 2^-24
    leave 2^-24 when the second step rounds once (fmaf, as on the device); a product rounded on
    its own gives 1 + 2^-11 (a tie, to even) and leaves 0."""
    e = 2.0 ** -12
    out = exact_linear(torch.tensor([[-1.0, 1 + e]]), torch.tensor([[1 + 2 * e, 1 + e]]), None)
    assert out.tolist() == [[2.0 ** -24]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_outputs_round_to_nearest_even_as_torch_rounds(dtype):
    """K = 1, x = 1: out = (fmaf(1, w, +0) + bias) in float32 = ((w + 0) + bias) rounded to the
    dtype by the emulated __float2half_rn / __float2bfloat16_rn, against torch's rounding. Sums
    of two values of the dtype often land on ties; the scales reach float16's subnormals; the
    last two sums are ties above the largest finite value (to even: infinity) and below it.
    (+0 first: the chain starts at +0, so -0 + -0 gives +0.)"""
    g = torch.Generator().manual_seed(11)
    n = 1000
    scales = 2.0 ** torch.randint(-26, 12, (2, n), generator=g).float()
    w, bias = torch.randn(2, n, generator=g) * scales
    big = torch.finfo(dtype).max
    eps = torch.finfo(dtype).eps
    half_ulp = big / (2 - eps) * eps / 2  # half the spacing of the top binade
    w, bias = torch.cat([w, torch.tensor([big, -big])]), torch.cat([bias, torch.tensor([half_ulp, half_ulp])])
    w, bias = w.to(dtype), bias.to(dtype)
    out = exact_linear(torch.ones(1, 1, dtype=dtype), w[:, None], bias)[0]
    want = ((w.float() + 0.0) + bias.float()).to(dtype)
    assert want[-2].isinf() and not want[-1].isinf()
    assert torch.equal(bits(out), bits(want))


def test_empty_output_launches_nothing():
    x, w = torch.randn(0, 32), torch.randn(5, 32)
    assert exact_linear(x, w, None).shape == (0, 5)
    assert exact_linear(torch.randn(3, 32), torch.randn(0, 32), None).shape == (3, 0)
