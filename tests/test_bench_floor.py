"""dartree.bench.floor: machine rates, the bytes and FLOPs of each stage, stage timers, the table."""

import math

import pytest
import torch

from dartree.bench.floor import (MachineRates, StageCost, copy_bandwidth, drafter_cost, format_floor_table,
                                 gemm_rate, measure_stages, target_cost)

from helpers import make_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

H, I, HQ, HKV, D, V = 64, 128, 4, 2, 16, 256  # tiny_target's shapes (llama: D = H / HQ)


def test_target_cost_by_hand():
    model = tiny_target(kind="llama", layers=2)
    rows, prefix = 5, 11
    layer_linear = H * HQ * D + 2 * H * HKV * D + HQ * D * H + 3 * H * I
    layer_params = layer_linear + 2 * H                       # + two RMSNorm weights
    weights = 4 * (2 * layer_params + H + V * H + rows * H)   # + final norm, LM head, gathered embedding rows
    kv = 4 * 2 * 2 * HKV * D * (prefix + rows + rows)         # read prefix + rows keys, write rows
    logits = 4 * rows * V
    flops = 2 * rows * (2 * layer_linear + V * H) + 2 * 4 * HQ * rows * (prefix + rows) * D
    assert target_cost(model, rows, prefix) == (weights + kv + logits, flops)


def test_tied_lm_head_is_read_once():
    model = tiny_target(kind="llama", layers=2)
    untied = target_cost(model, 3, 7)[0]
    model.lm_head.weight = model.model.embed_tokens.weight  # tie
    assert target_cost(model, 3, 7)[0] == untied - 4 * 3 * H  # no separate embedding gather


@pytest.mark.parametrize("tied", [True, False])
def test_packed_target_reads_its_packed_rows(tmp_path, tied):
    """A GGUF model kept packed does the dequantised model's FLOPs but reads its packed rows."""
    from dartree.gguf import PackedLinear, load_gguf
    from dartree.testing import write_gguf
    from test_gguf import _hf_model

    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", tied=tied)
    packed, dense = load_gguf(path), _hf_model(path)
    rows, prefix = 3, 7
    (packed_bytes, packed_flops), (dense_bytes, dense_flops) = (target_cost(packed, rows, prefix),
                                                                target_cost(dense, rows, prefix))
    assert packed_flops == dense_flops
    linears = {n: m for n, m in packed.named_modules() if isinstance(m, PackedLinear)}
    float_weights = sum(4 * dense.get_submodule(n).weight.numel() for n in linears)
    rows_read = sum(m.packed.numel() for m in linears.values())  # bytes (uint8)
    if tied:  # the head is the embedding: read once, no separate gather
        assert packed.lm_head.packed.data_ptr() == packed.model.embed_tokens.packed.data_ptr()
    else:  # three embedding rows gathered: packed rows instead of float rows
        embed = packed.model.embed_tokens.packed
        rows_read += rows * embed.shape[1] - rows * 4 * dense.model.embed_tokens.weight.shape[1]
    assert packed_bytes == dense_bytes - float_weights + rows_read


def test_drafter_cost_by_hand():
    target = tiny_target(kind="llama", layers=4)
    drafter = make_drafter(target, block_size=8)
    n, s, B, k = 3, 20, 8, drafter.num_slots
    cfg = drafter.config
    nf = len(drafter.target_layer_ids)
    dq, dkv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    own = sum(p.numel() for name, p in drafter.named_parameters() if not name.startswith("head."))
    weights = 4 * (own + V * H)
    kv = 4 * cfg.num_layers * 2 * dkv * ((s + B) + n + B)
    flops = (2 * n * nf * H * H
             + cfg.num_layers * (2 * B * (H * dq + dq * H + 3 * H * inter) + 2 * (n + B) * 2 * H * dkv
                                 + 4 * cfg.num_heads * B * (s + B) * cfg.head_dim)
             + 2 * k * V * H)
    assert drafter_cost(drafter, n, s) == (weights + kv + 4 * k * V, flops)


def test_floor_is_the_larger_term():
    rates = MachineRates(copy_bytes_per_s=1e9, gemm_flops_per_s={"float32": 1e10, "bfloat16": 1e11},
                         copy_bytes=0, gemm_size=0)
    stage = StageCost("verify 8", 8, seconds=0.5, bytes=int(2e8), flops=int(1e9))
    assert stage.floor_s(rates, torch.float32) == pytest.approx(0.2) and stage.bound(rates, "float32") == "memory"
    compute = StageCost("verify 64", 64, seconds=1.0, bytes=int(1e8), flops=int(5e9))
    assert compute.floor_s(rates, "float32") == pytest.approx(0.5)
    assert compute.bound(rates, "float32") == "compute" and compute.bound(rates, torch.bfloat16) == "memory"
    table = format_floor_table([stage, compute], rates, torch.float32)
    assert "| verify 8 | 8 | 500.00 | 200.0 | 1.000 | 200.00 | memory | **2.50×** |" in table
    assert "| verify 64 | 64 | 1000.00 | 100.0 | 5.000 | 500.00 | compute | **2.00×** |" in table


def test_machine_rates_are_measured():
    bw = copy_bandwidth(1 << 20, repeats=2, warmup=1)
    assert math.isfinite(bw) and bw > 1e6
    for dtype in (torch.float32, torch.bfloat16):
        rate = gemm_rate(dtype, size=64, repeats=2, warmup=1)
        assert math.isfinite(rate) and rate > 1e6
    with pytest.raises(ValueError, match="size must be >= 1"):
        gemm_rate(torch.float32, size=0)
    with pytest.raises(ValueError, match="nbytes must be >= 4"):
        copy_bandwidth(0)


def test_stages_are_timed_on_tiny_models():
    target = tiny_target(kind="llama", layers=2)
    drafter = make_drafter(target, block_size=8)
    stages = measure_stages(target, drafter, prefix_len=16, tree_sizes=(1, 4), context_rows=2, repeats=1,
                            ar_steps=3)
    assert [s.name for s in stages] == ["ar step", "verify 1", "verify 4", "drafter pass"]
    assert [s.rows for s in stages] == [1, 1, 4, drafter.num_slots]
    assert all(s.seconds > 0 and s.bytes > 0 and s.flops > 0 for s in stages)
    assert stages[2].flops > stages[1].flops


def test_stages_without_a_drafter_skip_its_pass():
    target = tiny_target(kind="qwen3", layers=2)
    stages = measure_stages(target, None, prefix_len=16, tree_sizes=(1, 2), repeats=1, ar_steps=3)
    assert [s.name for s in stages] == ["ar step", "verify 1", "verify 2"]
