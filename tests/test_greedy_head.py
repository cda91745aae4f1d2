"""greedy_head: the argmax of each row of a packed output layer without its whole product. Its
contract is the token of the whole product (argmax_row's order: a NaN first, ties the lowest
column) for every block type, awkward V and K, any x; greedy_head_bounds' bounds hold for every
logit; the target's greedy verify gives the argmax of its own logits."""

import random

import pytest
import torch

from dartree import gguf_blocks, greedy_head, ops, reference
from dartree.testing import random_packed

from test_exact_ops import run_isa_check

TYPES = ["Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"]
FAST = greedy_head.fast_available()


def case(qtype, V, blocks, T, seed, spread=1.0):
    """x [T, K] whose 32-value blocks range over magnitudes (one block in four zero), packed [V]."""
    K = blocks * gguf_blocks.block_type(qtype).block_size
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp(spread * torch.randn(T, K // 32, 1, generator=g))
    scales[:, ::4] = 0
    x = (torch.randn(T, K // 32, 32, generator=g) * scales).reshape(T, K)
    return x, random_packed(qtype, V, K, seed), K


def whole(x, packed, qtype, K):
    """The tokens of the whole product, as greedy decoding picks them."""
    logits = ops.packed_linear(x, packed, qtype, K)
    return ops.sample_keyed(logits, torch.zeros(x.shape[0], dtype=torch.int64), 0, 0.0)


@pytest.mark.parametrize("qtype", TYPES)
def test_bounds_hold_for_every_logit_and_match_the_reference(native, qtype):
    rng = random.Random(qtype)
    for trial in range(4):
        V, T = rng.choice([1, 15, 16, 37, 200]), rng.choice([1, 3, 8, 9, 17])
        blocks = 1 if qtype.endswith("K") else rng.choice([1, 3, 18])
        x, packed, K = case(qtype, V, blocks, T, seed=trial, spread=2.0)
        codes, stats = greedy_head.head_codes(packed, qtype, K)
        exact = ops.packed_linear(x, packed, qtype, K)
        upper, lower = torch.ops.dartree.greedy_head_bounds.default(x, codes, stats, V)
        ref_upper, ref_lower = reference.greedy_head_bounds(x, codes, stats, V)
        for up, low in ((upper, lower), (ref_upper, ref_lower)):
            assert up.shape == low.shape == (T, V)
            assert bool((low <= exact).all() and (exact <= up).all()), (qtype, V, T, K)
        width = (ref_upper - ref_lower).double()
        for got, want in ((upper, ref_upper), (lower, ref_lower)):  # float32 sums against float64
            assert ((got.double() - want.double()).abs() <= 1e-3 * width + 1e-30).all(), (qtype, V, T, K)


@pytest.mark.parametrize("qtype", TYPES)
def test_tokens_are_the_whole_products_argmax(native, qtype):
    rng = random.Random(qtype)
    for trial in range(6):
        V, T = rng.choice([1, 17, 64, 333, 2000]), rng.choice([1, 2, 5, 8, 9, 16, 33])
        blocks = rng.choice([1, 2]) if qtype.endswith("K") else rng.choice([1, 3, 18])
        x, packed, K = case(qtype, V, blocks, T, seed=100 + trial)
        codes, stats = greedy_head.head_codes(packed, qtype, K)
        got = ops.greedy_head(x, codes, stats, packed, qtype, K)
        assert got.dtype == torch.int64 and got.shape == (T,)
        assert torch.equal(got, whole(x, packed, qtype, K)), (qtype, V, T, K)
        assert torch.equal(reference.greedy_head(x, packed, qtype, K), got)


def test_ties_go_to_the_lowest_column_and_near_ties_to_the_larger(native):
    """Duplicated rows tie exactly (the first wins); x scaled so that logits differ in their last
    bits leaves many candidates, which the exact pass decides."""
    x, packed, K = case("Q8_0", 300, 18, 12, seed=7)
    packed[200] = packed[10]
    packed[250] = packed[10]
    packed[299] = packed[3]
    x[:6] = packed_direction(packed, 10, K)  # rows pointing at the duplicated column
    codes, stats = greedy_head.head_codes(packed, "Q8_0", K)
    for scale in (1.0, 1e-20, 1e20):
        got = ops.greedy_head(x * scale, codes, stats, packed, "Q8_0", K)
        assert torch.equal(got, whole(x * scale, packed, "Q8_0", K)), scale
        assert set(got[:6].tolist()) == {10}, scale


def packed_direction(packed, column, K):
    return gguf_blocks.dequantize(packed[column:column + 1], "Q8_0", K)[0]


def test_rows_with_nan_infinity_or_zeros_take_argmax_rows_order(native):
    x, packed, K = case("Q4_K", 70, 1, 6, seed=3)
    x[1, 5] = float("nan")
    x[2, 0] = float("inf")
    x[3] = 0  # every logit 0: all columns tie, column 0 wins
    x[4, 7] = 1e30  # past the bound's range: the whole product
    codes, stats = greedy_head.head_codes(packed, "Q4_K", K)
    got = ops.greedy_head(x, codes, stats, packed, "Q4_K", K)
    assert torch.equal(got, whole(x, packed, "Q4_K", K))
    assert got[3] == 0
    upper, lower = ops.greedy_head_bounds(x, codes, stats, 70)
    assert torch.isinf(upper[1:3]).all() and torch.isinf(lower[1:3]).all()
    assert torch.isfinite(upper[[0, 3, 5]]).all()


def test_head_codes_layout_and_refusals():
    packed = random_packed("Q8_0", 21, 64, seed=1)
    codes, stats = greedy_head.head_codes(packed, "Q8_0", 64)
    assert codes.shape == (2, 16, 64) and stats.shape == (3, 32)
    w = gguf_blocks.dequantize(packed, "Q8_0", 64)
    scale = w.abs().amax(1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127)
    for c in (0, 5, 16, 20):  # byte (g, k4, 4 j + t) = q[16 g + j, 4 k4 + t] + 128
        g, j = divmod(c, 16)
        got = codes[g, :, 4 * j:4 * j + 4].reshape(-1).to(torch.int64) - 128
        assert torch.equal(got, q[c].to(torch.int64)), c
    assert torch.equal(stats[0, :21], scale)
    assert (stats[1:, :21] >= 0).all() and (stats[:, 21:] == 0).all() and (codes[1, :, 20:] == 128).all()
    approx = scale[:, None].double() * q.double()
    assert (stats[1, :21].double() >= (w.double() - approx).norm(dim=1)).all()
    assert (stats[2, :21].double() >= approx.norm(dim=1)).all()
    packed[4, 0:2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # a float16 infinity as the scale
    with pytest.raises(ValueError, match="NaN or an infinity"):
        greedy_head.head_codes(packed, "Q8_0", 64)


def test_bad_arguments_are_refused_by_name(native):
    x, packed, K = case("Q8_0", 40, 2, 3, seed=0)
    codes, stats = greedy_head.head_codes(packed, "Q8_0", K)
    op = torch.ops.dartree.greedy_head.default
    bad = [
        (lambda: op(x.bfloat16(), codes, stats, packed, 8, K), "float32"),
        (lambda: op(x, codes[:1], stats, packed, 8, K), "codes must be uint8"),
        (lambda: op(x, codes.int(), stats, packed, 8, K), "codes must be uint8"),
        (lambda: op(x, codes, stats[:, :16], packed, 8, K), "stats must be float32"),
        (lambda: op(x, codes, stats, packed[:20], 8, K), "codes must be uint8"),
        (lambda: op(x, codes, stats, packed, 8, 32), r"x must be \[M, 32\]"),
        (lambda: op(x, codes, stats, packed, 99, K), "not supported"),
        (lambda: ops.greedy_head(x, codes, stats, packed[:20], "Q8_0", K), "codes must be uint8"),
        (lambda: ops.greedy_head_bounds(x[:, :48], codes, stats, 40), "multiple of 32"),
        (lambda: ops.greedy_head_bounds(x, codes, stats, 0), "V must be positive"),
        (lambda: torch.ops.dartree.greedy_head_bounds.default(x, codes, stats, 0), "V must be positive"),
    ]
    for call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()


_ISA_CHECK = """
import random, torch
from dartree import gguf_blocks, greedy_head, ops
from dartree.testing import random_packed
torch.manual_seed(0)
for qtype, V, T in (("Q8_0", 200, 9), ("Q6_K", 37, 3), ("Q4_1", 16, 1)):
    K = gguf_blocks.block_type(qtype).block_size * (1 if qtype.endswith("K") else 3)
    packed = random_packed(qtype, V, K, 1)
    x = torch.randn(T, K)
    codes, stats = greedy_head.head_codes(packed, qtype, K)
    want = ops.sample_keyed(ops.packed_linear(x, packed, qtype, K), torch.zeros(T, dtype=torch.int64), 0, 0.0)
    assert torch.equal(ops.greedy_head(x, codes, stats, packed, qtype, K), want), qtype
    upper, lower = ops.greedy_head_bounds(x, codes, stats, V)
    exact = ops.packed_linear(x, packed, qtype, K)
    assert bool((lower <= exact).all() and (exact <= upper).all()), qtype
print("ok")
"""


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_every_cpu_path(native, isa):
    """Capped below AVX-512 the op takes the whole product; the bounds hold on every path."""
    run_isa_check(_ISA_CHECK, isa)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_verify_gives_the_argmax_of_the_targets_logits(tmp_path, arch):
    """A packed float32 model built by the test: every tree's greedy tokens are its logits' argmax,
    a prefill's last row alone has the bits of the whole prefill's, and the greedy decoders'
    tokens are those of the model's own greedy generate."""
    pytest.importorskip("gguf")  # the file is written with it
    pytest.importorskip("accelerate")
    import dartree
    from dartree.gguf import load_gguf
    from dartree.target import TargetModel
    from dartree.testing import write_gguf
    from dartree.tree import DraftTree

    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, arch, seed=2)
    model = load_gguf(path)
    target = TargetModel(model, feature_layers=[0], compile=False)
    prompt = torch.tensor([5, 17, 240, 3, 99, 7])
    target.allocate(64)
    last, last_features = target.prefill(prompt, last_only=True)
    target.allocate(64)
    logits, features = target.prefill(prompt)
    assert last.shape == (1, logits.shape[1]) and torch.equal(last, logits[-1:])  # packed: row-invariant
    assert torch.equal(last_features, features)
    g = torch.Generator().manual_seed(0)
    for size in (1, 2, 9, 17):
        tree = DraftTree.chain(torch.randint(0, target.vocab_size, (size,), generator=g))
        tokens, _ = target.verify(tree, greedy=True)
        logits, _ = target.verify(tree)
        assert torch.equal(tokens, dartree.sampling.Sampling().tokens(logits, tree.depths)), size
    assert (target._greedy_head() is not None) == FAST
    if FAST:  # one head per layer, whatever the targets over it; rebuilt when its rows change
        layer = model.get_output_embeddings()
        assert TargetModel(model, feature_layers=[0], compile=False)._greedy_head() is target._greedy_head()
        before = target._greedy_head()
        layer.packed[0, 2] ^= 1  # a code of the first row, written in place
        rebuilt = target._greedy_head()
        assert rebuilt is not before
        assert torch.equal(rebuilt.codes, greedy_head.head_codes(layer.packed, layer.qtype, layer.in_features)[0])
    ids = torch.tensor([[7, 3, 250, 11, 42, 9]])
    want = model.generate(ids, do_sample=False, max_new_tokens=16, pad_token_id=0)[0, 6:].tolist()
    for method in ("ar", "ngram"):
        dec = dartree.SpeculativeDecoder(model, None, method=method)
        assert dec.generate(ids, max_new_tokens=16).tokens == want, method
