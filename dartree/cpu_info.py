"""What the CPU is, where dartree's speed choices depend on it: its vendor (float32 GEMV routing,
`target.gemv_rows`) and AMX (the default CPU tree budget, `decoding.default_budget`)."""

from __future__ import annotations

import functools


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


def has_amx_bf16() -> bool:
    """Whether the CPU (and the kernel) offer AMX-BF16 tiles, on which a 16-row bfloat16 product
    costs about what a one-row one does."""
    return "amx_bf16" in _cpuinfo().get("flags", "").split()
