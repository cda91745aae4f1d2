"""kv_commit cases for bench/op_bench.py: the commit after one verify pass.

    cases(device) -> [dict(name, kernel, reference, compare, bytes)]

kv_commit works in place, so `compare` runs the kernel and then the reference from the same cache
rows and returns the rows each left behind.
"""

from __future__ import annotations

import torch

from dartree import ops, reference

PREFIX = 4000


def cases(device):
    """One verify pass of a 36-layer, 8-KV-head target: 17 accepted rows of a 64-node tree."""
    kv = torch.randn(36, 2, 1, 8, PREFIX + 176, 128, device=device, dtype=torch.bfloat16)
    accepted = torch.tensor([0, 1, 3, 6, 9, 13, 17, 20, 24, 29, 33, 38, 44, 50, 55, 59, 63],
                            device=device)
    moved = 2 * 36 * 8 * (accepted.numel() - 2) * 128 * 2 * 2  # read + write of moved rows

    def compare():
        tail = kv[..., PREFIX:, :]  # the only rows a commit at PREFIX touches
        before = tail.clone()
        ops.kv_commit(kv, PREFIX, accepted, check=False)
        kernel = tail.clone()
        tail.copy_(before)
        reference.kv_commit(kv, PREFIX, accepted)
        return kernel, tail.clone()

    return [dict(name="kv_commit L36 Hkv8 D128 A17", bytes=moved, compare=compare,
                 kernel=lambda: ops.kv_commit(kv, PREFIX, accepted, check=False),
                 reference=lambda: reference.kv_commit(kv, PREFIX, accepted))]
