"""sample_keyed: the kernels equal dartree.reference bit for bit (fresh random logits, awkward
shapes, ties, NaN/inf, peaked rows where the CPU kernel skips most tokens), the reference equals
a scalar transcription of the C formula, rows are independent of their batch, the samples have
the softmax distribution, bad input is refused; opcheck and torch.compile. CUDA cases skip
without a GPU."""

import struct

import numpy as np
import pytest
import torch

from dartree import ops, reference

from helpers import chi_square_p_value

SEEDS = [0, 1, 12345, 2**63 + 5, 2**64 - 1]
POISON = -7777


def random_logits(rows, vocab, scale, dtype, generator):
    return (torch.randn(rows, vocab, generator=generator) * scale).to(dtype)


def random_positions(rows, generator):
    return torch.randint(-2**62, 2**62, (rows,), generator=generator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 7), (17, 1000), (5, 4099), (0, 10), (65, 257)])
def test_matches_reference(native, device, dtype, rows, vocab):
    g = torch.Generator().manual_seed(rows * 7919 + vocab)
    for scale, temperature in [(0.1, 1.0), (3.0, 1.0), (3.0, 0.7), (30.0, 1.0), (10.0, 0.25),
                               (3.0, 3.3), (3.0, 0.0)]:
        logits = random_logits(rows, vocab, scale, dtype, g)
        positions = random_positions(rows, g)
        for seed in SEEDS[::2] if vocab > 1000 else SEEDS:
            expected = reference.sample_keyed(logits, positions, seed, temperature)
            got = ops.sample_keyed(logits.to(device), positions.to(device), seed, temperature)
            assert torch.equal(got.cpu(), expected), (scale, temperature, seed)


def test_raw_op_writes_every_token(native, device):
    g = torch.Generator().manual_seed(3)
    logits, positions = random_logits(9, 300, 2.0, torch.float32, g), random_positions(9, g)
    tokens = torch.full((9,), POISON, dtype=torch.int64, device=device)
    torch.ops.dartree.sample_keyed(logits.to(device), positions.to(device), -5, 0.9, tokens)
    # the op takes the seed's int64 bits: -5 is 2**64 - 5
    assert torch.equal(tokens.cpu(), reference.sample_keyed(logits, positions, 2**64 - 5, 0.9))


def test_reference_equals_the_scalar_formula():
    """The int64-tensor hash (wrapping products, logical shifts) and the float steps, against a
    transcription of sample_keyed.cuh in Python ints and numpy float32 scalars."""
    mask = (1 << 64) - 1
    f32 = np.float32

    def mix(x):
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & mask
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    def log_keyed(x):
        ix = (struct.unpack("I", struct.pack("f", x))[0] + 0x3F800000 - 0x3F3504F3) & 0xFFFFFFFF
        f = f32(struct.unpack("f", struct.pack("I", (ix & 0x7FFFFF) + 0x3F3504F3))[0]) - f32(1)
        c = lambda h: f32(float.fromhex(h))  # noqa: E731
        s = f / (f32(2) + f)
        z = s * s
        w = z * z
        r = z * (c("0x1.555554p-1") + w * c("0x1.23d3dcp-2")) + w * (c("0x1.999c26p-2") + w * c("0x1.f13c4cp-3"))
        hfsq = (f32(0.5) * f) * f
        dk = f32((ix >> 23) - 0x7F)
        return (((s * (hfsq + r) + dk * c("0x1.2fefa2p-17")) - hfsq) + f) + dk * c("0x1.62e3p-1")

    def gumbel(seed, position, v):
        row = mix((mix(seed ^ 0x5851F42D4C957F2D) + (position & mask) * 0x9E3779B97F4A7C15) & mask)
        bits = mix((row + (v + 1) * 0x9E3779B97F4A7C15) & mask)
        return -log_keyed(-log_keyed(f32(2 * (bits >> 41) + 1) * f32(2.0 ** -24)))

    positions = torch.tensor([0, 5, -7, 2**62, 2**63 - 1])
    for seed in SEEDS:
        noise = reference.keyed_gumbel(seed, positions, torch.arange(40))
        expected = [[float(gumbel(seed, int(p), v)) for v in range(40)] for p in positions]
        assert noise.tolist() == expected


def test_log_and_noise_range():
    x = torch.cat([torch.rand(100_000, dtype=torch.float64) * 20, torch.tensor([2.0 ** -24, 1.0])])
    x = x.float().clamp(min=2.0 ** -24)
    exact = x.double().log()
    err = (reference._log_keyed(x).double() - exact).abs() / exact.abs().clamp(min=2.0 ** -126)
    assert float(err[exact != 0].max()) < 2.5e-7
    assert float(reference._log_keyed(torch.tensor([1.0]))) == 0.0
    # the extreme noise values (u = 2^-24, 1 - 2^-24) lie below the CPU kernel's kGumbelHi
    u = torch.tensor([2.0 ** -24, 1 - 2.0 ** -24])
    lo, hi = (-reference._log_keyed(-reference._log_keyed(u))).tolist()
    assert -2.82 < lo < -2.81 and 16.63 < hi < 16.64 < 16.7


