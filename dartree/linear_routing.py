"""Which linear kernel a call takes: the vendor GEMM, or dartree's `ops.exact_linear`.

Two reasons send a call to `ops.exact_linear`:
- exact mode (`TargetModel(exact=True)`, `dartree.exact()`): every linear call, for the bits of
  one-token decoding (the kernel computes each output row on its own);
- speed (`gemv_rows`): calls of few rows on CPUs where the kernel beats the vendor GEMM there. No
  guarantee changes: nothing promises bits outside exact mode.

`stack_linear` picks the `linear` of `decoder_stack.forward`; `hf_linears` the context that routes
transformers' own forward; `gemv_linears` the context of the drafter's pass.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import exact_mode, hardware, ops
from .decoder_stack import Linear

# The most rows of a linear call that run faster on ops.exact_linear than on the vendor GEMM, by
# (dtype, CPU vendor; None: any vendor), on AVX-512 CPUs. Why these: the vendor GEMMs are tuned for
# many rows, while a call of few rows only streams the weights, where exact_linear's AVX-512 loop
# is faster: in bfloat16 on every vendor measured, in float32 only against MKL on AMD CPUs (Intel
# float32 stays on MKL: not measured). Per shape and per model: bench/results/gemv_routing.md
# (bench/exact_linear.py, bench/gemv_routing.py).
GEMV_ROWS = {(torch.bfloat16, None): 16, (torch.float32, "AuthenticAMD"): 32}


def gemv_rows(dtype: torch.dtype, device: torch.device) -> int:
    """Up to how many rows a linear call in `dtype` on `device` takes ops.exact_linear for speed
    (GEMV_ROWS; 0: never): AVX-512 CPUs only, where it was measured faster than the vendor GEMM,
    and only with dartree's kernels built."""
    if not (device.type == "cpu" and ops.exact_kernels_available(device)
            and torch.backends.cpu.get_cpu_capability().startswith("AVX512")):
        return 0
    return GEMV_ROWS.get((dtype, hardware.vendor()), GEMV_ROWS.get((dtype, None), 0))


class _SmallRowsLinear(TorchFunctionMode):
    """F.linear calls of at most `max_rows` rows on ops.exact_linear (only speed: no guarantee
    changes), the others on the vendor GEMM."""

    def __init__(self, max_rows):
        super().__init__()
        self.max_rows = max_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            if x.numel() <= self.max_rows * x.shape[-1]:
                return exact_mode.linear(*args, **kwargs)
        return func(*args, **kwargs)


def gemv_linears(dtype: torch.dtype, device: torch.device, max_rows: int | None = None):
    """Context: F.linear calls of <= max_rows (default `gemv_rows`) rows on ops.exact_linear
    where `gemv_rows` is not 0, else nothing. For code with no bit-level promise (the drafter's
    pass)."""
    rows = gemv_rows(dtype, device)
    return _SmallRowsLinear(rows if max_rows is None else max_rows) if rows else contextlib.nullcontext()


def stack_linear(exact: bool, gemv: bool, dtype: torch.dtype, device: torch.device) -> Linear:
    """The `linear` of a `decoder_stack.forward` call: ops.exact_linear's kernel for an `exact`
    call or a `gemv` one (few rows, see `gemv_rows`), the vendor GEMM (F.linear) for the rest.
    The kernel is called directly where it covers the dtype (not float64 on CUDA), else through
    `exact_mode.linear`."""
    if not (exact or gemv):
        return F.linear
    raw = ops.exact_kernels_available(device) and (device.type == "cpu" or dtype != torch.float64)
    return _kernel_linear if raw else exact_mode.linear


def hf_linears(exact: bool, max_rows: int):
    """Context for a call of transformers' own forward: `dartree.exact()` when `exact`, else
    calls of <= max_rows rows on ops.exact_linear (none when 0)."""
    if exact:
        return exact_mode.exact()
    return _SmallRowsLinear(max_rows) if max_rows else contextlib.nullcontext()


def _kernel_linear(x, weight, bias):
    """ops.exact_linear's compiled kernel on x [1, T, K] -> [1, T, N] without the Python wrapper's
    checks and dispatch (a tenth of a small call's time, paid by every linear layer of a step);
    the kernel's own TORCH_CHECKs still run."""
    return torch.ops.dartree.exact_linear.default(x[0], weight, bias)[None]
