import subprocess
import zlib

import pytest
import torch

import cuda_emulator
from dartree import ops, reference

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# max |kernel - float64 reference on the same rounded inputs|; outputs are O(1)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def random_parents(size, kind, generator):
    """Parents (parents[0] == -1, parents[i] < i) of a chain, a star, one node or a random tree."""
    if kind == "chain":
        return list(range(-1, size - 1))
    if kind == "star":
        return [-1] + [0] * (size - 1)
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, size)]


def ancestor_mask(parents):
    size = len(parents)
    mask = torch.zeros(size, size, dtype=torch.bool)
    for i in range(size):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def make_inputs(batch, heads, kv_heads, size, prefix, extra, dim, kind, dtype, device, seed,
                token_major_q=False):
    """Random q/k/v as the engine passes them: k, v are one layer of a bigger static cache whose rows
    after prefix + T hold NaN (never to be read); q may be transformers' [B, T, H, D] transposed."""
    g = torch.Generator().manual_seed(seed)
    seq = prefix + size + extra
    if token_major_q:
        q = torch.randn(batch, size, heads, dim, generator=g).transpose(1, 2)
    else:
        q = torch.randn(batch, heads, size, dim, generator=g)
    cache = torch.randn(2, 2, batch, kv_heads, seq, dim, generator=g)
    cache[..., prefix + size:, :] = float("nan")
    mask = torch.stack([ancestor_mask(random_parents(size, kind, g)) for _ in range(batch)])
    cache = cache.to(dtype).to(device)
    return q.to(dtype).to(device), cache[1, 0], cache[1, 1], mask.to(device)


def expected(q, k, v, mask, prefix, scale=None):
    """The reference in float64 on the same (already rounded) inputs."""
    return reference.tree_attention(q.double(), k.double(), v.double(), mask, prefix, scale)


def poison_allocator(device, numel):
    """Leave NaN in memory the next allocation is likely to reuse: outputs must be fully written."""
    junk = torch.full((numel,), float("nan"), device=device)
    del junk


def run_kernel(q, k, v, mask, prefix, scale=None):
    """The compiled kernel itself (not the wrapper, which sends CUDA shapes it lacks to the reference)."""
    poison_allocator(q.device, q.numel() * 2)
    return torch.ops.dartree.tree_attention.default(q, k, v, mask, prefix, scale)


def skip_unless_cuda_kernel(device, dtype, dim):
    if device.type != "cuda":
        return
    if not ops.HAS_CUDA_TREE_ATTENTION:
        pytest.fail("the extension was built without its CUDA kernels")
    if dtype == torch.float64 or dim not in (64, 128):
        pytest.skip("the CUDA kernel covers float32/16-bit and head dims 64, 128")


