"""packed_linear: a linear layer over GGUF blocks. Its contract is bitwise: the output equals
exact_linear on the weights gguf-py (transformers' GGUF loader) dequantises, rounded to x's dtype,
for every block type, M, awkward K and N, dtype and CPU path; its rows do not depend on the batch."""

import random

import pytest
import torch

from dartree import gguf_blocks, ops, reference
from dartree.testing import F16_FIELDS, random_packed

from test_exact_ops import run_isa_check
from test_tree_attention import poison_allocator

TYPES = list(gguf_blocks.BLOCK_TYPES)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def skip_unless_kernel(device):
    if device.type == "cuda" and not ops.HAS_CUDA_PACKED_LINEAR:
        pytest.fail("the extension was built without its CUDA kernels")


def inputs(qtype, m, n, blocks, dtype, device, seed, bias=True):
    K = blocks * gguf_blocks.block_type(qtype).block_size
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).to(dtype).to(device)
    packed = random_packed(qtype, n, K, seed).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return x, packed, K, b


def expected(x, packed, qtype, K, b):
    w = gguf_blocks.dequantize(packed.cpu(), qtype, K).to(x.dtype).to(x.device)
    return ops.exact_linear(x, w, b)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bitwise_equal_to_exact_linear_on_the_dequantised_weights(native, device, qtype, dtype):
    skip_unless_kernel(device)
    rng = random.Random(hash((qtype, str(dtype))) % 1000)
    for trial in range(3):
        m, n = rng.choice([1, 2, 3, 4, 5, 6, 8, 9, 17, 33]), rng.choice([1, 7, 64, 70, 129])
        blocks = rng.choice([1, 2, 3]) if qtype.endswith("K") else rng.choice([1, 3, 18])
        x, packed, K, b = inputs(qtype, m, n, blocks, dtype, device, seed=trial, bias=trial != 1)
        poison_allocator(device, m * n * 2)
        out = torch.ops.dartree.packed_linear.default(x, packed, gguf_blocks.block_type(qtype).ggml_type,
                                                      K, b)
        assert out.dtype == dtype and out.shape == (m, n)
        assert torch.equal(out, expected(x, packed, qtype, K, b)), (qtype, dtype, m, n, K)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scales_of_every_magnitude_keep_the_bits(native, qtype, dtype):
    """The CPU kernels rebuild a block's values from a table of its codes' values: the table must
    round as gguf-py does for any scale, so the float16 fields here range over every binade,
    subnormals and signed zeros included (the generic test draws them near 0.02 only). bfloat16
    activations round those values to bfloat16 in registers: subnormals must survive that too."""
    g = torch.Generator().manual_seed(11)
    for m in (1, 3, 5, 8, 16):  # the fused tiles (M <= 8) and the scratch path
        x, packed, K, b = inputs(qtype, m, 37, 2 if qtype.endswith("K") else 6, dtype,
                                 torch.device("cpu"), seed=m)
        blocks = packed.view(-1, gguf_blocks.block_type(qtype).type_size)
        for offset in F16_FIELDS[qtype]:
            exponent = torch.randint(-24, 9, (blocks.shape[0],), generator=g).float()
            sign = torch.randint(0, 2, (blocks.shape[0],), generator=g).float() * 2 - 1
            halves = (sign * torch.rand(blocks.shape[0], generator=g) * 2.0 ** exponent).to(torch.float16)
            halves[::7] = 0.0
            halves[1::11] = -0.0
            blocks[:, offset:offset + 2] = halves.view(torch.uint8).reshape(-1, 2)
        out = ops.packed_linear(x, packed, qtype, K, b)
        want = expected(x, packed, qtype, K, b)
        assert torch.isfinite(want).all()
        assert torch.equal(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), (qtype, m)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_finite_scales_give_the_same_non_finite_outputs(native, qtype, dtype):
    """A block whose float16 scale is inf or NaN makes inf and NaN weights (inf * 0 = NaN): the
    kernels must give NaN and inf where the reference does and the same bits everywhere else. (A
    NaN's payload is not part of the contract: torch's own casts and c10's differ there.)"""
    g = torch.Generator().manual_seed(5)
    for m in (1, 5, 16):  # the fused tiles (M <= 8) and the scratch path
        x, packed, K, b = inputs(qtype, m, 23, 2 if qtype.endswith("K") else 6, dtype,
                                 torch.device("cpu"), seed=m)
        blocks = packed.view(-1, gguf_blocks.block_type(qtype).type_size)
        special = torch.tensor([float("inf"), -float("inf"), float("nan")], dtype=torch.float16)
        rows = torch.randperm(blocks.shape[0], generator=g)[:3]
        for row, value in zip(rows.tolist(), special.view(torch.uint8).view(3, 2)):
            offset = F16_FIELDS[qtype][row % len(F16_FIELDS[qtype])]
            blocks[row, offset:offset + 2] = value
        out = ops.packed_linear(x, packed, qtype, K, b)
        want = expected(x, packed, qtype, K, b)
        assert not torch.isfinite(want).all() and torch.isfinite(want).any(), "the test needs both"
        assert torch.equal(out.isnan(), want.isnan()), (qtype, m)
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        keep = ~want.isnan()
        assert torch.equal(out[keep].view(bits), want[keep].view(bits)), (qtype, m)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_in_register_row_count_and_tile_tail(native, qtype, dtype):
    """Each row count of the in-register path takes its own tile, 2, 3, 4 or 8 weight rows wide
    (1-8 rows, 9 on the FMA tiles; up to 16 in two groups, 18 in float32 on the FMA tiles): N of 1
    and of a few tiles plus every remainder keep the bits."""
    for m in range(1, 20):
        for n in (1, 2, 3, 5, 7, 13, 70):
            x, packed, K, b = inputs(qtype, m, n, 1, dtype, torch.device("cpu"), seed=m * 100 + n)
            poison_allocator(torch.device("cpu"), m * n * 2)
            out = ops.packed_linear(x, packed, qtype, K, b)
            assert torch.equal(out, expected(x, packed, qtype, K, b)), (qtype, dtype, m, n)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_rows_do_not_depend_on_the_batch(native, device, qtype):
    skip_unless_kernel(device)
    x, packed, K, b = inputs(qtype, 40, 70, 2, torch.bfloat16, device, seed=9)
    out = ops.packed_linear(x, packed, qtype, K, b)
    for i in (0, 17, 39):
        assert torch.equal(ops.packed_linear(x[i:i + 1], packed, qtype, K, b), out[i:i + 1])


