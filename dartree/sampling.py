"""Position-keyed sampling for transformers' own `generate`.

`PositionKeyedSampler` is a LogitsProcessor that applies the rule `SpeculativeDecoder.generate(
..., seed=)` uses: the token after absolute position p is `ops.sample_keyed` of that step's logits
with positions = p. Run with greedy search, HF decoding then samples the target exactly as every
dartree method does with the same seed:

    sampler = dartree.PositionKeyedSampler(seed=7, temperature=1.0)
    out = model.generate(ids, do_sample=False, logits_processor=LogitsProcessorList([sampler]))
    # out[0, n:].tolist() == SpeculativeDecoder(model, drafter).generate(ids, temperature=1.0, seed=7).tokens
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from . import ops


class PositionKeyedSampler(LogitsProcessor):
    """Replace each step's scores by a one-hot of the position-keyed sample.

    seed:        int in [0, 2**64)
    temperature: > 0 (0 would be plain greedy decoding: leave the processor out)
    __call__(input_ids [B, L], scores [B, V]) -> scores [B, V] float: 0 at the sampled token, -inf
    elsewhere. The logits of step L belong to position L - 1, so every row uses position L - 1:
    meant for unpadded inputs (left padding shifts positions) and one sequence per seed.
    Put it last in the processor list: processors after it would see only the one-hot scores.
    """

    def __init__(self, seed: int, temperature: float = 1.0):
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
        ops._check_sample_keyed(torch.zeros(1, 1), torch.zeros(1, dtype=torch.int64), seed, temperature)
        self.seed, self.temperature = seed, float(temperature)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        positions = torch.full((scores.shape[0],), input_ids.shape[1] - 1, dtype=torch.int64,
                               device=scores.device)
        tokens = ops.sample_keyed(scores, positions, self.seed, self.temperature)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, tokens[:, None], 0.0)
