"""dartree.kv_cache.StaticKVCache: allocation, reuse, room and commit."""

import pytest
import torch

from dartree import reference
from dartree.kv_cache import StaticKVCache


def test_allocate_shapes_zeros_and_reuse():
    cache = StaticKVCache(3, 2, 4, batch_dims=(1,))  # the target's layout
    with pytest.raises(RuntimeError, match="call allocate"):
        cache.check_allocated()
    assert cache.allocate(5, torch.float32, torch.device("cpu"))
    kv = cache.tensor
    assert kv.shape == (3, 2, 1, 2, 5, 4) and kv.dtype == torch.float32 and not kv.any()
    assert (cache.max_len, cache.length) == (5, 0)
    cache.length = 3
    assert not cache.allocate(5, torch.float32, torch.device("cpu"))  # kept, length reset
    assert cache.tensor is kv and cache.length == 0
    assert cache.allocate(5, torch.float64, torch.device("cpu")) and cache.tensor.dtype == torch.float64
    assert cache.allocate(7, torch.float64, torch.device("cpu")) and cache.tensor.shape[4] == 7
    cache.free()
    assert cache.tensor is None and cache.max_len == 0


def test_the_drafter_layout_and_refusals():
    cache = StaticKVCache(2, 3, 8, zeros=False)  # [L, 2, Hkv, max_len, D], uninitialised
    assert cache.allocate(6, torch.bfloat16, torch.device("cpu"))
    assert cache.tensor.shape == (2, 2, 3, 6, 8) == cache.shape(6)
    cache.mark_dynamic()
    cache.check_fits(6)
    with pytest.raises(ValueError, match=r"context of 7 tokens exceeds the cache \(max_len 6\)"):
        cache.check_fits(7)
    with pytest.raises(ValueError, match="max_len must be >= 1, got 0"):
        cache.allocate(0, torch.bfloat16, torch.device("cpu"))


def test_commit_moves_the_accepted_rows_of_every_layer():
    cache = StaticKVCache(2, 1, 3, batch_dims=(1,))
    cache.allocate(8, torch.float32, torch.device("cpu"))
    cache.tensor.copy_(torch.randn(cache.tensor.shape))
    cache.length = 2
    before = cache.tensor.clone()
    expected = before.clone()
    accepted = torch.tensor([0, 2, 3])
    reference.kv_commit(expected, 2, accepted)
    cache.commit(accepted)
    assert torch.equal(cache.tensor, expected) and cache.length == 5
    assert torch.equal(cache.tensor[..., 2:5, :], before[..., [2, 4, 5], :])
