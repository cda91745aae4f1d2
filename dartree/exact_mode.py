"""`dartree.exact()`: run a model's linear layers and attention on the batch-invariant kernels.

(The module is `dartree.exact_mode`: `dartree.exact` is the context manager itself.)

Inside the context every `torch.nn.functional.linear` call (so every `nn.Linear`, lm_head
included) runs `dartree.ops.exact_linear`, and every `torch.nn.functional.scaled_dot_product_attention`
call (transformers' "sdpa" attention) runs `dartree.ops.exact_tree_attention`. Each row of their
outputs is then a function of that row's inputs alone: a token's logits have the same bits whether
it is decoded alone, in a prefill, or in a verified draft tree. The rest of a decoder layer
(embedding, RMSNorm, RoPE, SiLU * up, residual adds, softmax-free elementwise work) is already
row-wise on the CPU; tests/test_exact.py checks that it stays so for Llama and Qwen3.

    with dartree.exact():
        ref = model.generate(ids, do_sample=False)   # the reference "target alone"

Attention masks: none (every query sees every key), `is_causal` with as many queries as keys, or a
boolean / additive mask that shows every query all keys before the last T and a tree pattern among
the last T (the causal and decode masks of batch-1 generation). Anything else (padding, sliding
windows) is refused with an error naming it. Eager attention (`attn_implementation="eager"`,
plain matmuls) is not routed: load models with "sdpa" (the default). The kernels have no
backward: run under `torch.no_grad()` / `torch.inference_mode()` (generate does).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import ops

_state = threading.local()


def active() -> bool:
    """Whether the calling thread is inside `dartree.exact()`."""
    return getattr(_state, "depth", 0) > 0


class exact(TorchFunctionMode):  # noqa: N801  (used as `with dartree.exact():`)
    """Context manager: linear layers and SDPA attention on dartree's batch-invariant kernels."""

    def __enter__(self):
        _state.depth = getattr(_state, "depth", 0) + 1
        return super().__enter__()

    def __exit__(self, *exc):
        _state.depth -= 1
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return scaled_dot_product_attention(*args, **kwargs)
        return func(*args, **kwargs)


def _check_kernels(device: torch.device, what: str, *tensors) -> None:
    if not ops.exact_kernels_available(device):
        raise RuntimeError(f"dartree.exact(): no batch-invariant kernels on {device} (extension "
                           f"built: {ops.HAS_EXTENSION}); {what} would not be bit-exact")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(f"dartree.exact(): {what} has no backward; run under torch.no_grad() "
                           "or torch.inference_mode()")


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` on `ops.exact_linear`: input [..., K], weight [N, K], bias [N] -> [..., N]."""
    _check_kernels(input.device, "linear", input, weight, bias)
    if input.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"dartree.exact(): linear needs one dtype, got input {input.dtype}, weight "
                         f"{weight.dtype}" + ("" if bias is None else f", bias {bias.dtype}"))
    out = ops.exact_linear(input.reshape(-1, input.shape[-1]), weight, bias)
    return out.reshape(*input.shape[:-1], weight.shape[0])


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """`F.scaled_dot_product_attention` on `ops.exact_tree_attention`.

    query [B, Hq, T, D], key/value [B, Hkv, S, D] (Hq % Hkv == 0), T <= S: the last T keys are the
    queries' own block, the first S - T a prefix every query sees (see the module docstring)."""
    _check_kernels(query.device, "attention", query, key, value)
    if dropout_p != 0.0:
        raise ValueError(f"dartree.exact(): attention dropout is not supported (dropout_p {dropout_p})")
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(f"dartree.exact(): attention needs q [B, H, T, D] and k, v [B, H, S, D], got "
                         f"{tuple(query.shape)} and {tuple(key.shape)}")
    batch, _, size, _ = query.shape
    seq = key.shape[2]
    if size > seq:
        raise ValueError(f"dartree.exact(): {size} queries over {seq} keys cannot be expressed as a "
                         "prefix plus the queries' own keys")
    prefix = seq - size
    if is_causal:
        if attn_mask is not None:
            raise ValueError("dartree.exact(): attention with both attn_mask and is_causal")
        if prefix != 0:  # SDPA's is_causal is top-left aligned: not "prefix + block" when T < S
            raise ValueError(f"dartree.exact(): is_causal with {size} queries over {seq} keys (top-left "
                             "causal alignment) is not supported")
        block = torch.ones(size, size, dtype=torch.bool, device=query.device).tril()
    elif attn_mask is None:
        block = torch.ones(size, size, dtype=torch.bool, device=query.device)
    else:
        block = _block_mask(attn_mask, batch, query.shape[1], size, seq)
    tree_mask = block.expand(batch, size, size).contiguous() if block.dim() == 2 else block
    return ops.exact_tree_attention(query, key, value, tree_mask, prefix, scale)


def _block_mask(attn_mask, batch, heads, size, seq):
    """The [B, T, T] pattern among the last T keys of an SDPA mask that shows every query all keys
    before them; raises for any other mask (padding, windows, per-head patterns)."""
    if attn_mask.dtype == torch.bool:
        allowed = attn_mask
    elif attn_mask.is_floating_point():
        allowed = attn_mask == 0
        if not bool((allowed | (attn_mask == float("-inf")) | (attn_mask <= torch.finfo(attn_mask.dtype).min)).all()):
            raise ValueError("dartree.exact(): additive attention masks must hold only 0 and -inf "
                             "(or the dtype's minimum)")
    else:
        raise ValueError(f"dartree.exact(): attention mask of dtype {attn_mask.dtype} is not supported")
    allowed = torch.broadcast_to(allowed, (batch, heads, size, seq))
    prefix = seq - size
    if not bool(allowed[..., :prefix].all()):
        raise ValueError("dartree.exact(): the attention mask hides keys before the queries' own block "
                         "(padding or a sliding window); only unpadded batch-1 style masks are supported")
    block = allowed[..., prefix:]
    if not bool((block == block[:, :1]).all()):
        raise ValueError("dartree.exact(): attention masks that differ between heads are not supported")
    return block[:, 0].contiguous()
