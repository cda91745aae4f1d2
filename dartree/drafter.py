"""DFlash block-diffusion drafter and the Domino causal-correction head.

The drafter is a stack of Qwen3-style decoder layers that read the target's hidden states
("context features") through KV injection: every layer projects the fused context features ``c``
and the block states ``x`` with the *same* k/v projections (and k_norm), so the block queries
attend over ``[context ; block]`` with no mask. The drafter has no embedding and no LM head of its
own: block tokens are embedded with the target's input embedding and its hidden states are read
out with the target's LM head. See research/ALGORITHMS.md §1-2.

Checkpoint folders follow the public z-lab DFlash and Domino layouts (``config.json`` +
``*.safetensors``, keys ``fc.weight``, ``layers.{i}.self_attn.q_proj.weight``, …,
``prefix_gru.weight_ih_l0``, ``embed_proj.0.weight``), so released drafters load unchanged.

Example::

    drafter = load_drafter("Qwen3-8B-Domino-b16", target)
    drafter.reset(max_len=4096)
    h = drafter.draft(prompt_features, bonus=first_token, s=prompt_len)   # [k, H]
    logits = drafter.base_logits(h)                                      # [k, V]
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import compilation, ops

logger = logging.getLogger(__name__)

ARCHITECTURE = "DFlashDraftModel"
PROJECTOR_TYPES = ("dflash", "domino")
_PROJECTOR_ALIASES = {"causal_v5": "domino"}
_STATIC_ROPE_TYPES = ("linear", "yarn", "llama3")
_HEAD_PREFIX = "head."


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers a drafter reads when its config names none (the DFlash default).

    A single-layer drafter reads layer ``N // 2``; otherwise ``num_draft_layers`` ids evenly
    spaced over ``[1, N - 3]`` (Qwen3-8B, N = 36, 5 layers -> ``[1, 9, 17, 25, 33]``).
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    step = (end - start) / (num_draft_layers - 1)
    return [int(round(start + i * step)) for i in range(num_draft_layers)]


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DrafterConfig:
    """Shapes and settings of a DFlash drafter (+ optional Domino head).

    ``emb_dim`` (r) and ``gru_hidden_dim`` (G) are only used when ``projector_type`` is
    ``"domino"``. ``rope_scaling`` is None for plain RoPE, else a transformers rope-parameter
    dict with a ``rope_type`` of linear, yarn or llama3 (``rope_theta`` kept separately).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    projector_type: str = "dflash"
    emb_dim: int | None = None
    gru_hidden_dim: int | None = None
    shift_label: bool = False
    pure_draft_prefix_len: int = 0

    @property
    def is_domino(self) -> bool:
        return self.projector_type == "domino"

    @property
    def num_slots(self) -> int:
        """k: slots used per block (B with shift_label, else B - 1)."""
        return self.block_size if self.shift_label else self.block_size - 1

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"drafter {name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"drafter block_size must be >= 2, got {self.block_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"drafter num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"drafter head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"drafter mask_token_id must be in [0, {self.vocab_size}), "
                             f"got {self.mask_token_id}")
        if not self.target_layer_ids:
            raise ValueError("drafter target_layer_ids must not be empty")
        if self.projector_type not in PROJECTOR_TYPES:
            raise ValueError(f"drafter projector_type must be one of {PROJECTOR_TYPES}, "
                             f"got {self.projector_type!r}")
        if self.is_domino:
            for name in ("emb_dim", "gru_hidden_dim"):
                value = getattr(self, name)
                if value is None or value < 1:
                    raise ValueError(f"a domino drafter needs {name} >= 1, got {value}")
        if not 0 <= self.pure_draft_prefix_len <= self.num_slots:
            raise ValueError(f"drafter pure_draft_prefix_len must be in [0, {self.num_slots}], "
                             f"got {self.pure_draft_prefix_len}")
        if self.rope_scaling is not None:
            rope_type = _rope_type(self.rope_scaling)
            if rope_type not in _STATIC_ROPE_TYPES:
                raise ValueError(f"drafter rope_type {rope_type!r} is not supported "
                                 f"(supported: default, {', '.join(_STATIC_ROPE_TYPES)})")
            if self.rope_scaling.get("partial_rotary_factor", 1.0) != 1.0:
                raise ValueError("drafter partial_rotary_factor != 1 is not supported")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DrafterConfig:
        """Parse a ``config.json`` dict of a z-lab DFlash or Domino drafter.

        Reads DFlash keys from ``dflash_config`` first, then the top level (``block_size`` lives
        at the top level in b16 checkpoints and in ``dflash_config`` in newer ones);
        ``projector_type: "causal_v5"`` means ``"domino"``; ``emb_dim``/``gru_hidden_dim`` fall
        back to the top level and ``gru_hidden_dim`` to ``emb_dim``. Refuses other
        architectures, non-SiLU MLPs and sliding-window layers.
        """
        if not isinstance(data, dict):
            raise ValueError(f"drafter config must be a JSON object, got {type(data).__name__}")
        archs = data.get("architectures")
        if archs is not None and list(archs) != [ARCHITECTURE]:
            raise ValueError(f"unsupported drafter architecture {archs} "
                             f"(expected [{ARCHITECTURE!r}])")
        if data.get("hidden_act", "silu") != "silu":
            raise ValueError(f"drafter hidden_act must be 'silu', got {data['hidden_act']!r}")
        layer_types = data.get("layer_types") or []
        if data.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
            raise ValueError("drafters with sliding-window attention layers are not supported")

        dflash = dict(data.get("dflash_config") or {})

        def pick(key: str, default: Any = None) -> Any:
            value = dflash.get(key)
            return data.get(key, default) if value is None else value

        def need(key: str) -> Any:
            value = pick(key)
            if value is None:
                raise ValueError(f"drafter config lacks {key!r}")
            return value

        num_layers = int(need("num_hidden_layers"))
        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        num_target_layers = data.get("num_target_layers")
        layer_ids = pick("target_layer_ids")
        if layer_ids is None:
            if num_target_layers is None:
                raise ValueError("drafter config lacks both 'target_layer_ids' and "
                                 "'num_target_layers'")
            layer_ids = default_target_layer_ids(int(num_target_layers), num_layers)
        projector = pick("projector_type") or "dflash"
        projector = _PROJECTOR_ALIASES.get(projector, projector)
        emb_dim = pick("emb_dim")
        gru_dim = pick("gru_hidden_dim", emb_dim)
        rope_theta, rope_scaling = _parse_rope(data)

        config = cls(
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(data.get("num_key_value_heads") or num_heads),
            head_dim=int(data.get("head_dim") or hidden // num_heads),
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            block_size=int(need("block_size")),
            mask_token_id=int(need("mask_token_id")),
            target_layer_ids=[int(i) for i in layer_ids],
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(data.get("max_position_embeddings", 40960)),
            attention_bias=bool(data.get("attention_bias", False)),
            projector_type=projector,
            emb_dim=None if emb_dim is None else int(emb_dim),
            gru_hidden_dim=None if gru_dim is None else int(gru_dim),
            shift_label=bool(pick("shift_label", False)),
            pure_draft_prefix_len=int(pick("pure_draft_prefix_len", 0)),
        )
        config.validate()
        return config

    def to_json(self) -> dict[str, Any]:
        """The ``config.json`` dict in the z-lab DFlash / Domino layout (inverse of from_json)."""
        dflash: dict[str, Any] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
        }
        if self.is_domino:
            dflash.update(projector_type="domino", emb_dim=self.emb_dim,
                          gru_hidden_dim=self.gru_hidden_dim)
        if self.is_domino or self.shift_label or self.pure_draft_prefix_len:
            dflash.update(shift_label=self.shift_label,
                          pure_draft_prefix_len=self.pure_draft_prefix_len)
        data: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * self.num_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "block_size": self.block_size,
            "dflash_config": dflash,
        }
        if self.num_target_layers is not None:
            data["num_target_layers"] = self.num_target_layers
        if self.is_domino:
            data["emb_dim"] = self.emb_dim
        return data


