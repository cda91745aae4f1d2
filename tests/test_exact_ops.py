"""The batch-invariant ops: values against the float64 references, and the bits of every row
against the same row computed alone (exact_linear) or decoded one token at a time
(exact_tree_attention)."""

import random

import pytest
import torch

from dartree import ops, reference
from dartree.testing import rerun_capped

from test_tree_attention import TOLERANCE as ATTENTION_TOLERANCE
from test_tree_attention import ancestor_mask, poison_allocator, random_parents

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# |kernel - float64 reference| <= atol + rtol |reference| for outputs of size O(1)
LINEAR_TOLERANCE = {torch.float64: (1e-12, 1e-12), torch.float32: (2e-5, 1e-5),
                    torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 8e-3)}


def skip_unless_kernel(device):
    if device.type == "cuda" and not ops.HAS_CUDA_EXACT_LINEAR:
        pytest.fail("the extension was built without its CUDA kernels")


def linear_inputs(m, n, k, dtype, device, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    cast = lambda t: None if t is None else t.to(dtype).to(device)  # noqa: E731
    return cast(x), cast(w), cast(b)


def run_linear(x, w, b):
    """The compiled kernel itself, on poisoned memory."""
    poison_allocator(x.device, x.shape[0] * w.shape[0] * 2)
    return torch.ops.dartree.exact_linear.default(x, w, b)


# M, N, K: vector tails (K not a multiple of 8/16/32), single rows and columns, block tails
LINEAR_SHAPES = [(1, 1, 1), (3, 5, 7), (17, 70, 33), (64, 130, 576), (80, 193, 1000), (5, 64, 32),
                 (33, 65, 31), (1, 200, 1536)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_exact_linear_matches_reference(native, device, dtype, shape, bias):
    skip_unless_kernel(device)
    if device.type == "cuda" and dtype == torch.float64:
        pytest.skip("the CUDA kernel covers 16/32-bit floats")
    m, n, k = shape
    x, w, b = linear_inputs(m, n, k, dtype, device, seed=m * 1000 + n + k)
    out = run_linear(x, w, b)
    assert out.shape == (m, n) and out.dtype == dtype and out.device == x.device
    want = reference.exact_linear(x, w, b).double()
    atol, rtol = LINEAR_TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_exact_linear_rows_do_not_depend_on_the_batch(native, device, dtype, bias):
    skip_unless_kernel(device)
    if device.type == "cuda" and dtype == torch.float64:
        pytest.skip("the CUDA kernel covers 16/32-bit floats")
    rng = random.Random(11)
    for trial in range(12):
        m, n, k = rng.randint(1, 80), rng.randint(1, 300), rng.choice([1, 15, 31, 33, 64, 100, 577])
        x, w, b = linear_inputs(m, n, k, dtype, device, seed=trial, bias=bias)
        batch = run_linear(x, w, b)
        for i in rng.sample(range(m), min(m, 6)):
            assert torch.equal(run_linear(x[i:i + 1], w, b), batch[i:i + 1]), (m, n, k, i)
        lo = rng.randint(0, m - 1)
        hi = rng.randint(lo + 1, m)
        assert torch.equal(run_linear(x[lo:hi].clone(), w, b), batch[lo:hi]), (m, n, k, lo, hi)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, 16, 40), (16, 37, 67), (17, 5, 32), (40, 100, 96)], ids=str)
def test_exact_linear_rounds_as_a_cast(native, device, dtype, shape):
    """Small integers make every sum exact in float32, so each output must be the float result
    cast to the dtype bit for bit: round to nearest even (out[0, 0] = 301 is a bfloat16 tie),
    NaN (a NaN in x or w) and infinity (an infinite weight) included."""
    skip_unless_kernel(device)
    m, n, k = shape
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randint(-8, 9, (m, k), generator=g).double()
    w = torch.randint(-8, 9, (n, k), generator=g).double()
    b = torch.randint(-300, 301, (n,), generator=g).double()
    w[0], x[0, 1], w[0, 1], b[0] = 0, 1, 1, 300
    if m > 1:
        x[m - 1, k // 3] = float("nan")
    else:
        w[n // 2, 2] = float("nan")
    w[n - 1, 0] = float("inf")
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)  # b: the nearest value in the dtype
    want = (x.double() @ w.double().T + b.double()).float().to(dtype)
    out = run_linear(x.to(device), w.to(device), b.to(device)).cpu()
    nan = want.isnan()
    assert nan.any() and want.isinf().any()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan], want[~nan])