def test_rows_do_not_depend_on_the_batch(native, device):
    g = torch.Generator().manual_seed(5)
    logits = random_logits(33, 500, 2.0, torch.float32, g).to(device)
    positions = random_positions(33, g).to(device)
    batch = ops.sample_keyed(logits, positions, 7, 1.0)
    for t in (0, 11, 32):
        assert int(ops.sample_keyed(logits[t:t + 1], positions[t:t + 1], 7, 1.0)) == int(batch[t])
    shuffled = torch.randperm(33, generator=g).to(device)
    assert torch.equal(ops.sample_keyed(logits[shuffled], positions[shuffled], 7, 1.0), batch[shuffled])


def test_ties_nan_and_infinities(native, device):
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0],
                         [-inf, -inf, -inf, -inf],
                         [0.0, nan, 5.0, nan],
                         [-inf, 2.0, -inf, -inf],
                         [inf, 0.0, inf, 1.0],
                         [-0.0, 0.0, -1.0, -2.0]])
    positions = torch.arange(6)
    greedy = ops.sample_keyed(rows.to(device), positions.to(device), 3, 0.0).cpu()
    assert greedy.tolist() == [1, 0, 1, 1, 0, 0]
    for seed in range(20):
        sampled = ops.sample_keyed(rows.to(device), positions.to(device), seed, 1.0).cpu()
        assert torch.equal(sampled, reference.sample_keyed(rows, positions, seed, 1.0))
        assert sampled[1:5].tolist() == [0, 1, 1, 0]  # all -inf: id 0; NaN first; one finite; inf ties
    same = torch.zeros(3, 50)
    assert ops.sample_keyed(same.to(device), torch.zeros(3, dtype=torch.long, device=device), 1, 0.0).tolist() == [0] * 3


