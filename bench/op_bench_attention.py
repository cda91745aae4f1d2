"""Tree-attention cases for bench/op_bench.py: the target's verify pass on realistic shapes.

`cases(device)` returns dicts with name, kernel (dartree.ops.tree_attention), reference
(dartree.reference.tree_attention: SDPA over a materialised [T, P + T] mask, built per call as the
reference does), bytes (the K and V rows [0, P + T) the kernel must read: the bandwidth figure) and,
where useful, extra baselines:

- sdpa_dense_mask: SDPA with the dense mask built once, outside the timing (what a caller that
  reuses one mask per round for every layer pays per layer); GQA through enable_gqa.
- flex_block_mask (CUDA): FlexAttention, compiled, with a BlockMask made once by a compiled
  create_block_mask whose mask_mod reads persistent buffers (prefix length, ancestor mask); the
  prefix blocks are full, only the last KV block is partial.

Shapes: a 64-node tree over prefixes of 1k-32k with 32 query / 8 KV heads of dim 128 (Llama-3-8B /
Qwen-style GQA); on CPU also the engine's tiny test models (T <= 16, S <= 512, D 16-64). K and V are
one layer of a static cache longer than P + T, as the target adapter passes them.
"""

from __future__ import annotations

import torch

from dartree import ops, reference
from dartree.tree import DraftTree

TREE, HEADS, KV_HEADS, DIM = 64, 32, 8, 128
PREFIXES = (1024, 4096, 16384, 32768)


def _tree_mask(size, generator):
    """Ancestor-or-self mask of a random tree whose parents come before their children."""
    parents = [-1] + [int(torch.randint(max(0, i - 8), i, (1,), generator=generator)) for i in range(1, size)]
    depths = [0] * size
    for i in range(1, size):
        depths[i] = depths[parents[i]] + 1
    tree = DraftTree(torch.zeros(size, dtype=torch.long), torch.tensor(parents), torch.tensor(depths),
                     torch.zeros(size))
    return tree.ancestor_mask()


def _inputs(device, dtype, heads, kv_heads, size, prefix, dim, seq):
    g = torch.Generator().manual_seed(prefix * 31 + size)
    q = torch.randn(1, size, heads, dim, generator=g).to(device, dtype).transpose(1, 2)  # HF layout
    cache = torch.randn(2, 1, kv_heads, seq, dim, generator=g).to(device, dtype)
    mask = _tree_mask(size, g).to(device)[None]
    return q, cache[0], cache[1], mask


def _case(device, dtype, heads, kv_heads, size, prefix, dim, extras=True, seq=None, flex=True):
    """seq: the cache length S (default P + T + 256); flex: add the FlexAttention baseline (CUDA)."""
    seq = seq or prefix + size + 256
    q, k, v, mask = _inputs(device, dtype, heads, kv_heads, size, prefix, dim, seq)
    end = prefix + size
    scale = dim ** -0.5
    name = (f"tree_attention {str(dtype).removeprefix('torch.')} T{size} P{prefix} "
            f"Hq{heads}/Hkv{kv_heads} D{dim}")
    case = dict(name=name,
                bytes=2 * kv_heads * end * dim * k.element_size(),
                kernel=lambda: ops.tree_attention(q, k, v, mask, prefix, scale),
                reference=lambda: reference.tree_attention(q, k, v, mask, prefix, scale))
    if not extras:
        return case
    dense = torch.ones(1, 1, size, end, dtype=torch.bool, device=device)
    dense[0, 0, :, prefix:] = mask[0]
    case["extra"] = {"sdpa_dense_mask": lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :end], v[:, :, :end], attn_mask=dense, scale=scale, enable_gqa=True)}
    if device.type == "cuda" and flex:
        try:  # an optional baseline: a failure (no triton, no compiler ...) is reported, not fatal
            case["extra"]["flex_block_mask"] = _flex(q, k, v, mask, prefix, scale)
        except Exception as exc:  # noqa: BLE001
            case["failed"] = {"flex_block_mask": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    return case


def _flex(q, k, v, mask, prefix, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    size, end = q.shape[2], prefix + q.shape[2]
    prefix_len = torch.tensor([prefix], device=q.device)  # persistent buffers: one compile
    visible = mask.clone()

    def tree_mask_mod(b, h, q_idx, kv_idx):
        tree_idx = (kv_idx - prefix_len[b]).clamp(0, size - 1)
        return (kv_idx < prefix_len[b]) | ((kv_idx < prefix_len[b] + size) & visible[b, q_idx, tree_idx])

    block_mask = create_block_mask(tree_mask_mod, 1, None, size, end, device=q.device, _compile=True)
    attend = torch.compile(flex_attention, dynamic=False)
    ks, vs = k[:, :, :end], v[:, :, :end]
    return lambda: attend(q, ks, vs, block_mask=block_mask, scale=scale, enable_gqa=True)


def cases(device, flex=True):
    """Tree-attention benchmark cases for `device` (see the module docstring); flex=False leaves
    out the FlexAttention baseline (its compiles take a while)."""
    device = torch.device(device)
    out = []
    if device.type == "cuda":
        for prefix in PREFIXES:
            out.append(_case(device, torch.bfloat16, HEADS, KV_HEADS, TREE, prefix, DIM, flex=flex))
        out.append(_case(device, torch.float16, HEADS, KV_HEADS, TREE, 32768, DIM))
        out.append(_case(device, torch.float32, HEADS, KV_HEADS, TREE, 4096, DIM))
        out.append(_case(device, torch.bfloat16, HEADS, KV_HEADS, 16, 4096, 64))
        return out
    for prefix in PREFIXES:
        # the dense-mask SDPA extra costs as much as the reference; keep it to the shorter prefixes
        out.append(_case(device, torch.float32, HEADS, KV_HEADS, TREE, prefix, DIM, extras=prefix <= 4096))
    out.append(_case(device, torch.bfloat16, HEADS, KV_HEADS, TREE, 4096, DIM, extras=False))
    # the CPU engine's tiny test models: Qwen3 head dim 16 / Llama head dim 16, 4 heads over 2
    out.append(_case(device, torch.float32, 4, 2, 16, 180, 16, seq=512))
    out.append(_case(device, torch.float32, 4, 2, 8, 500, 64, seq=512))
    return out