def _rope_type(params: dict[str, Any]) -> str:
    return params.get("rope_type", params.get("type", "default"))


def _parse_rope(data: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from classic keys or transformers-5 ``rope_parameters``."""
    params = dict(data.get("rope_parameters") or {})
    theta = data.get("rope_theta", params.pop("rope_theta", 10000.0))
    scaling = data.get("rope_scaling") or params or None
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        rope_type = _rope_type(scaling)
        scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
    return float(theta), scaling


# --------------------------------------------------------------------------------------------
# Building blocks (Qwen3 semantics)
# --------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types (as transformers computes norms and RoPE), float64 stays."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """``w * x / rms(x)``, computed in at least float32 and cast back (Qwen3/Llama semantics)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x.to(_compute_dtype(x.dtype))
        xc = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xc.to(x.dtype)


def _rope_inv_freq(config: DrafterConfig, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] in ``dtype`` on CPU, attention scaling) for the drafter's RoPE.

    Plain RoPE is computed in ``dtype`` (float32 reproduces transformers exactly); scaled
    types come from transformers' rope init functions (float32).
    """
    if config.rope_scaling is None:
        exponent = torch.arange(0, config.head_dim, 2, dtype=dtype) / config.head_dim
        return 1.0 / (config.rope_theta ** exponent), 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = Qwen3Config(
        hidden_size=config.hidden_size, num_attention_heads=config.num_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rope_parameters={**config.rope_scaling, "rope_theta": config.rope_theta},
    )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[_rope_type(config.rope_scaling)](hf_config, "cpu")
    return inv_freq.to(dtype), float(scaling)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., n, D] rotated by cos/sin [n, D] (half-split layout, as transformers)."""
    return x * cos + _rotate_half(x) * sin


