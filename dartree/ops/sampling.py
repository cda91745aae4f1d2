"""Sampling ops: `sample_keyed`, position-keyed Gumbel-max sampling (the same token for a position
and seed whatever the batch around it). Reference: `dartree.reference.sample_keyed`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import reference
from ._dispatch import _fake, _native

_LOGIT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def sample_keyed(logits: torch.Tensor, positions: torch.Tensor, seed: int,
                 temperature: float) -> torch.Tensor:
    """Position-keyed sampling: one token per row of logits, by Gumbel-max with keyed noise.

    logits:      [T, V] float32, float64, float16 or bfloat16 (read as float32)
    positions:   int64 [T]: row t is the logits of the token at absolute position positions[t]
                 (it predicts the token after it); any int64 is a valid key
    seed:        int in [0, 2^64)
    temperature: 0 means argmax (ties: lowest id); > 0 samples softmax(logits / temperature)
    returns      int64 [T]: argmax_v fl(fl(logits[t, v] * float32(1 / T)) + g(seed, positions[t], v)),
                 g Gumbel noise from a counter-based hash (`reference.keyed_gumbel`), computed on
                 the fly. Ties: lowest id; a NaN logit wins.

    Row t's token depends only on (logits[t], seed, positions[t], temperature): the same on the
    CPU, CUDA and the reference, bit for bit, whatever else is in the batch. So a verify row at
    position p samples exactly what a one-token step at p samples with that seed.

    >>> logits = torch.zeros(2, 5)
    >>> a = sample_keyed(logits, torch.tensor([7, 8]), seed=1, temperature=1.0)
    >>> b = sample_keyed(logits[1:], torch.tensor([8]), seed=1, temperature=1.0)
    >>> bool(a[1] == b[0])
    True
    """
    _check_sample_keyed(logits, positions, seed, temperature)
    signed_seed = seed - (1 << 64) if seed >= 1 << 63 else seed
    if not _native(logits, positions):
        return reference.sample_keyed(logits, positions, seed, float(temperature))
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    torch.ops.dartree.sample_keyed.default(logits.contiguous(), positions.contiguous(), signed_seed,
                                           float(temperature), tokens)
    return tokens


def _check_sample_keyed(logits, positions, seed, temperature):
    """The C++ checks (csrc/sample_checks.h) plus the seed's range, before either path."""
    if logits.dim() != 2 or logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"sample_keyed: logits must be a float32/float64/float16/bfloat16 [T, V] "
                         f"tensor, got {logits.dtype} {tuple(logits.shape)}")
    if logits.shape[1] < 1:
        raise ValueError("sample_keyed: logits must have at least one token (V >= 1)")
    if (positions.dim() != 1 or positions.dtype != torch.int64
            or positions.shape[0] != logits.shape[0]):
        raise ValueError(f"sample_keyed: positions must be int64 [{logits.shape[0]}] (one per "
                         f"logits row), got {positions.dtype} {tuple(positions.shape)}")
    if positions.device != logits.device:
        raise ValueError(f"sample_keyed: positions is on {positions.device} but logits is on "
                         f"{logits.device}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ValueError(f"sample_keyed: seed must be an int in [0, 2**64), got {seed!r}")
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature) or temperature < 0):
        raise ValueError(f"sample_keyed: temperature must be a finite number >= 0, got {temperature!r}")
    if temperature > 0:
        with np.errstate(over="ignore", under="ignore"):  # the kernels' float32 1 / temperature
            inv = float(np.float32(1.0 / temperature))
        if not math.isfinite(inv) or inv < torch.finfo(torch.float32).tiny:
            raise ValueError(f"sample_keyed: temperature {temperature} is out of range: "
                             "1 / temperature must be a normal float32")


@_fake("sample_keyed")
def _sample_keyed_fake(logits, positions, seed, temperature, tokens):
    torch._check(logits.dim() == 2, lambda: "sample_keyed: logits must be [T, V]")
    torch._check(positions.shape[0] == logits.shape[0],
                 lambda: "sample_keyed: positions must have one entry per logits row")
    return None
