"""Times of a call after warm-up: the one timer of `dartree bench` and the scripts under bench/."""

from __future__ import annotations

import time
from typing import Callable

import torch


def call_seconds(call: Callable[[], object], repeats: int, warmup: int = 1,
                 device: torch.device | str | None = None) -> list[float]:
    """Seconds of each of `repeats` calls of `call`, after `warmup` untimed ones.

    device: where the call's work runs. On a CUDA device each call is timed by CUDA events recorded
    before and after it on the current stream (the time between them on the GPU, gaps while the
    host launches included; the timer waits for the second); otherwise by the wall clock, with no
    device sync.
    """
    for _ in range(warmup):
        call()
    on_cuda = device is not None and torch.device(device).type == "cuda"
    return [(_cuda_seconds if on_cuda else _wall_seconds)(call) for _ in range(repeats)]


def _wall_seconds(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _cuda_seconds(call):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3