class DrafterAttention(nn.Module):
    """KV-injection attention: block queries over [context ; block] keys, no mask."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.q_proj = nn.Linear(config.hidden_size, hq * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, hkv * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, hkv * d, bias=bias)
        self.o_proj = nn.Linear(hq * d, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, H] (context features or normed block states) -> K, V [Hkv, n, D], K roped."""
        n = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)).transpose(0, 1)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        return _apply_rope(k, cos, sin), v

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, H] normed block states -> Q [Hq, B, D], roped at the block positions."""
        q = self.q_norm(self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim))
        return _apply_rope(q.transpose(0, 1), cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [Hq, B, D] over k, v [Hkv, S, D] (GQA, no mask) -> o_proj output [B, H]."""
        out = F.scaled_dot_product_attention(q[None], k[None], v[None],
                                             scale=self.head_dim ** -0.5, enable_gqa=True)
        return self.o_proj(out[0].transpose(0, 1).reshape(q.shape[1], -1))


class DrafterMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """One pre-norm decoder layer with KV injection, writing into a static per-layer cache."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(config)
        self.mlp = DrafterMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, c: torch.Tensor, cache: torch.Tensor, index: int,
                start: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One layer over the block.

        x [B, H] block states; c [n, H] fused features of the new context rows at positions
        [start, start + n); cache [L, 2, Hkv, max_len, D] (this layer's is cache[index]);
        cos/sin [n + B, D] for positions start .. start + n + B - 1. Writes context K/V at rows
        [start, start + n) and block K/V at rows [start + n, start + n + B), attends over rows
        [0, start + n + B).
        """
        attn = self.self_attn
        n, end = c.shape[0], start + c.shape[0] + x.shape[0]
        if n:
            ops.write_rows(cache, index, start, *attn.keys_values(c, cos[:n], sin[:n]))
        xn = self.input_layernorm(x)
        ops.write_rows(cache, index, start + n, *attn.keys_values(xn, cos[n:], sin[n:]))
        kv = cache[index]
        x = x + attn.attend(attn.queries(xn, cos[n:], sin[n:]), kv[0, :, :end], kv[1, :, :end])
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------------------------
# Domino head
# --------------------------------------------------------------------------------------------


