"""The target's forward without transformers' per-call overhead, for Llama-family decoders.

`forward` runs a Llama, Mistral, Qwen2 or Qwen3 causal LM over its own modules and weights with
the same arithmetic as transformers' forward (so the same bits: RoPE is the same products and
sums in four ops instead of sixteen, see `_rope`), but as one
plain loop: no `nn.Module` dispatch for the linear layers, no keyword plumbing, mask machinery,
output dataclasses or forward hooks, and the linear layers called through the `linear` the caller
picks (the vendor GEMM, or dartree's GEMV / batch-invariant kernel) instead of a TorchFunctionMode
that would see every one of the ~900 tensor ops of a step. On a small target that overhead is a
large share of a verify's time, so the loop is faster (bench/results/target_forward.md, made by
bench/target_forward.py).

On the CPU, where the loop's linear layers are exact_linear or packed (exact mode, GEMV-routed
verify calls, a packed model), `op_forward` runs every layer in one `ops.decoder_stack` call
instead: the same bits (tests/test_decoder_stack_op.py), without the ~140 ATen op dispatches a
layer costs from Python (about 45% of a packed 135M model's decoding step, torch.profiler).

Projections may also be `dartree.gguf.PackedLinear` (a GGUF file loaded packed): those always run
their own kernel, which is batch-invariant; q/k/v and gate/up whose packed rows lie back to back
(`gguf.load_gguf` lays them out so) run as one call each. Anything else, or a model that carries
forward hooks, a replaced `forward` or other projections (adapters, other quantised layers,
offloading hooks), runs transformers' own forward instead: `unsupported` says why.
tests/test_decoder_stack.py checks the bits against that forward.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from itertools import repeat

import torch
from torch import nn
from transformers.activations import SiLUActivation

from . import ops
from .gguf import PackedLinear

_LINEARS = (nn.Linear, PackedLinear)
_SILU = (nn.SiLU, SiLUActivation)
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                "mlp": ("gate_proj", "up_proj", "down_proj")}

# attend(layer, query [1, Hq, T, D], key [1, Hkv, T, D], value, scaling) -> [1, Hq, T, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
# linear(x [..., K], weight [N, K], bias [N] or None) -> [..., N]
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def unsupported(model: nn.Module) -> str | None:
    """Why `forward` cannot stand in for `model`'s own forward (None: it can). Static structure
    only; `Hooks` covers what may change between calls."""
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


def projections(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's seven projections: q, k, v, o, gate, up, down (None where missing)."""
    return [getattr(getattr(layer, block, None), proj, None)
            for block, names in _PROJECTIONS.items() for proj in names]


