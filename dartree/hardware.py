"""What this machine has, and the defaults that follow from it.

The CPU's vendor (it picks the float32 GEMV routing, `linear_routing.gemv_rows`) and whether it has
AMX tiles (it picks the default tree budget, `default_budget`)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def vendor() -> str:
    """vendor_id: GenuineIntel, AuthenticAMD, ...; "" where unknown."""
    return _cpuinfo().get("vendor_id", "")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (avx2, avx512_vnni, amx_bf16, ...)."""
    return frozenset(_cpuinfo().get("flags", "").split())


def has_amx_bf16() -> bool:
    """Whether the CPU (and the kernel) offer AMX-BF16 tiles, on which a 16-row bfloat16 product
    costs about what a one-row one does."""
    return "amx_bf16" in cpu_flags()


# Default draft nodes per round, by (device kind, 16- or 32-bit); "cpu-amx": a CPU with AMX-BF16.
# Why: the verify pass is memory-bound on a GPU (a large tree costs about what one token does) and
# compute-bound on a CPU (small trees win). A tree of budget + 1 rows that is a multiple of 16 fills
# the AMX and tensor-core tiles, and a 17th row costs a second AMX tile
# (bench/results/budget_tiles/). On AMX a 16-row bfloat16 verify costs little more than a one-token
# step, so budget 15 is within reach of the best measured budget; float32 there, and either dtype
# on a CPU without AMX, take the smallest budgets measured fastest. Figures: with AMX
# bench/results/smollm2_bf16_exact/ and smollm2_f32/; without, smollm2_bf16_exact_epyc/ and
# smollm2_f32_epyc/.
DEFAULT_BUDGETS = {("cuda", 16): 63, ("cuda", 32): 63, ("cpu-amx", 16): 15, ("cpu-amx", 32): 4,
                   ("cpu", 16): 4, ("cpu", 32): 2}


def default_budget(device: torch.device, dtype: torch.dtype) -> int:
    """DEFAULT_BUDGETS for a target on `device` in `dtype` (float64 counts as 32-bit; an unknown
    device type takes CUDA's)."""
    bits = 16 if torch.finfo(dtype).bits == 16 else 32
    kind = "cpu-amx" if device.type == "cpu" and has_amx_bf16() else device.type
    return DEFAULT_BUDGETS.get((kind, bits), DEFAULT_BUDGETS[("cuda", bits)])


def auto_max_nodes(device: torch.device) -> int:
    """The largest tree (candidates, root excluded) budget="auto" may choose: 63 on a GPU, where
    64 rows verify for about one; 31 on a CPU, where rows cost arithmetic and the planner's
    measurements rarely pick more than a few."""
    return 31 if device.type == "cpu" else 63