def test_exact_linear_rows_do_not_depend_on_threads(native):
    x, w, b = linear_inputs(37, 300, 577, torch.bfloat16, "cpu", seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_linear(x, w, b)
        torch.set_num_threads(max(2, threads))
        many = run_linear(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_exact_linear_reads_strided_inputs(native, device):
    skip_unless_kernel(device)
    x, w, b = linear_inputs(9, 20, 40, torch.float32, device, seed=5)
    xt = x.T.contiguous().T  # column-major x
    wt = torch.stack([w, -w], dim=2)[..., 0]  # w with a column stride of 2
    assert wt.stride(1) == 2 and torch.equal(wt, w)
    assert torch.equal(run_linear(xt, w, b), run_linear(x, w, b))
    assert torch.equal(run_linear(x, wt, b), run_linear(x, w, b))


def test_exact_linear_empty_shapes(native):
    x, w, b = linear_inputs(4, 6, 8, torch.float32, "cpu", seed=1)
    assert run_linear(x[:0], w, b).shape == (0, 6)
    assert run_linear(x, w[:0], b[:0]).shape == (4, 0)
    assert torch.equal(run_linear(x[:, :0], w[:, :0], b), b.expand(4, 6))


@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_exact_linear_bad_inputs(native, path):
    x, w, b = linear_inputs(4, 6, 8, torch.float32, "cpu", seed=1)
    cases = [
        ((x[0], w, b), "x must be \\[M, K\\]"),
        ((x, w[0], b), "weight must be \\[N, K\\]"),
        ((x, w[:, :7], b), "K = 8"),
        ((x, w.double(), b), "weight must have x's dtype"),
        ((x, w, b[:5]), "bias must be \\[6\\]"),
        ((x, w, b.half()), "bias must have x's dtype"),
        ((x.int(), w.int(), None), "x must be float32"),
    ]
    with ops.reference_ops(path == "reference"):
        for args, message in cases:
            with pytest.raises(ValueError, match=message):
                ops.exact_linear(*args)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_exact_linear_opcheck(native, device, bias):
    """Schema, fake kernel and autograd registration agree with the kernel (it runs inside the
    compiled verify)."""
    skip_unless_kernel(device)
    x, w, b = linear_inputs(5, 12, 33, torch.float32, device, seed=2, bias=bias)
    torch.library.opcheck(torch.ops.dartree.exact_linear.default, (x, w, b))


# ---------------------------------------------------------------------------------------------
# exact_tree_attention


def skip_unless_attention_kernel(device, dtype):
    if device.type != "cuda":
        return
    if not ops.HAS_CUDA_EXACT_TREE_ATTENTION:
        pytest.fail("the extension was built without its CUDA kernels")
    if dtype == torch.float64:
        pytest.skip("the CUDA kernel covers 16/32-bit floats")


def attention_inputs(heads, kv_heads, size, prefix, dim, kind, dtype, seed, extra=3, device="cpu"):
    """q [1, Hq, T, D]; k, v [1, Hkv, S, D] with NaN after the tree rows; the tree's parents."""
    g = torch.Generator().manual_seed(seed)
    seq = prefix + size + extra
    q = torch.randn(1, heads, size, dim, generator=g)
    k = torch.randn(1, kv_heads, seq, dim, generator=g)
    v = torch.randn(1, kv_heads, seq, dim, generator=g)
    k[:, :, prefix + size:] = float("nan")
    v[:, :, prefix + size:] = float("nan")
    parents = random_parents(size, kind, g)
    return q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device), parents


def run_attention(q, k, v, mask, prefix, scale=None):
    poison_allocator(q.device, q.numel() * 2)
    return torch.ops.dartree.exact_tree_attention.default(q, k, v, mask, prefix, scale)


def as_chain_step(q, k, v, parents, prefix, node):
    """Query `node` of a tree run alone, as one token decoded after its ancestors: a T = 1 query at
    position prefix + depth over a cache whose rows after the prefix are its ancestors in order."""
    path = []
    j = node
    while j >= 0:
        path.append(j)
        j = parents[j]
    path.reverse()
    rows = list(range(prefix)) + [prefix + j for j in path]
    ck, cv = k[:, :, rows].clone(), v[:, :, rows].clone()
    mask = torch.ones(1, 1, 1, dtype=torch.bool, device=q.device)
    return run_attention(q[:, :, node:node + 1].clone(), ck, cv, mask, len(rows) - 1)


# Hq, Hkv, T, prefix, D, tree
ATTENTION_CASES = [(4, 2, 7, 13, 16, "random"), (3, 1, 1, 0, 64, "chain"), (6, 3, 40, 150, 64, "random"),
                   (2, 2, 19, 64, 17, "star"), (9, 3, 33, 0, 64, "chain"), (8, 2, 64, 200, 128, "random"),
                   (4, 4, 5, 1, 80, "random")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_exact_tree_attention_matches_reference(native, device, dtype, case):
    skip_unless_attention_kernel(device, dtype)
    heads, kv_heads, size, prefix, dim, kind = case
    q, k, v, parents = attention_inputs(heads, kv_heads, size, prefix, dim, kind, dtype, seed=size + prefix,
                                        device=device)
    mask = ancestor_mask(parents)[None].to(device)
    out = run_attention(q, k, v, mask, prefix)
    want = reference.tree_attention(q.double(), k.double(), v.double(), mask, prefix)
    assert out.dtype == dtype and out.is_contiguous()
    assert (out.double() - want).abs().max().item() <= ATTENTION_TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_exact_tree_attention_row_equals_one_token_decoding(native, device, dtype, case):
    skip_unless_attention_kernel(device, dtype)
    heads, kv_heads, size, prefix, dim, kind = case
    q, k, v, parents = attention_inputs(heads, kv_heads, size, prefix, dim, kind, dtype, seed=7 * size + prefix,
                                        device=device)
    out = run_attention(q, k, v, ancestor_mask(parents)[None].to(device), prefix)
    for node in random.Random(size).sample(range(size), min(size, 8)):
        alone = as_chain_step(q, k, v, parents, prefix, node)
        assert torch.equal(out[:, :, node:node + 1], alone), node


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("dim", [16, 64, 24], ids=str)
def test_exact_tree_attention_reads_strided_keys(native, dtype, dim):
    """K/V rows with a stride other than D (a slice of a wider cache) read as their copies."""
    q, k, v, parents = attention_inputs(6, 3, 9, 70, dim, "random", dtype, seed=dim)
    wide_k = torch.full((*k.shape[:3], 2 * dim), float("nan"), dtype=dtype)
    wide_v = torch.zeros(*v.shape[:3], 3 * dim, dtype=dtype)
    wide_k[..., dim:], wide_v[..., :dim] = k, v
    ks, vs = wide_k[..., dim:], wide_v[..., :dim]
    assert ks.stride(2) == 2 * dim and vs.stride(2) == 3 * dim
    mask = ancestor_mask(parents)[None]
    assert torch.equal(run_attention(q, ks, vs, mask, 70), run_attention(q, k, v, mask, 70))


def test_exact_tree_attention_random_shapes_and_threads(native):
    rng = random.Random(5)
    threads = torch.get_num_threads()
    try:
        for trial in range(10):
            kv_heads = rng.randint(1, 3)
            heads = kv_heads * rng.randint(1, 4)
            size, prefix = rng.randint(1, 48), rng.randint(0, 300)
            dim, dtype = rng.choice([8, 33, 64]), rng.choice(DTYPES)
            q, k, v, parents = attention_inputs(heads, kv_heads, size, prefix, dim, "random", dtype, seed=trial)
            torch.set_num_threads(1 + trial % 2)
            out = run_attention(q, k, v, ancestor_mask(parents)[None], prefix)
            # a causal prefill of the same keys is a chain: its rows equal the tree's on a path
            node = rng.randrange(size)
            assert torch.equal(out[:, :, node:node + 1], as_chain_step(q, k, v, parents, prefix, node))
    finally:
        torch.set_num_threads(threads)


def test_exact_tree_attention_causal_block_equals_steps(native):
    """A causal block of T queries (prefill) row by row equals T one-token steps."""
    q, k, v, _ = attention_inputs(6, 2, 30, 10, 64, "chain", torch.bfloat16, seed=9, extra=0)
    chain = torch.ones(30, 30, dtype=torch.bool).tril()[None]
    block = run_attention(q, k, v, chain, 10)
    for i in range(30):
        one = torch.ones(1, 1, 1, dtype=torch.bool)
        assert torch.equal(block[:, :, i:i + 1], run_attention(q[:, :, i:i + 1], k, v, one, 10 + i))


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_exact_tree_attention_every_cpu_path(native, isa):
    """The narrower paths this CPU would not pick (AVX2's 8 lanes, the portable loops) keep the
    contract: the tests above in a process whose kernels are capped at `isa`."""
    rerun_capped(__file__, "exact_tree_attention and (matches_reference or one_token or strided_keys "
                 "or random_shapes or causal_block) and not cuda", isa)


def test_exact_tree_attention_bad_inputs(native):
    q, k, v, parents = attention_inputs(4, 2, 5, 3, 16, "random", torch.float32, seed=1)
    mask = ancestor_mask(parents)[None]
    with pytest.raises(ValueError, match="not a multiple"):
        ops.exact_tree_attention(q[:, :3], k, v, mask, 3)
    with pytest.raises(ValueError, match="exceeds the key length"):
        ops.exact_tree_attention(q, k, v, mask, 7)
    with pytest.raises(ValueError, match="tree_mask must be bool"):
        ops.exact_tree_attention(q, k, v, mask.int(), 3)
    with pytest.raises(ValueError, match="dtype"):
        ops.exact_tree_attention(q, k.double(), v, mask, 3)



@pytest.mark.parametrize("scale", [None, 0.25])
def test_exact_tree_attention_opcheck(native, device, scale):
    skip_unless_attention_kernel(device, torch.float32)
    q, k, v, parents = attention_inputs(4, 2, 5, 11, 64, "random", torch.float32, seed=4, device=device)
    mask = ancestor_mask(parents)[None].to(device)
    torch.library.opcheck(torch.ops.dartree.exact_tree_attention.default, (q, k, v, mask, 11, scale))

_ISA_CHECK = """
import random, torch
from dartree import ops, reference
rng = random.Random(2)
for trial in range(8):
    dtype = [torch.bfloat16, torch.float32, torch.float16][trial % 3]
    m, n, k = rng.randint(1, 70), rng.randint(1, 90), rng.choice([1, 31, 33, 100, 577])
    x, w, b = torch.randn(m, k).to(dtype), (torch.randn(n, k) / k ** 0.5).to(dtype), torch.randn(n).to(dtype)
    out = ops.exact_linear(x, w, b)
    err = (out.double() - reference.exact_linear(x, w, b).double()).abs().max().item()
    assert err <= (2e-2 if dtype == torch.bfloat16 else 5e-3), (dtype, m, n, k, err)
    for i in rng.sample(range(m), min(m, 4)):
        assert torch.equal(ops.exact_linear(x[i:i + 1], w, b), out[i:i + 1]), (dtype, m, n, k, i)
print("ok")
"""


def run_isa_check(script: str, isa: str) -> None:
    """Run `script` in a fresh process whose exact kernels are capped at `isa` (the choice is
    made once per process); it must print "ok"."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, DARTREE_EXACT_ISA=isa, PYTHONPATH=root, OMP_NUM_THREADS="2")
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("isa", ["avx512-bf16", "avx512", "avx2", "portable"])
def test_exact_linear_every_cpu_path(native, isa):
    """The lower paths this CPU would not pick (DARTREE_EXACT_ISA caps the choice) are row-invariant too."""
    run_isa_check(_ISA_CHECK, isa)