class Hooks:
    """Called: whether a hook or a replaced forward (accelerate's offloading wraps it) of one of
    `modules` (or a global hook) would be skipped. It reads the hook dicts and instance dicts the
    modules hold (kept by reference: `register_forward_hook` and a replaced forward change those),
    in loops that run in C: 16 against 52 µs a call over SmolLM2's 397 modules, the walk through
    their attributes it replaces."""

    def __init__(self, modules: list[nn.Module]):
        self._hooks = [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        self._own = [m.__dict__ for m in modules]

    def __call__(self) -> bool:
        from torch.nn.modules import module as torch_module

        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return True
        return any(self._hooks) or any(map(operator.contains, self._own, repeat("forward")))


def adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The concatenation of `tensors` (contiguous, one dtype, along dim 0) as a view, when they lie
    back to back in one storage (`gguf.load_gguf` lays out the packed rows and biases of q/k/v and
    gate/up so); else None."""
    first = tensors[0]
    storage, end = first.untyped_storage().data_ptr(), first.data_ptr()
    for t in tensors:
        if (t.data_ptr() != end or t.untyped_storage().data_ptr() != storage or t.dtype != first.dtype
                or t.shape[1:] != first.shape[1:] or not t.is_contiguous()):
            return None
        end += t.nbytes
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())


def _fused(modules: list[nn.Module]):
    """(rows, block type, K, bias or None, output widths) for one packed call computing every one
    of `modules`, or None. One packed_linear call over adjacent rows gives each module's outputs,
    bit for bit. The answer holds views only (values are read at each call), so it is kept on the
    first module while the modules' tensors stay the same objects."""
    if not all(type(m) is PackedLinear for m in modules):
        return None
    first = modules[0]
    key = tuple((m.packed.data_ptr(), None if m.bias is None else m.bias.data_ptr()) for m in modules)
    cached = first.__dict__.get("_dartree_fused")
    if cached is None or cached[0] != key:
        cached = first.__dict__["_dartree_fused"] = (key, _fuse(modules))
    return cached[1]


def _fuse(modules: list[PackedLinear]):
    first = modules[0]
    if any(m.ggml_type != first.ggml_type or m.in_features != first.in_features for m in modules):
        return None
    rows = adjacent([m.packed for m in modules])
    biases = [m.bias for m in modules]
    bias = None if all(b is None for b in biases) else \
        adjacent(biases) if all(b is not None for b in biases) else None
    if rows is None or (bias is None and first.bias is not None):
        return None
    return rows, first.ggml_type, first.in_features, bias, [m.out_features for m in modules]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on x [1, T, heads, D] (cos [1, T, 1, D]) in four ops:
    (x * cos) + (rotate_half(x) * sin), where rotate_half(x) = cat(-x2, x1) = x[..., perm] with its
    first half negated, and (-a) * s == a * (-s) exactly, so sin_signed = sin with its first half
    negated gives the same bits."""
    return x * cos + x.index_select(-1, perm) * sin_signed


def op_unsupported(model: nn.Module) -> str | None:
    """Why `forward` cannot run `model`'s layers as one `ops.decoder_stack` call (None: it can).
    Static structure only, on top of `unsupported`: SiLU, RMSNorms of one epsilon whose weights
    have the model's dtype, dense weights in that dtype, one attention scaling."""
    body = model.model
    dtype = body.norm.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the model is {dtype} (the op takes float32, bfloat16 and float16)"
    eps, scaling = body.layers[0].input_layernorm.variance_epsilon, body.layers[0].self_attn.scaling
    for i, layer in enumerate(body.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if type(mlp.act_fn) not in _SILU:
            return f"layer {i}'s activation is {type(mlp.act_fn).__name__}, not SiLU"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else []
        for norm in norms:
            if not type(norm).__name__.endswith("RMSNorm") or norm.weight.dtype != dtype or \
                    getattr(norm, "variance_epsilon", None) != eps:
                return f"layer {i}'s {type(norm).__name__} is not an RMSNorm of {dtype} with eps {eps}"
        if attn.scaling != scaling:
            return f"layer {i}'s attention scaling {attn.scaling} differs from layer 0's {scaling}"
        for module in projections(layer):
            if type(module) is nn.Linear and module.weight.dtype != dtype:
                return f"layer {i}'s {type(module).__name__} is {module.weight.dtype}, the model {dtype}"
    return None


def _prologue(model, ids, positions):
    """Embeddings [1, T, H] and RoPE's tables as `_rope` takes them: (x, cos, sin_signed, perm)."""
    body = model.model
    x = body.embed_tokens(ids[None])                               # [1, T, H]
    cos, sin = body.rotary_emb(x, positions[None])                 # [1, T, D]
    half = cos.shape[-1] // 2
    perm = torch.arange(cos.shape[-1], device=cos.device).roll(half)
    sign = torch.ones(cos.shape[-1], dtype=sin.dtype, device=sin.device)
    sign[:half] = -1
    return x, cos[:, :, None], (sin * sign)[:, :, None], perm      # [1, T, 1, D]


def stack_arguments(model):
    """The per-layer arguments of `ops.decoder_stack` for `model`'s current modules."""
    weights, qtypes, biases, norms = [], [], [], []
    for layer in model.model.layers:
        for module in projections(layer):
            packed = type(module) is PackedLinear
            weights.append(module.packed if packed else module.weight)
            qtypes.append(module.ggml_type if packed else -1)
            biases.append(module.bias)
        attn = layer.self_attn
        norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        if hasattr(attn, "q_norm"):
            norms += [attn.q_norm.weight, attn.k_norm.weight]
    return weights, qtypes, biases, norms


def op_forward(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
               start: int, tree_mask: torch.Tensor, exact: bool, keep: set[int], linear: Linear,
               arguments: tuple | None = None, head: Callable | None = None,
               ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """`forward`'s results with every decoder layer in one `ops.decoder_stack` call (CPU; the
    model passes `unsupported` and `op_unsupported`). Linear layers run exact_linear (or their
    packed kernel), attention exact_tree_attention when `exact` else tree_attention over the cache
    kv [L, 2, 1, Hkv, S, D]: the new keys and values go to rows [start, start + T), and query i
    sees rows [0, start) and the new rows tree_mask [1, T, T] allows. `linear` runs a dense
    output embedding (lm_head). `arguments`: `stack_arguments(model)` kept by the caller (reading
    them walks every layer: about 0.7 ms, a tenth of a one-row SmolLM2 step), else read now.
    head: what replaces the output embedding on the final hidden [T, H] (`forward`'s)."""
    body = model.model
    x, cos, sin_signed, _ = _prologue(model, ids, positions)
    attn = body.layers[0].self_attn
    heads = [model.config.num_attention_heads, kv.shape[3], attn.head_dim, int(hasattr(attn, "q_norm"))]
    last = len(body.layers) - 1
    kept_ids = sorted(l for l in keep if l != last)
    weights, qtypes, biases, norms = arguments or stack_arguments(model)
    out, outputs = ops.decoder_stack(x[0], kv, start, tree_mask, cos[0, :, 0], sin_signed[0, :, 0],
                                     weights, qtypes, biases, norms, heads,
                                     body.layers[0].input_layernorm.variance_epsilon, attn.scaling,
                                     exact, kept_ids)
    kept = dict(zip(kept_ids, outputs))
    x = body.norm(out[None])
    if last in keep:
        kept[last] = x[0]
    return _output(model, x, linear, head), kept


def project(module, x, linear):
    """module's output on x: a packed module's own (batch-invariant) kernel, else `linear`."""
    if type(module) is PackedLinear:
        return module.forward(x)
    return linear(x, module.weight, module.bias)


def _output(model, x, linear, head):
    """The output embedding's logits [T, V] of the final hidden x [1, T, H], or head(x[0])."""
    if head is not None:
        return head(x[0])
    return project(model.get_output_embeddings(), x, linear)[0]


def forward(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, linear: Linear,
            attend: Attend, keep: set[int], head: Callable | None = None,
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """transformers' forward of `model` (batch 1, no cache object, no mask: `attend` has the cache).

    ids, positions: int64 [T]. keep: decoder layer ids whose outputs to return. head: what
    replaces the output embedding on the final hidden [T, H] (a greedy round's argmax: the
    target's GreedyHead), or None.
    Returns (logits [T, V] or head's result, {layer: its output [T, H]}); the last layer's is
    taken after the final norm, as transformers' hidden_states[L] is."""
    body = model.model

    def project_all(modules, fused, x):
        """The outputs of `modules` on x: one packed call when their rows are fused."""
        if fused is None:
            return [project(m, x, linear) for m in modules]
        rows, qtype, K, bias, widths = fused
        out = torch.ops.dartree.packed_linear.default(x.reshape(-1, K), rows, qtype, K, bias)
        return out.view(*x.shape[:-1], -1).split(widths, dim=-1)

    x, cos, sin_signed, perm = _prologue(model, ids, positions)
    packed_call = ops.packed_kernel_available(ids.device)
    size = ids.numel()
    kept = {}
    last = len(body.layers) - 1
    for i, layer in enumerate(body.layers):
        attn, mlp = layer.self_attn, layer.mlp
        h = layer.input_layernorm(x)
        heads = (1, size, -1, attn.head_dim)
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        q, k, v = project_all(qkv, _fused(qkv) if packed_call else None, h)
        q, k, v = q.view(heads), k.view(heads), v.view(heads).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = _rope(q, cos, sin_signed, perm).transpose(1, 2)
        k = _rope(k, cos, sin_signed, perm).transpose(1, 2)
        out = attend(i, q, k, v, attn.scaling).transpose(1, 2).reshape(1, size, -1).contiguous()
        x = x + project(attn.o_proj, out, linear)
        h = layer.post_attention_layernorm(x)
        gate_up = [mlp.gate_proj, mlp.up_proj]
        gate, up = project_all(gate_up, _fused(gate_up) if packed_call else None, h)
        # a contiguous gate, as transformers' own gate_proj gives it: SiLU's vector and scalar
        # exp differ, and a strided gate moves where each row's scalar tail falls
        h = mlp.act_fn(gate.contiguous()) * up
        x = x + project(mlp.down_proj, h, linear)
        if i in keep and i != last:
            kept[i] = x[0]
    x = body.norm(x)
    if last in keep:
        kept[last] = x[0]
    return _output(model, x, linear, head), kept