def test_peaked_rows_near_the_skip_bound(native):
    """Rows with many tokens near the CPU kernel's skip bound (best score - kGumbelHi): the skip
    must keep every token that can win (the reference scans all)."""
    g = torch.Generator().manual_seed(11)
    for temperature in (1.0, 0.5, 2.0):
        logits = torch.full((400, 300), -1e4)
        logits[:, 0] = 0.0
        logits[:, 1:200] = -temperature * (19.0 + torch.rand(400, 199, generator=g))
        logits[:, 200:] = -temperature * torch.rand(400, 100, generator=g) * 30 - 5
        positions = torch.arange(400)
        for seed in (0, 99):
            assert torch.equal(ops.sample_keyed(logits, positions, seed, temperature),
                               reference.sample_keyed(logits, positions, seed, temperature))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_samples_follow_the_softmax(native, temperature):
    """One logits row at 20000 positions, and at one position over 3000 seeds: the token
    frequencies fit softmax(logits / T), and not softmax at another temperature."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    probs = torch.softmax(logits.double() / temperature, -1)
    draws = ops.sample_keyed(logits.expand(20000, -1).contiguous(), torch.arange(20000), 42, temperature)
    counts = torch.bincount(draws, minlength=8).double()
    assert chi_square_p_value(counts, probs) > 1e-3
    wrong = torch.softmax(logits.double() / (temperature * 1.3), -1)
    assert chi_square_p_value(counts, wrong) < 1e-6
    by_seed = torch.tensor([int(ops.sample_keyed(logits[None], torch.tensor([77]), seed, temperature))
                            for seed in range(3000)])
    assert chi_square_p_value(torch.bincount(by_seed, minlength=8).double(), probs) > 1e-3


def test_successive_positions_are_independent(native):
    """Pairs of tokens at positions (2i, 2i + 1) of one row: their joint is the product."""
    logits = torch.tensor([1.0, 0.0, -0.5, 0.7])
    draws = ops.sample_keyed(logits.expand(40000, -1).contiguous(), torch.arange(40000), 5, 1.0)
    pairs = draws.view(-1, 2)
    counts = torch.bincount(pairs[:, 0] * 4 + pairs[:, 1], minlength=16).double()
    probs = torch.softmax(logits.double(), -1)
    assert chi_square_p_value(counts, (probs[:, None] * probs[None]).flatten()) > 1e-3


@pytest.mark.parametrize("bad, match", [
    (dict(logits=torch.randn(4)), "logits must be"),
    (dict(logits=torch.randint(0, 3, (3, 5))), "logits must be"),
    (dict(logits=torch.randn(3, 0)), "at least one token"),
    (dict(positions=torch.arange(4)), "positions must be"),
    (dict(positions=torch.arange(3, dtype=torch.int32)), "positions must be"),
    (dict(positions=torch.arange(3)[None]), "positions must be"),
    (dict(seed=-1), "seed must be"),
    (dict(seed=2**64), "seed must be"),
    (dict(seed=1.5), "seed must be"),
    (dict(temperature=-0.1), "temperature must be"),
    (dict(temperature=float("nan")), "temperature must be"),
    (dict(temperature=float("inf")), "temperature must be"),
    (dict(temperature=1e-40), "out of range"),
    (dict(temperature=1e300), "out of range"),
])
@pytest.mark.parametrize("use_reference", [False, True])
def test_bad_input(native, bad, match, use_reference):
    args = dict(logits=torch.randn(3, 5), positions=torch.arange(3), seed=1, temperature=1.0)
    args.update(bad)
    with ops.reference_ops(use_reference), pytest.raises(ValueError, match=match):
        ops.sample_keyed(**args)


@pytest.mark.parametrize("bad, match", [
    (dict(logits=torch.randn(3, 5, 2)), "logits must be \\[T, V\\]"),
    (dict(logits=torch.randn(3, 0)), "at least one token"),
    (dict(logits=torch.randint(0, 3, (3, 5))), "float32, float64"),
    (dict(logits=torch.randn(5, 3).t()), "logits must be contiguous"),
    (dict(positions=torch.arange(4)), "positions must be \\[3\\]"),
    (dict(positions=torch.arange(3, dtype=torch.int32)), "positions must be int64"),
    (dict(tokens=torch.empty(2, dtype=torch.long)), "tokens must be \\[3\\]"),
    (dict(tokens=torch.empty(3)), "tokens must be int64"),
    (dict(tokens=torch.empty(6, dtype=torch.long)[::2]), "tokens must be contiguous"),
    (dict(temperature=-1.0), "temperature must be"),
    (dict(temperature=1e-300), "out of range"),
])
def test_bad_input_kernel_checks(native, bad, match):
    """The C++ checks, for callers of torch.ops.dartree.sample_keyed itself."""
    args = dict(logits=torch.randn(3, 5), positions=torch.arange(3), seed=1, temperature=1.0,
                tokens=torch.empty(3, dtype=torch.long))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        torch.ops.dartree.sample_keyed(**args)


def test_opcheck_and_compile(native):
    logits, positions = torch.randn(4, 33), torch.arange(10, 14)
    for temperature in (1.0, 0.0):
        torch.library.opcheck(torch.ops.dartree.sample_keyed.default,
                              (logits, positions, 3, temperature, torch.empty(4, dtype=torch.long)))

    @torch.compile(fullgraph=True)
    def sample(logits, positions):
        tokens = torch.empty(logits.shape[0], dtype=torch.long)
        torch.ops.dartree.sample_keyed(logits, positions, 3, 1.0, tokens)
        return tokens + 0

    assert torch.equal(sample(logits, positions), reference.sample_keyed(logits, positions, 3, 1.0))



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 31, 1000, 49152, 49155])
def test_argmax_is_torch_argmax(native, dtype, vocab):
    """Temperature 0 on the CPU (two vector passes where the CPU has AVX2, the comparison loop
    elsewhere) returns torch.argmax's token: fresh random rows, rows of few distinct values (ties
    at every position of a vector), the top in the tail, NaN (the first one wins), all -inf, -0.0
    against 0.0; the output poisoned before the run."""
    g = torch.Generator().manual_seed(vocab)
    rows = [torch.randn(vocab, generator=g), torch.randint(-2, 3, (vocab,), generator=g).float(),
            torch.full((vocab,), -float("inf")), torch.zeros(vocab)]
    for _ in range(4):
        tie = torch.randint(-3, 1, (vocab,), generator=g).float()
        tie[torch.randint(0, vocab, (2,), generator=g)] = 1.0  # two tops (or one), anywhere
        rows.append(tie)
        nan = torch.randn(vocab, generator=g)
        nan[torch.randint(0, vocab, (2,), generator=g)] = float("nan")
        rows.append(nan)
    signed = torch.full((vocab,), -1.0)
    signed[vocab // 2:] = 0.0
    signed[vocab // 3] = -0.0
    rows += [signed, -signed]
    tail = torch.randn(vocab, generator=g)
    tail[-1] = 10.0  # in the scalar tail when vocab is not a multiple of 8
    rows.append(tail)
    logits = torch.stack(rows).to(dtype)
    out = torch.full((logits.shape[0],), POISON, dtype=torch.int64)
    torch.ops.dartree.sample_keyed.default(logits, torch.arange(logits.shape[0]), 0, 0.0, out)
    assert torch.equal(out, logits.float().argmax(dim=-1))
    assert torch.equal(out, reference.sample_keyed(logits, torch.arange(logits.shape[0]), 0, 0.0))


def test_argmax_without_avx2(native):
    """The comparison loop (DARTREE_EXACT_ISA=portable) returns the same tokens."""
    from dartree.testing import rerun_capped
    rerun_capped(__file__, "test_argmax_is_torch_argmax", "portable")
