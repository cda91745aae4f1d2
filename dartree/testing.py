"""Fixtures shared by tests/ and bench/: randomly initialised drafters, a drafter that knows
the target's continuation, random GGUF blocks. Not used by the engine itself."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import gguf_blocks
from .drafter import Drafter, config_for_target, target_io
from .drafter.config import module_dtype_device

# Byte offsets of each block type's float16 fields (scales, minimums): random_packed sets them to
# finite halves, as a random bit pattern there may be a NaN, whose payload no comparison defines.
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_packed(qtype: str, N: int, K: int, seed: int) -> torch.Tensor:
    """uint8 [N, gguf_blocks.row_bytes(qtype, K)]: N rows of random `qtype` blocks, their quant
    bytes uniform, their float16 fields ~ N(0, 0.02²) (typical GGUF scales)."""
    t = gguf_blocks.block_type(qtype)
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (N, gguf_blocks.row_bytes(qtype, K)), generator=g,
                           dtype=torch.uint8)
    blocks = packed.view(-1, t.type_size)
    for offset in F16_FIELDS[t.name]:
        half = (torch.randn(blocks.shape[0], generator=g) * 0.02).to(torch.float16)
        blocks[:, offset:offset + 2] = half.view(torch.uint8).reshape(-1, 2)
    return packed


def random_drafter(target: Any, num_layers: int = 1, block_size: int = 16, domino: bool = True,
                   seed: int = 0, **cfg: Any) -> Drafter:
    """A randomly initialised drafter shaped for ``target`` (tests, benchmarks).

    Shape as :func:`dartree.drafter.config_for_target` gives it (``cfg`` overrides any
    DrafterConfig field); linear/GRU weights ~ N(0, 0.02²), norms 1, biases 0. On the target's
    device in its dtype, eval mode.
    """
    config = config_for_target(target, num_layers=num_layers, block_size=block_size,
                               domino=domino, **cfg)
    embed = target_io(target)[0]
    generator = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        drafter = Drafter(config, target)
    for name, param in drafter.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(param)
        elif name.endswith("weight") or "weight_" in name:
            nn.init.normal_(param, std=0.02, generator=generator)
        else:
            nn.init.zeros_(param)
    dtype, device = module_dtype_device(embed)
    drafter.to(device=device, dtype=dtype)
    drafter.refresh_input_table()
    return drafter.eval()


class OracleDrafter:
    """Wraps a drafter so its base logits rank the target's greedy continuation first.

    `continuation` is the target's greedy output after `prompt`; at position s the slot for depth d
    favours continuation token s + d (when known). The Domino head's W_2 is zeroed, so the
    correction is 0 and every method proposes the greedy branch: rounds accept whole branches.
    """

    def __init__(self, drafter: Drafter, prompt: list[int], continuation: list[int],
                 margin: float = 20.0):
        self.inner = drafter
        self.sequence = list(prompt) + list(continuation)
        self.margin = margin
        if drafter.head is not None:
            with torch.no_grad():
                drafter.head.W_2.zero_()
                if drafter.head.b_2 is not None:
                    drafter.head.b_2.zero_()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def draft(self, features: torch.Tensor, bonus: int | torch.Tensor, s: int,
              **kw: Any) -> torch.Tensor:
        self._position = s
        return self.inner.draft(features, bonus, s, **kw)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:  # the whole vocabulary: no draft one
        return self.base_logits(h)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.inner.base_logits(h).clone()
        for slot in range(logits.shape[0]):  # row i predicts the token at position s + 1 + i
            pos = self._position + 1 + slot
            if pos < len(self.sequence):
                logits[slot, self.sequence[pos]] = logits[slot].max() + self.margin
        return logits
