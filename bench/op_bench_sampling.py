"""Cases of sample_keyed, for bench/op_bench.py to check and time.

    cases(device) -> [dict(name, kernel, reference, bytes, extra)]

Shapes: one verify pass (65 rows) and one decode step (1 row) at the bundled model's vocabulary
(4096), SmolLM2's (49152) and Qwen3's (151936); "flat" logits are N(0, 1) (every token is within
reach of the top, so every token is scored), "peaked" ones N(0, 2.5) with one token at +22
(LM-like: the CPU kernel skips the tokens that cannot win). `extra` times the unkeyed sampler the
engine runs without a seed (softmax + torch.multinomial), the cost this op replaces.
"""

from __future__ import annotations

import torch

from dartree import ops, reference


def _logits(rows, vocab, peaked, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if not peaked:
        return torch.randn(rows, vocab, generator=gen).to(device)
    logits = torch.randn(rows, vocab, generator=gen) * 2.5
    logits[torch.arange(rows), torch.randint(vocab, (rows,), generator=gen)] = 22.0
    return logits.to(device)


def cases(device):
    out = []
    for rows, vocab in [(65, 4096), (65, 49152), (1, 151936), (65, 151936)]:
        for peaked in (False, True):
            logits = _logits(rows, vocab, peaked, device)
            positions = torch.arange(1000, 1000 + rows, device=device)
            gen = torch.Generator(device=device).manual_seed(0)
            out.append(dict(
                name=f"sample_keyed T{rows} V{vocab} {'peaked' if peaked else 'flat'} fp32",
                bytes=logits.numel() * 4,
                kernel=lambda l=logits, p=positions: ops.sample_keyed(l, p, 7, 1.0),
                reference=lambda l=logits, p=positions: reference.sample_keyed(l, p, 7, 1.0),
                extra={"softmax+multinomial": lambda l=logits, g=gen: torch.multinomial(
                    torch.softmax(l, -1), 1, generator=g)}))
    return out
