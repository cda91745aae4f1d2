import pytest
import torch

from dartree import ops, reference


def random_path(tree_len, length, generator):
    """A strictly increasing index list starting at the root 0."""
    rest = torch.randperm(tree_len - 1, generator=generator)[:length - 1] + 1
    return torch.cat([torch.zeros(1, dtype=torch.long), rest.sort().values])


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SHAPES = [(2, 2, 1, 3, 40, 16), (1, 2, 1, 1, 9, 7), (3, 2, 1, 2, 70, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(native, device, dtype, shape):
    # a seed fixed by the case (hash() of a str changes from run to run with PYTHONHASHSEED)
    g = torch.Generator().manual_seed(100 * SHAPES.index(shape) + DTYPES.index(dtype))
    seq = shape[-2]
    for prefix, tree_len, length in [(0, 1, 1), (3, 5, 5), (seq - 6, 6, 3), (1, seq - 1, 4)]:
        kv = torch.randn(shape, generator=g).to(dtype).to(device)
        accepted = random_path(tree_len, min(length, tree_len), g).to(device)
        expected = kv.clone()
        reference.kv_commit(expected, prefix, accepted)
        ops.kv_commit(kv, prefix, accepted)
        assert torch.equal(kv, expected), (prefix, accepted.tolist())


@pytest.mark.parametrize("shape", [(2, 10, 0), (0, 3, 10, 8), (2, 0, 10, 0)])
def test_empty_shapes(native, device, shape):
    """Empty rows (D = 0) or no row groups: nothing to move, and no crash (no division by D)."""
    kv = torch.zeros(shape, device=device)
    ops.kv_commit(kv, 2, torch.tensor([0, 3], device=device))
    torch.ops.dartree.kv_commit(kv, 2, torch.tensor([0, 3], device=device))
    assert kv.shape == shape
    with pytest.raises(ValueError, match="outside the cache"):
        ops.kv_commit(kv, 2, torch.tensor([0, 9], device=device))


def test_reference_semantics():
    kv = torch.arange(24.).reshape(1, 6, 4)
    reference.kv_commit(kv, 1, torch.tensor([0, 2, 4]))
    rows = kv[0, :, 0].tolist()
    assert rows == [0.0, 4.0, 12.0, 20.0, 16.0, 20.0]  # rows 1,3,5 moved to 1,2,3; rest untouched


def test_one_launch_moves_every_layer(native):
    kv = torch.randn(4, 2, 1, 2, 10, 8)
    before = kv.clone()
    ops.kv_commit(kv, 2, torch.tensor([0, 3, 7]))
    for src, dst in [(2, 2), (5, 3), (9, 4)]:
        assert torch.equal(kv[..., dst, :], before[..., src, :])


@pytest.mark.parametrize("bad, match", [
    (dict(accepted=torch.tensor([1, 2])), "accepted\\[0\\] must be 0"),
    (dict(accepted=torch.tensor([0, 3, 2])), "strictly increasing"),
    (dict(accepted=torch.tensor([0, 50])), "outside the cache"),
    (dict(accepted=torch.tensor([0, 1], dtype=torch.int32)), "int64"),
    (dict(accepted=torch.tensor([[0, 1]])), "1-D"),
    (dict(accepted=torch.tensor([], dtype=torch.long)), "at least the root|non-empty"),
    (dict(prefix_len=9), "exceeds the cache length"),
    (dict(prefix_len=-1), "exceeds the cache length"),
    (dict(kv=torch.randn(2, 10, 8).transpose(0, 1)), "contiguous"),
])
@pytest.mark.parametrize("use_reference", [False, True])
def test_bad_input(native, bad, match, use_reference):
    args = dict(kv=torch.randn(2, 10, 8), prefix_len=2, accepted=torch.tensor([0, 1]))
    args.update(bad)
    with ops.reference_ops(use_reference), pytest.raises(ValueError, match=match):
        ops.kv_commit(**args)


def test_opcheck_and_compile(native):
    kv = torch.randn(2, 2, 1, 2, 12, 8)
    accepted = torch.tensor([0, 2, 5])
    torch.library.opcheck(torch.ops.dartree.kv_commit.default, (kv, 3, accepted))

    @torch.compile(fullgraph=True)
    def commit(kv, accepted):
        torch.ops.dartree.kv_commit(kv, 3, accepted)
        return kv * 1

    expected = kv.clone()
    reference.kv_commit(expected, 3, accepted)
    assert torch.equal(commit(kv, accepted), expected)


def test_write_rows_opcheck(device):
    """`dartree::write_rows` (a Python custom op: no extension needed) stands in for the two slice
    copies inside compiled graphs; its registration must agree with them."""
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 2, 1, 3, 12, 8, generator=g).to(device)
    key, value = (torch.randn(1, 3, 4, 8, generator=g).to(device) for _ in range(2))
    torch.library.opcheck(torch.ops.dartree.write_rows.default, (cache, 1, 5, key, value))
    expected = cache.clone()
    expected[1, 0, ..., 5:9, :], expected[1, 1, ..., 5:9, :] = key, value
    torch.ops.dartree.write_rows(cache, 1, 5, key, value)
    assert torch.equal(cache, expected)
    ops.write_rows(cache, 0, 0, key, value)  # eager: the slice copies themselves
    expected[0, 0, ..., :4, :], expected[0, 1, ..., :4, :] = key, value
    assert torch.equal(cache, expected)