@pytest.mark.parametrize("m", [1, 8, 9, 17, 19])
def test_every_output_row_is_computed_whatever_the_thread_count(native, m):
    """The weight rows are split among the threads in balanced runs (exact_lin::RowBlocks): no row
    lost or written twice at counts that divide unevenly, on the in-register (float32: m <= 9, and
    two groups up to 18) and scratch paths."""
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for n in (9, 192, 577, 1000):
                x, packed, K, b = inputs("Q4_0", m, n, 1, torch.float32, torch.device("cpu"), seed=n)
                poison_allocator(torch.device("cpu"), m * n * 2)
                out = ops.packed_linear(x, packed, "Q4_0", K, b)
                assert torch.equal(out, expected(x, packed, "Q4_0", K, b)), (count, n, m)
    finally:
        torch.set_num_threads(threads)


def test_wrapper_takes_leading_dims_names_and_numbers(native):
    x, packed, K, b = inputs("Q8_0", 6, 5, 2, torch.float32, torch.device("cpu"), seed=3)
    out = ops.packed_linear(x.reshape(2, 3, K), packed, "Q8_0", K, b)
    assert out.shape == (2, 3, 5)
    assert torch.equal(out.reshape(6, 5), ops.packed_linear(x, packed, 8, K, b))


def test_reference_path_gives_the_same_values(native):
    x, packed, K, b = inputs("Q4_K", 3, 9, 1, torch.float32, torch.device("cpu"), seed=4)
    with ops.reference_ops():
        ref = ops.packed_linear(x, packed, "Q4_K", K, b)
    torch.testing.assert_close(ref, ops.packed_linear(x, packed, "Q4_K", K, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(ref, reference.packed_linear(x, packed, "Q4_K", K, b))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_packed_linear_opcheck(native, device, bias):
    skip_unless_kernel(device)
    x, packed, K, b = inputs("Q4_0", 5, 9, 2, torch.float32, device, seed=2, bias=bias)
    torch.library.opcheck(torch.ops.dartree.packed_linear.default, (x, packed, 2, K, b))


def test_bad_arguments_are_refused_by_name(native):
    x, packed, K, _ = inputs("Q4_1", 2, 3, 2, torch.float32, torch.device("cpu"), seed=1)
    with pytest.raises(ValueError, match="'IQ4_XS' is not supported"):
        ops.packed_linear(x, packed, "IQ4_XS", K)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 64\]"):
        ops.packed_linear(x[:, :32], packed, "Q4_1", K)
    with pytest.raises(ValueError, match=r"packed must be uint8 \[N, 40\]"):
        ops.packed_linear(x, packed[:, :39], "Q4_1", K)
    with pytest.raises(ValueError, match="x must be float32, float16 or bfloat16"):
        ops.packed_linear(x.double(), packed, "Q4_1", K)
    with pytest.raises(ValueError, match=r"bias must be \[3\]"):
        ops.packed_linear(x, packed, "Q4_1", K, torch.zeros(4))
    with pytest.raises(ValueError, match="multiple of Q4_K's block size 256, got 64"):
        ops.packed_linear(x, packed, "Q4_K", K)
    # the C++ checks, called directly
    with pytest.raises(ValueError, match="block type 10 is not supported"):
        torch.ops.dartree.packed_linear.default(x, packed, 10, K, None)
    with pytest.raises(ValueError, match=r"packed must be uint8 \[N, 40\]"):
        torch.ops.dartree.packed_linear.default(x, packed.float(), 3, K, None)


_ISA_CHECK = """
import random, torch
from dartree import gguf_blocks, ops
from dartree.testing import random_packed
rng = random.Random(3)
for trial, qtype in enumerate(gguf_blocks.BLOCK_TYPES):
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        K = gguf_blocks.block_type(qtype).block_size * rng.choice([1, 2])
        packed, n = random_packed(qtype, 90, K, trial), rng.randint(1, 90)
        w = gguf_blocks.dequantize(packed, qtype, K).to(dtype)
        for m in (*range(1, 19), rng.randint(19, 63), 64):  # in registers: M <= 16 (18), scratch above
            x = torch.randn(m, K).to(dtype)
            got = ops.packed_linear(x, packed[:n], qtype, K)
            assert torch.equal(got, ops.exact_linear(x, w[:n])), (qtype, dtype, m, n)
print("ok")
"""


@pytest.mark.parametrize("isa", ["avx512-bf16", "avx512", "avx2", "portable"])
def test_every_cpu_path(native, isa):
    """Each path DARTREE_EXACT_ISA can cap to keeps the contract (exact_linear takes the same one)."""
    run_isa_check(_ISA_CHECK, isa)