class DominoHead(nn.Module):
    """Domino causal correction: a GRU over the drafted prefix + a rank-r logit correction.

    Weights keep the checkpoint names: ``prefix_gru`` (a 1-layer nn.GRU, W_ih [3G, H],
    W_hh [3G, G], optional biases) and ``embed_proj`` = Linear(H+G -> r) · SiLU · Linear(r -> V)
    with W_1 = [W_z | W_s]. ``input_table`` [V, 3G] = E·W_ihᵀ (+ b_ih) is a non-persistent buffer
    built from the target embedding by :meth:`build_input_table`; rebuild it after changing
    W_ih. Training code should run ``prefix_gru`` on embeddings instead of :meth:`gru_step`,
    which reads the table and so carries no gradient to W_ih.
    """

    def __init__(self, hidden_size: int, vocab_size: int, emb_dim: int, gru_hidden_dim: int, *,
                 gru_bias: bool = False, w1_bias: bool = False, w2_bias: bool = False):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.emb_dim, self.gru_hidden_dim = emb_dim, gru_hidden_dim
        self.prefix_gru = nn.GRU(hidden_size, gru_hidden_dim, num_layers=1, batch_first=True,
                                 bias=gru_bias)
        self.embed_proj = nn.Sequential(
            nn.Linear(hidden_size + gru_hidden_dim, emb_dim, bias=w1_bias),
            nn.SiLU(),
            nn.Linear(emb_dim, vocab_size, bias=w2_bias),
        )
        self.register_buffer("input_table", None, persistent=False)

    # Named views of the weights, for tree builders and kernels.
    @property
    def W_ih(self) -> torch.Tensor:
        return self.prefix_gru.weight_ih_l0

    @property
    def W_hh(self) -> torch.Tensor:
        return self.prefix_gru.weight_hh_l0

    @property
    def b_ih(self) -> torch.Tensor | None:
        return self.prefix_gru.bias_ih_l0 if self.prefix_gru.bias else None

    @property
    def b_hh(self) -> torch.Tensor | None:
        return self.prefix_gru.bias_hh_l0 if self.prefix_gru.bias else None

    @property
    def W_z(self) -> torch.Tensor:
        """[r, H]: the first H columns of W_1 (applied to the drafter state h)."""
        return self.embed_proj[0].weight[:, :self.hidden_size]

    @property
    def W_s(self) -> torch.Tensor:
        """[r, G]: the last G columns of W_1 (applied to the GRU state g)."""
        return self.embed_proj[0].weight[:, self.hidden_size:]

    @property
    def b_1(self) -> torch.Tensor | None:
        return self.embed_proj[0].bias

    @property
    def W_2(self) -> torch.Tensor:
        """[V, r]."""
        return self.embed_proj[2].weight

    @property
    def b_2(self) -> torch.Tensor | None:
        return self.embed_proj[2].bias

    @torch.no_grad()
    def build_input_table(self, embedding: torch.Tensor) -> None:
        """input_table [V, 3G] = embedding [V, H] · W_ihᵀ (+ b_ih), in the head's dtype."""
        if embedding.shape != (self.vocab_size, self.hidden_size):
            raise ValueError(f"embedding must be [{self.vocab_size}, {self.hidden_size}], "
                             f"got {list(embedding.shape)}")
        weight = self.W_ih
        self.input_table = F.linear(embedding.to(device=weight.device, dtype=weight.dtype),
                                    weight, self.b_ih)

    def gru_step(self, tokens: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """One GRU cell step (PyTorch r, z, n gate order) for n paths at once.

        tokens LongTensor [n] (the token each path just appended), g [n, G] -> g' [n, G].
        """
        if self.input_table is None:
            raise RuntimeError("DominoHead.input_table is not built; call build_input_table()")
        gi = self.input_table[tokens]
        gh = F.linear(g, self.W_hh, self.b_hh)
        i_r, i_z, i_n = gi.chunk(3, dim=-1)
        h_r, h_z, h_n = gh.chunk(3, dim=-1)
        reset = torch.sigmoid(i_r + h_r)
        update = torch.sigmoid(i_z + h_z)
        candidate = torch.tanh(i_n + reset * h_n)
        return candidate + update * (g - candidate)

    def root_state(self, bonus: int | torch.Tensor) -> torch.Tensor:
        """[1, G]: the GRU state after the root/bonus token, from g_0 = 0."""
        tokens = torch.as_tensor(bonus, dtype=torch.long, device=self.W_hh.device).reshape(1)
        zeros = self.W_hh.new_zeros(1, self.gru_hidden_dim)
        return self.gru_step(tokens, zeros)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """h [k, H] drafter states -> z [k, r] = W_z h (+ b_1), shared by every path at a slot."""
        return F.linear(h.to(self.W_hh.dtype), self.W_z, self.b_1)

    def correction(self, z: torch.Tensor, g: torch.Tensor,
                   cand: torch.Tensor | None = None) -> torch.Tensor:
        """Δ = W_2[cand] · SiLU(z + W_s g) (+ b_2[cand]).

        z [r] or [n, r]; g [n, G]; cand LongTensor [C] or None (all V) -> [n, C or V].
        """
        act = F.silu(z + F.linear(g, self.W_s))
        if cand is None:
            return F.linear(act, self.W_2, self.b_2)
        return F.linear(act, self.W_2[cand], None if self.b_2 is None else self.b_2[cand])


# --------------------------------------------------------------------------------------------
# Drafter
# --------------------------------------------------------------------------------------------


def _target_io(target: Any) -> tuple[nn.Module, nn.Module, Any]:
    """(input embedding, LM head, transformers config) of an HF causal LM or a TargetModel."""
    hf = target if hasattr(target, "get_input_embeddings") else getattr(target, "model", None)
    if hf is None or not hasattr(hf, "get_input_embeddings"):
        raise TypeError(f"target must be a transformers causal LM or a TargetModel, "
                        f"got {type(target).__name__}")
    embed, lm_head = hf.get_input_embeddings(), hf.get_output_embeddings()
    if embed is None or lm_head is None:
        raise ValueError(f"target {type(hf).__name__} has no input embedding or LM head")
    config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    return embed, lm_head, config


class Drafter(nn.Module):
    """A DFlash drafter bound to a target model (whose embedding and LM head it uses).

    Runs in the target's dtype on the target's device. Per generation: :meth:`reset` once,
    then one :meth:`draft` per round; the context K/V of committed positions live in a static
    cache ``[L, 2, Hkv, max_len, D]``, the block's K/V are written past the context and
    dropped (overwritten) next round.

    Attributes: ``config``, ``path`` (checkpoint folder or None), ``head`` (DominoHead or None),
    ``block_size`` (B), ``num_slots`` (k), ``shift_label``, ``prefix_len`` (P),
    ``target_layer_ids``, ``mask_token_id``, ``ctx_len``, ``max_len``.
    """

    def __init__(self, config: DrafterConfig, target: Any, *, gru_bias: bool = False,
                 w1_bias: bool = False, w2_bias: bool = False):
        super().__init__()
        config.validate()
        embed, lm_head, target_config = _target_io(target)
        _check_fits_target(config, embed.weight.shape, target_config.num_hidden_layers)
        self.config = config
        self.path: Path | None = None
        self._target_io = (embed, lm_head)  # a tuple: not registered, never saved or moved
        n_features = len(config.target_layer_ids)
        self.fc = nn.Linear(n_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = (DominoHead(config.hidden_size, config.vocab_size, config.emb_dim,
                                config.gru_hidden_dim, gru_bias=gru_bias, w1_bias=w1_bias,
                                w2_bias=w2_bias)
                     if config.is_domino else None)
        with torch.device("cpu"):
            _rope_inv_freq(config, torch.float32)  # fail at load on bad rope parameters
        self._kv: torch.Tensor | None = None
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._block_ids: torch.Tensor | None = None
        self.ctx_len = 0
        self.max_len = 0

    block_size = property(lambda self: self.config.block_size)
    num_slots = property(lambda self: self.config.num_slots)
    shift_label = property(lambda self: self.config.shift_label)
    prefix_len = property(lambda self: self.config.pure_draft_prefix_len)
    target_layer_ids = property(lambda self: list(self.config.target_layer_ids))
    mask_token_id = property(lambda self: self.config.mask_token_id)
    device = property(lambda self: self.fc.weight.device)
    dtype = property(lambda self: self.fc.weight.dtype)

    def refresh_input_table(self) -> None:
        """Rebuild ``head.input_table`` from the target embedding (after changing W_ih)."""
        if self.head is not None:
            self.head.build_input_table(self._target_io[0].weight)

    def reset(self, max_len: int) -> None:
        """Prepare a generation: static context cache and RoPE tables for positions
        [0, max_len) (reused when shape, device and dtype are unchanged); ctx_len = 0.

        ``max_len`` must cover the last block: every draft at position s needs s + B <= max_len.
        """
        if isinstance(max_len, bool) or not isinstance(max_len, int) \
                or max_len < self.block_size:
            raise ValueError(f"max_len must be an int >= block_size ({self.block_size}), "
                             f"got {max_len!r}")
        cfg, device, dtype = self.config, self.device, self.dtype
        shape = (cfg.num_layers, 2, cfg.num_kv_heads, max_len, cfg.head_dim)
        kv = self._kv
        if kv is None or kv.shape != shape or kv.device != device or kv.dtype != dtype:
            self._kv = torch.empty(shape, device=device, dtype=dtype)
            self._cos, self._sin = self._rope_tables(max_len)
            self._block_ids = torch.empty(cfg.block_size, dtype=torch.long, device=device)
        self._block_ids.fill_(cfg.mask_token_id)
        self.ctx_len, self.max_len = 0, max_len

    def _rope_tables(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_len, D] in the drafter dtype; angles computed in >= float32."""
        with torch.device("cpu"):
            inv_freq, scaling = _rope_inv_freq(self.config, _compute_dtype(self.dtype))
        inv_freq = inv_freq.to(self.device)
        freqs = torch.arange(max_len, device=self.device).to(inv_freq.dtype)[:, None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * scaling).to(self.dtype), (angles.sin() * scaling).to(self.dtype)

    @torch.no_grad()
    def draft(self, features: torch.Tensor, bonus: int | torch.Tensor, s: int,
              compiled: bool = False) -> torch.Tensor:
        """One block-diffusion pass: hidden states of the k used slots.

        features [n, nF*H] (target dtype): target features of positions [ctx_len, s), n = s -
        ctx_len; bonus: the root token at position s (int, or a LongTensor with one element on
        the drafter's device, not range-checked to avoid a host sync); s: its position.
        compiled: run the pass through torch.compile (fullgraph; n, the context length and the
        cache length symbolic after their first change: one graph for every round).
        Returns h [k, H] (after the final norm): slots 0..B-1 with shift_label, else 1..B-1;
        slot i predicts the token at position s + 1 + i (minus 1 without shift_label).
        Afterwards ctx_len = s.
        """
        self._check_draft_args(features, bonus, s)
        if isinstance(bonus, torch.Tensor):
            self._block_ids[:1].copy_(bonus.reshape(1))
        else:
            self._block_ids[0] = bonus
        if compiled:
            for table, dim in ((self._kv, 3), (self._cos, 0), (self._sin, 0)):
                torch._dynamo.maybe_mark_dynamic(table, dim)  # the cache length changes per call
            h = compilation.compiled(_block_pass, self)(self, features, self.ctx_len)
        else:
            h = _block_pass(self, features, self.ctx_len)
        self.ctx_len = s
        return h

    def _check_draft_args(self, features: torch.Tensor, bonus: int | torch.Tensor, s: int) -> None:
        if self._kv is None:
            raise RuntimeError("call Drafter.reset(max_len) before draft()")
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"s must be an int, got {type(s).__name__}")
        if s < self.ctx_len:
            raise ValueError(f"s must be >= ctx_len ({self.ctx_len}), got {s}")
        if s + self.block_size > self.max_len:
            raise ValueError(f"block at position {s} (+{self.block_size}) exceeds the drafter "
                             f"cache (max_len {self.max_len})")
        width = len(self.config.target_layer_ids) * self.config.hidden_size
        expected = (s - self.ctx_len, width)
        if not isinstance(features, torch.Tensor) or tuple(features.shape) != expected:
            got = list(features.shape) if isinstance(features, torch.Tensor) else type(features)
            raise ValueError(f"features must be [{expected[0]}, {width}] (positions "
                             f"[{self.ctx_len}, {s}) x {len(self.config.target_layer_ids)} "
                             f"layers), got {got}")
        if not features.is_floating_point():
            raise ValueError(f"features must be floating point, got {features.dtype}")
        if features.device != self.device:
            raise ValueError(f"features must be on {self.device}, got {features.device}")
        if isinstance(bonus, torch.Tensor):
            if bonus.numel() != 1 or bonus.dtype != torch.long or bonus.device != self.device:
                raise ValueError(f"bonus must be an int or a one-element int64 tensor on "
                                 f"{self.device}, got {bonus.dtype} {list(bonus.shape)} on "
                                 f"{bonus.device}")
        elif isinstance(bonus, bool) or not isinstance(bonus, int) \
                or not 0 <= bonus < self.config.vocab_size:
            raise ValueError(f"bonus must be a token id in [0, {self.config.vocab_size}), "
                             f"got {bonus!r}")

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [k, H] -> base logits [k, V] through the target's LM head."""
        lm_head = self._target_io[1]
        return lm_head(h.to(lm_head.weight.dtype))

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under their checkpoint names (head keys at the top level, no input_table)."""
        return {(k[len(_HEAD_PREFIX):] if k.startswith(_HEAD_PREFIX) else k): v
                for k, v in self.state_dict().items()}


def _block_pass(drafter: Drafter, features: torch.Tensor, start: int) -> torch.Tensor:
    """Drafter.draft's pass over its block (ids in drafter._block_ids) after the n = len(features)
    new context rows at positions [start, start + n): h [k, H]."""
    c = drafter.hidden_norm(drafter.fc(features.to(drafter.dtype)))
    x = drafter._target_io[0](drafter._block_ids).to(drafter.dtype)
    end = start + features.shape[0] + drafter.block_size
    cos, sin = drafter._cos[start:end], drafter._sin[start:end]
    for index, layer in enumerate(drafter.layers):
        x = layer(x, c, drafter._kv, index, start, cos, sin)
    h = drafter.norm(x)
    return h if drafter.shift_label else h[1:]


def _check_fits_target(config: DrafterConfig, embed_shape: torch.Size, num_layers: int) -> None:
    vocab, hidden = embed_shape
    if config.hidden_size != hidden:
        raise ValueError(f"drafter hidden_size {config.hidden_size} does not match the target's "
                         f"hidden size {hidden}")
    if config.vocab_size != vocab:
        raise ValueError(f"drafter vocab_size {config.vocab_size} does not match the target's "
                         f"vocabulary ({vocab} embedding rows)")
    bad = [i for i in config.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"drafter target_layer_ids {bad} are out of range for a target with "
                         f"{num_layers} layers")
    if config.num_target_layers is not None and config.num_target_layers != num_layers:
        logger.warning("drafter was trained for a %d-layer target, this target has %d layers",
                       config.num_target_layers, num_layers)


# --------------------------------------------------------------------------------------------
# Loading, saving, random init
# --------------------------------------------------------------------------------------------


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.iterdir()
                        if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".gguf"))
        hint = f" (found {', '.join(others)}; convert to safetensors)" if others else ""
        raise ValueError(f"no *.safetensors weights in {folder}{hint}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for key, tensor in load_file(str(file), device="cpu").items():
            if key in weights:
                raise ValueError(f"weight {key!r} appears in more than one file in {folder}")
            weights[key] = tensor
    return weights


def _summarise(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


def _check_weights(drafter: Drafter, weights: dict[str, torch.Tensor], folder: Path) -> None:
    expected = {k: tuple(v.shape) for k, v in drafter.checkpoint_state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    where = f"drafter checkpoint {folder} (projector_type {drafter.config.projector_type!r})"
    if missing:
        raise ValueError(f"{where} is missing weights: {_summarise(missing)}")
    if unexpected:
        raise ValueError(f"{where} has unexpected weights: {_summarise(unexpected)}")
    for key, shape in expected.items():
        if tuple(weights[key].shape) != shape:
            raise ValueError(f"{where}: weight {key} has shape {list(weights[key].shape)}, "
                             f"the config implies {list(shape)}")
        if not weights[key].is_floating_point():
            raise ValueError(f"{where}: weight {key} has dtype {weights[key].dtype}")


def load_drafter(path: str | Path, target: Any) -> Drafter:
    """Load a DFlash/Domino drafter folder (config.json + *.safetensors) for ``target``.

    ``target`` is a transformers causal LM or a TargetModel; the drafter is placed on the
    target's device in the target's dtype. Raises ValueError naming what does not fit.
    """
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"drafter folder {folder} has no config.json")
    config = DrafterConfig.from_json(json.loads(config_file.read_text()))
    embed, _, _ = _target_io(target)
    weights = _read_weights(folder)
    biases = {"gru_bias": "prefix_gru.bias_ih_l0" in weights or "prefix_gru.bias_hh_l0" in weights,
              "w1_bias": "embed_proj.0.bias" in weights,
              "w2_bias": "embed_proj.2.bias" in weights}
    with torch.device("meta"):
        drafter = Drafter(config, target, **biases)
    _check_weights(drafter, weights, folder)
    state = {(_HEAD_PREFIX + k if k.startswith(("prefix_gru.", "embed_proj.")) else k): v
             for k, v in weights.items()}
    drafter.load_state_dict(state, strict=True, assign=True)
    drafter.to(device=embed.weight.device, dtype=embed.weight.dtype)
    drafter.refresh_input_table()
    drafter.path = folder
    drafter.eval()
    logger.info("loaded %s drafter from %s: %d layers, block %d, %d slots, layers %s",
                config.projector_type, folder, config.num_layers, config.block_size,
                config.num_slots, config.target_layer_ids)
    return drafter


def save_drafter(drafter: Drafter, path: str | Path) -> None:
    """Write ``config.json`` + ``model.safetensors`` (z-lab / Domino layout) into ``path``."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    data = drafter.config.to_json()
    data["dtype"] = str(drafter.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    tensors = {k: v.detach().to("cpu").contiguous()
               for k, v in drafter.checkpoint_state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def random_drafter(target: Any, num_layers: int = 1, block_size: int = 16, domino: bool = True,
                   seed: int = 0, **cfg: Any) -> Drafter:
    """A randomly initialised drafter shaped for ``target`` (tests, training init).

    Widths, norm eps and RoPE follow the target's config; linear/GRU weights ~ N(0, 0.02²),
    norms 1. Defaults: mask_token_id V - 1, the DFlash default target layers, and for domino
    r = min(256, H), G = min(1024, H), shift_label True, P = 1. ``cfg`` overrides any
    DrafterConfig field.
    """
    embed, _, tc = _target_io(target)
    vocab, hidden = embed.weight.shape
    num_heads = tc.num_attention_heads
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    theta = rope.pop("rope_theta", getattr(tc, "rope_theta", 10000.0))
    rope_type = rope.get("rope_type", "default")
    fields: dict[str, Any] = dict(
        hidden_size=hidden, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=getattr(tc, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(tc, "head_dim", None) or hidden // num_heads,
        intermediate_size=tc.intermediate_size, vocab_size=vocab, block_size=block_size,
        mask_token_id=vocab - 1,
        target_layer_ids=default_target_layer_ids(tc.num_hidden_layers, num_layers),
        num_target_layers=tc.num_hidden_layers, rms_norm_eps=tc.rms_norm_eps,
        rope_theta=float(theta), rope_scaling=None if rope_type == "default" else rope,
        max_position_embeddings=getattr(tc, "max_position_embeddings", 40960),
        projector_type="domino" if domino else "dflash",
    )
    if domino:
        fields.update(emb_dim=min(256, hidden), gru_hidden_dim=min(1024, hidden),
                      shift_label=True, pure_draft_prefix_len=1)
    unknown = set(cfg) - {f.name for f in dataclasses.fields(DrafterConfig)}
    if unknown:
        raise TypeError(f"random_drafter got unknown config fields {sorted(unknown)}")
    fields.update(cfg)
    config = DrafterConfig(**fields)
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
    drafter.to(device=embed.weight.device, dtype=embed.weight.dtype)
    drafter.refresh_input_table()
    return drafter.eval()
