"""The target's forward without transformers' per-call overhead, for Llama-family decoders.

`forward` runs a Llama, Mistral, Qwen2 or Qwen3 causal LM over its own modules and weights with
the same operations in the same order as transformers' forward (so the same bits), but as one
plain loop: no `nn.Module` dispatch for the linear layers, no keyword plumbing, mask machinery,
output dataclasses or forward hooks, and the linear layers called through the `linear` the caller
picks (the vendor GEMM, or dartree's GEMV / batch-invariant kernel) instead of a TorchFunctionMode
that would see every one of the ~900 tensor ops of a step. On a small target that overhead is a
large share of a verify's time, so the loop is faster (bench/results/target_forward.md, made by
bench/target_forward.py).

Projections may also be `dartree.gguf.PackedLinear` (a GGUF file loaded packed): those always run
their own kernel, which is batch-invariant. Anything else, or a model that carries forward hooks,
a replaced `forward` or other projections (adapters, other quantised layers, offloading hooks),
runs transformers' own forward instead: `unsupported` says why. tests/test_decoder_stack.py checks the bits against that forward.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from .gguf import PackedLinear

_LINEARS = (nn.Linear, PackedLinear)
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                "mlp": ("gate_proj", "up_proj", "down_proj")}

# attend(layer, query [1, Hq, T, D], key [1, Hkv, T, D], value, scaling) -> [1, Hq, T, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
# linear(x [..., K], weight [N, K], bias [N] or None) -> [..., N]
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def unsupported(model: nn.Module) -> str | None:
    """Why `forward` cannot stand in for `model`'s own forward (None: it can). Static structure
    only; `hooked` covers what may change between calls."""
    name = type(model).__name__
    if name not in ARCHITECTURES or not type(model).__module__.startswith("transformers.models."):
        return f"{type(model).__module__}.{name} is not one of transformers' {', '.join(ARCHITECTURES)}"
    layers = model.model.layers
    if model.config.num_hidden_layers != len(layers):
        return f"config.num_hidden_layers {model.config.num_hidden_layers} != {len(layers)} decoder layers"
    if type(model.get_output_embeddings()) not in _LINEARS:
        return f"the output embedding is a {type(model.get_output_embeddings()).__name__}, not nn.Linear"
    for i, layer in enumerate(layers):
        for block, names in _PROJECTIONS.items():
            for proj in names:
                module = getattr(getattr(layer, block, None), proj, None)
                if type(module) not in _LINEARS:
                    return f"layer {i} {block}.{proj} is a {type(module).__name__}, not nn.Linear"
        qk_norms = [hasattr(layer.self_attn, n) for n in ("q_norm", "k_norm")]
        if qk_norms != [name.startswith("Qwen3")] * 2:
            return f"layer {i}'s attention q_norm/k_norm do not match {name}"
    return None


def hooked(modules: list[nn.Module]) -> bool:
    """Whether a hook or a replaced forward (accelerate's offloading wraps it) would be skipped."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in modules)


def forward(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, linear: Linear,
            attend: Attend, keep: set[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """transformers' forward of `model` (batch 1, no cache object, no mask: `attend` has the cache).

    ids, positions: int64 [T]. keep: decoder layer ids whose outputs to return.
    Returns (logits [T, V], {layer: its output [T, H]}); the last layer's is taken after the final
    norm, as transformers' hidden_states[L] is."""
    body = model.model
    rotary = sys.modules[type(body.layers[0].self_attn).__module__].apply_rotary_pos_emb

    def project(module, x):
        if type(module) is PackedLinear:  # its own batch-invariant kernel
            return module.forward(x)
        return linear(x, module.weight, module.bias)

    x = body.embed_tokens(ids[None])                               # [1, T, H]
    cos, sin = body.rotary_emb(x, positions[None])
    size = ids.numel()
    kept = {}
    last = len(body.layers) - 1
    for i, layer in enumerate(body.layers):
        attn, mlp = layer.self_attn, layer.mlp
        h = layer.input_layernorm(x)
        heads = (1, size, -1, attn.head_dim)
        q = project(attn.q_proj, h).view(heads)
        k = project(attn.k_proj, h).view(heads)
        v = project(attn.v_proj, h).view(heads).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        out = attend(i, q, k, v, attn.scaling).transpose(1, 2).reshape(1, size, -1).contiguous()
        x = x + project(attn.o_proj, out)
        h = layer.post_attention_layernorm(x)
        up = project(mlp.up_proj, h)
        h = mlp.act_fn(project(mlp.gate_proj, h)) * up
        x = x + project(mlp.down_proj, h)
        if i in keep and i != last:
            kept[i] = x[0]
    x = body.norm(x)
    if last in keep:
        kept[last] = x[0]
    return project(model.get_output_embeddings(), x)[0], kept