# B, Hq, Hkv, T, prefix, rows after prefix + T, D, tree, q token-major
CASES = [
    (1, 4, 2, 1, 0, 0, 64, "single", False),        # T = 1, no prefix, S == P + T
    (1, 4, 2, 7, 33, 10, 64, "random", True),
    (2, 8, 1, 9, 0, 5, 128, "chain", False),        # Hq = 8 Hkv, batch 2
    (1, 3, 3, 16, 200, 300, 64, "star", True),      # Hq == Hkv, S much larger than P + T
    (1, 4, 2, 65, 130, 7, 64, "random", False),     # tree keys across tiles
    (1, 32, 8, 64, 700, 100, 128, "random", True),  # the realistic shape, short prefix
    (1, 4, 2, 16, 180, 316, 16, "random", True),    # the CPU engine's tiny models
    (1, 2, 1, 5, 20, 3, 13, "random", False),       # D not a multiple of 8 (CPU)
    (1, 6, 3, 140, 90, 6, 64, "random", True),      # past the CPU's exact-kernel rows: its BLAS path
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Hq{}-Hkv{}-T{}-P{}-x{}-D{}-{}-{}".format(*c))
def test_matches_reference(native, device, dtype, case):
    batch, heads, kv_heads, size, prefix, extra, dim, kind, token_major = case
    skip_unless_cuda_kernel(device, dtype, dim)
    q, k, v, mask = make_inputs(batch, heads, kv_heads, size, prefix, extra, dim, kind, dtype, device,
                                seed=zlib.crc32(repr(case).encode()), token_major_q=token_major)
    out = run_kernel(q, k, v, mask, prefix)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    want = expected(q, k, v, mask, prefix)
    assert torch.isfinite(out).all()
    err = (out.double() - want).abs().max().item()
    assert err <= TOLERANCE[dtype], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_prefix_is_split(native, device, dtype):
    """Enough keys that the CPU and GPU kernels split them and merge the partial rows (on the CPU,
    the BLAS path: a tree of more rows than the exact kernel takes)."""
    q, k, v, mask = make_inputs(1, 8, 2, 136, 5000, 40, 64, "random", dtype, device, seed=7)
    out = run_kernel(q, k, v, mask, 5000)
    err = (out.double() - expected(q, k, v, mask, 5000)).abs().max().item()
    assert err <= TOLERANCE[dtype], err


def test_scale_and_strided_cache(native, device):
    """An explicit scale, and k/v whose rows are not contiguous in memory (row stride != D)."""
    dim = 64
    q, k, v, mask = make_inputs(2, 4, 2, 6, 50, 4, dim, "random", torch.float32, device, seed=3)
    wide_k = torch.randn(*k.shape[:-1], dim + 8, device=device)
    wide_v = torch.randn(*v.shape[:-1], dim + 8, device=device)
    k2, v2 = wide_k[..., 4:4 + dim], wide_v[..., :dim]
    for scale in (None, 0.3):
        out = run_kernel(q, k2, v2, mask, 50, scale)
        err = (out.double() - expected(q, k2, v2, mask, 50, scale)).abs().max().item()
        assert err <= TOLERANCE[torch.float32], (scale, err)


@pytest.mark.parametrize("size", [17, 64, 128])
def test_cpu_trees_of_up_to_128_rows_get_the_exact_kernels_bits(native, size):
    """On the CPU, with a KV head per thread, trees (and prefills) of up to 128 rows take the exact
    kernel: the same bits as exact_tree_attention, so a row does not depend on the tree it is in."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v, mask = make_inputs(1, 6, 3, size, 50, 4, 64, "random", torch.float32, torch.device("cpu"),
                                    seed=size)
        assert torch.equal(run_kernel(q, k, v, mask, 50),
                           torch.ops.dartree.exact_tree_attention.default(q, k, v, mask, 50, None))
    finally:
        torch.set_num_threads(threads)


def test_tree_keys_follow_the_mask(native, device):
    """A star: each leaf sees the prefix, the root and itself, never its siblings."""
    q, k, v, mask = make_inputs(1, 2, 1, 5, 3, 0, 64, "star", torch.float32, device, seed=5)
    out = run_kernel(q, k, v, mask, 3)
    sibling = v.clone()
    sibling[:, :, 3 + 2] = 100.0  # leaf 2's value: only leaf 2 may see it
    changed = run_kernel(q, k, sibling, mask, 3)
    moved = (changed - out).abs().amax(dim=-1)[0]  # [Hq, T]
    assert (moved[:, [0, 1, 3, 4]] == 0).all() and (moved[:, 2] > 0).all()


def test_query_without_visible_keys_gets_zeros(native, device):
    q, k, v, mask = make_inputs(1, 2, 1, 3, 0, 0, 64, "chain", torch.float32, device, seed=2)
    mask[0, 1] = False  # not a tree: query 1 sees nothing
    out = run_kernel(q, k, v, mask, 0)
    assert (out[0, :, 1] == 0).all()
    good = expected(q, k, v, mask, 0)[0, :, [0, 2]]
    assert (out[0, :, [0, 2]].double() - good).abs().max() <= TOLERANCE[torch.float32]


def test_wrapper_runs_the_kernel(native, monkeypatch):
    """With the extension built, dartree.ops.tree_attention never falls back to the reference on CPU."""
    def boom(*args, **kwargs):
        raise AssertionError("reference called")

    monkeypatch.setattr(reference, "tree_attention", boom)
    q, k, v, mask = make_inputs(1, 4, 2, 5, 9, 2, 16, "random", torch.float32, "cpu", seed=1)
    assert ops.tree_attention(q, k, v, mask, 9).shape == q.shape
    with ops.reference_ops(True), pytest.raises(AssertionError, match="reference called"):
        ops.tree_attention(q, k, v, mask, 9)


def test_empty_tree(native, device):
    q, k, v, _ = make_inputs(1, 4, 2, 3, 5, 0, 64, "chain", torch.float32, device, seed=1)
    mask = torch.zeros(1, 0, 0, dtype=torch.bool, device=device)
    out = ops.tree_attention(q[:, :, :0], k, v, mask, 5)
    assert out.shape == (1, 4, 0, 64)


def _good_args():
    q, k, v, mask = make_inputs(1, 4, 2, 3, 6, 1, 8, "chain", torch.float32, "cpu", seed=0)
    return dict(q=q, k=k, v=v, tree_mask=mask, prefix_len=6)


BAD_INPUTS = [
    (lambda a: dict(q=a["q"][0]), "q must be \\[B, Hq, T, D\\]"),
    (lambda a: dict(k=a["k"][0]), "k must be \\[B, Hkv, S, D\\]"),
    (lambda a: dict(v=a["v"][:, :, :5]), "v must have k's shape"),
    (lambda a: dict(q=a["q"].long()), "q must be float32, float64, float16 or bfloat16"),
    (lambda a: dict(k=a["k"].double(), v=a["v"].double()), "k and v must have q's dtype"),
    (lambda a: dict(q=a["q"][:, :3]), "Hq 3 is not a multiple of Hkv 2"),
    (lambda a: dict(q=a["q"][..., :4]), "k has head dim 8, q has 4"),
    (lambda a: dict(k=a["k"].expand(2, -1, -1, -1), v=a["v"].expand(2, -1, -1, -1)),
     "k has batch 2, q has 1"),
    (lambda a: dict(tree_mask=a["tree_mask"].to(torch.uint8)), "tree_mask must be bool"),
    (lambda a: dict(tree_mask=a["tree_mask"].float()), "tree_mask must be bool"),
    (lambda a: dict(tree_mask=a["tree_mask"][:, :2]), "tree_mask must be \\[1, 3, 3\\]"),
    (lambda a: dict(tree_mask=a["tree_mask"][0]), "tree_mask must be \\[1, 3, 3\\]"),
    (lambda a: dict(prefix_len=8), "prefix_len 8 \\+ T 3 exceeds the key length 10"),
    (lambda a: dict(prefix_len=-1), "exceeds the key length"),
    (lambda a: dict(k=a["k"].to("meta")), "k is on meta but q is on cpu"),
    (lambda a: dict(tree_mask=a["tree_mask"].to("meta")), "tree_mask is on meta but q is on cpu"),
]


@pytest.mark.parametrize("bad, match", BAD_INPUTS)
@pytest.mark.parametrize("use_reference", [False, True])
def test_bad_input(native, bad, match, use_reference):
    args = _good_args()
    args.update(bad(args))
    with ops.reference_ops(use_reference), pytest.raises(ValueError, match=match):
        ops.tree_attention(**args)


@pytest.mark.parametrize("bad, match", [b for b in BAD_INPUTS if "meta" not in b[1]])
def test_bad_input_to_the_op(native, bad, match):
    """The op's own TORCH_CHECKs (what torch.ops callers and compiled graphs see)."""
    args = _good_args()
    args.update(bad(args))
    with pytest.raises(ValueError, match=match):
        torch.ops.dartree.tree_attention(**args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bad_input(native):
    if not ops.HAS_CUDA_TREE_ATTENTION:
        pytest.fail("the extension was built without its CUDA kernels")
    args = {name: t.cuda() if torch.is_tensor(t) else t for name, t in _good_args().items()}
    with pytest.raises(ValueError, match="head dim 64 or 128"):
        torch.ops.dartree.tree_attention(**args)  # D = 8
    q, k, v, mask = make_inputs(1, 4, 2, 3, 6, 1, 64, "chain", torch.float64, "cuda", seed=0)
    with pytest.raises(ValueError, match="float64 is not supported on CUDA"):
        torch.ops.dartree.tree_attention(q, k, v, mask, 6)
    with pytest.raises(ValueError, match="k is on cpu but q is on cuda"):
        ops.tree_attention(q, k.cpu(), v, mask, 6)
    # what the kernel lacks runs the reference through the wrapper
    want = expected(q, k, v, mask, 6)
    assert (ops.tree_attention(q, k, v, mask, 6) - want).abs().max() <= TOLERANCE[torch.float64]


@pytest.mark.parametrize("scale", [None, 0.25])
def test_opcheck(native, device, scale):
    dim = 64
    q, k, v, mask = make_inputs(1, 4, 2, 5, 11, 3, dim, "random", torch.float32, device, seed=4)
    torch.library.opcheck(torch.ops.dartree.tree_attention.default, (q, k, v, mask, 11, scale))


def test_compile_fullgraph(native):
    q, k, v, mask = make_inputs(1, 4, 2, 6, 20, 2, 16, "random", torch.float32, "cpu", seed=6)

    @torch.compile(fullgraph=True)
    def attend(q, k, v, mask):
        return ops.tree_attention(q, k, v, mask, 20, 0.5) * 2

    out = attend(q, k, v, mask)
    want = expected(q, k, v, mask, 20, 0.5) * 2
    assert (out.double() - want).abs().max() <= 2 * TOLERANCE[torch.float32]


@cuda_emulator.needs_gxx
def test_cuda_kernels_in_emulator():
    """The CUDA kernels' own code (csrc/include/dartree/tree_attention.cuh), run on the CPU under
    tests/cuda_emu with its race detector: mma fragments, shuffles, barriers, cp.async, split +
    combine, all dtypes."""
    run = subprocess.run([cuda_emulator.driver("tree_attention_emu")], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and "all cases ok" in run.stdout, run.stdout[-4000:] + run.stderr[-4000:]
