"""A drafter's shapes and settings: the ``config.json`` of z-lab DFlash and Domino checkpoints,
and what a drafter reads from (and must match in) its target."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

ARCHITECTURE = "DFlashDraftModel"
PROJECTOR_TYPES = ("dflash", "domino")
_PROJECTOR_ALIASES = {"causal_v5": "domino"}
_STATIC_ROPE_TYPES = ("linear", "yarn", "llama3")


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

    @property
    def rope_type(self) -> str:
        """The RoPE type: "default" (plain RoPE) or the type in ``rope_scaling``."""
        return "default" if self.rope_scaling is None else _rope_type(self.rope_scaling)

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
            rope_type = self.rope_type
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
# The target a drafter is bound to
# --------------------------------------------------------------------------------------------


def target_io(target: Any) -> tuple[nn.Module, nn.Module, Any]:
    """(input embedding, LM head, transformers config) of an HF causal LM or a TargetModel.

    The drafter has no embedding or LM head of its own: it uses these two modules of its target.
    """
    hf = target if hasattr(target, "get_input_embeddings") else getattr(target, "model", None)
    if hf is None or not hasattr(hf, "get_input_embeddings"):
        raise TypeError(f"target must be a transformers causal LM or a TargetModel, "
                        f"got {type(target).__name__}")
    embed, lm_head = hf.get_input_embeddings(), hf.get_output_embeddings()
    if embed is None or lm_head is None:
        raise ValueError(f"target {type(hf).__name__} has no input embedding or LM head")
    config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    return embed, lm_head, config


def embedding_table(embed: nn.Module) -> torch.Tensor:
    """The [V, H] table of a target's input embedding: nn.Embedding's weight, or a packed GGUF
    embedding's rows dequantised (a copy, in the model's dtype)."""
    weight = getattr(embed, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else embed.dequantized().to(embed.dtype)


def module_dtype_device(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    """(dtype of the activations, device) of a target's embedding or LM head, dense or packed."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.dtype, weight.device
    return module.dtype, module.packed.device  # dartree.gguf's packed modules


def check_fits_target(config: DrafterConfig, embed_shape: torch.Size, num_layers: int) -> None:
    """Raise ValueError when ``config`` does not fit a target whose embedding is ``embed_shape``
    [V, H] and which has ``num_layers`` decoder layers (warn on a differing trained depth)."""
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


def config_for_target(target: Any, num_layers: int = 1, block_size: int = 16,
                      domino: bool = True, **overrides: Any) -> DrafterConfig:
    """A DrafterConfig shaped for ``target`` (a new drafter: training, tests, benchmarks).

    Widths, norm eps and RoPE follow the target's config. Defaults: mask_token_id V - 1, the
    DFlash default target layers, and for domino r = min(256, H), G = min(1024, H),
    shift_label True, P = 1. ``overrides`` sets any DrafterConfig field (TypeError on others).
    """
    embed, _, tc = target_io(target)
    vocab, hidden = embed.num_embeddings, embed.embedding_dim
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
    unknown = set(overrides) - {f.name for f in dataclasses.fields(DrafterConfig)}
    if unknown:
        raise TypeError(f"unknown drafter config fields {sorted(unknown)}")
    fields.update(overrides)
    return DrafterConfig(**fields)
