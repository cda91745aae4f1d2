"""GGUF block dequantisation: the bits of gguf-py's (what transformers' GGUF loader runs) for
every supported block type, on random blocks; other types refused by name."""

import numpy as np
import pytest
import torch

from dartree import gguf_blocks
from dartree.testing import random_packed

gguf_quants = pytest.importorskip("gguf.quants")

@pytest.mark.parametrize("qtype", list(gguf_blocks.BLOCK_TYPES))
@pytest.mark.parametrize("N,blocks_per_row", [(1, 1), (3, 2), (17, 5)])
def test_dequantize_matches_gguf_py_bitwise(qtype, N, blocks_per_row):
    t = gguf_blocks.block_type(qtype)
    K = blocks_per_row * t.block_size
    packed = random_packed(qtype, N, K, seed=N * 31 + blocks_per_row)
    ours = gguf_blocks.dequantize(packed, qtype, K)
    theirs = gguf_quants.dequantize(packed.numpy(), t.ggml_type)
    assert ours.dtype == torch.float32 and ours.shape == (N, K) and theirs.shape == (N, K)
    assert torch.equal(ours.view(torch.int32), torch.from_numpy(np.ascontiguousarray(theirs)).view(torch.int32))


def test_q4_1_values_by_hand():
    # one block: d = 0.5, m = -1, nibbles: byte i = (i % 16) | (15 - i % 16) << 4
    header = torch.tensor([0.5, -1.0], dtype=torch.float16).view(torch.uint8)
    qs = torch.tensor([(i % 16) | ((15 - i % 16) << 4) for i in range(16)], dtype=torch.uint8)
    w = gguf_blocks.dequantize(torch.cat([header, qs]).reshape(1, -1), "Q4_1", 32)
    expect = [0.5 * i - 1 for i in range(16)] + [0.5 * (15 - i) - 1 for i in range(16)]
    assert w[0].tolist() == expect


def test_unsupported_type_and_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="'IQ2_XXS' is not supported"):
        gguf_blocks.block_type("IQ2_XXS")
    with pytest.raises(ValueError, match="block type 10 is not supported"):
        gguf_blocks.block_type(10)  # Q2_K
    with pytest.raises(ValueError, match="multiple of Q4_K's block size 256, got 96"):
        gguf_blocks.row_bytes("Q4_K", 96)
    with pytest.raises(ValueError, match="have 20 bytes, got 21"):
        gguf_blocks.dequantize(torch.zeros(2, 21, dtype=torch.uint8), "Q4_1", 32)
    with pytest.raises(ValueError, match="2-D uint8"):
        gguf_blocks.dequantize(torch.zeros(2, 20), "Q4_1", 32)
