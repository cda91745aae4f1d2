"""Wall-clock times of a CPU call after warm-up: one timer for the bench scripts."""

from __future__ import annotations

import time
from typing import Callable


def call_seconds(call: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of `call`, after `warmup` untimed ones (CPU: no device
    sync; CUDA timings use events, bench/kernels.py)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times
