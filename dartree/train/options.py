"""What a training run is: the drafter's shape and the training settings (TrainOptions)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # DFlash loss-decay constants per block size


def default_gamma(block_size: int) -> float:
    """DFlash's gamma: 7 for B = 16, 5 for B = 10, 4 for B = 8, else 7 B / 16."""
    return _GAMMA.get(block_size, max(1.0, 7.0 * block_size / 16))


@dataclasses.dataclass
class TrainOptions:
    """Drafter shape and training settings.

    Shape: ``num_layers`` drafter layers, ``block_size`` B, ``target_layer_ids`` (None: the
    DFlash default for the target's depth), ``domino`` (add the head), ``emb_dim`` r and
    ``gru_hidden_dim`` G (None: min(256, H) and min(1024, H)), ``shift_label`` and
    ``prefix_len`` P, ``mask_token_id`` (None: V - 1), ``intermediate_size`` (None: the
    target's).
    Training: ``steps`` optimizer steps of ``batch_size`` windows of ``seq_len`` tokens with
    ``anchors`` blocks each; AdamW with ``lr`` (linear warmup over ``warmup`` of the steps, then
    cosine to ``min_lr`` x lr), ``weight_decay``, ``grad_clip``; ``gamma`` (None: the DFlash
    value for B); ``curriculum``: fraction of steps over which lam falls from 1 to 0;
    ``soft_weight`` w: each of the base and corrected terms is (1 - w) CE + w KL to the target's
    top-K distribution (needs a FeatureCache built with soft labels; 0: hard labels only).
    Self-distillation: ``self_distill``, with ``distill_new_tokens`` generated tokens per window
    (the rest of ``seq_len`` is the prompt), generated ``distill_batches`` steps' worth at a
    time (one batched decode amortises the per-token overhead of the target's forward).
    Checkpoints: every ``checkpoint_every`` steps into ``checkpoint_dir`` (None: no
    checkpoints); ``resume`` continues from one found there.
    """

    num_layers: int = 1
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    domino: bool = True
    emb_dim: int | None = None
    gru_hidden_dim: int | None = None
    shift_label: bool = True
    prefix_len: int = 1
    mask_token_id: int | None = None
    intermediate_size: int | None = None
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    anchors: int = 16
    lr: float = 6e-4
    warmup: float = 0.04
    min_lr: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None
    curriculum: float = 0.5
    soft_weight: float = 0.0
    self_distill: bool = False
    distill_new_tokens: int = 128
    distill_batches: int = 8
    bf16: bool = False
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    resume: bool = True

    @property
    def num_slots(self) -> int:
        return self.block_size if self.shift_label else self.block_size - 1

    def validate(self) -> None:
        """Raise ValueError naming the first bad option."""
        def positive(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

        for name in ("num_layers", "steps", "batch_size", "seq_len", "anchors",
                     "checkpoint_every", "distill_batches"):
            positive(name)
        for name in ("emb_dim", "gru_hidden_dim", "intermediate_size"):
            if getattr(self, name) is not None:
                positive(name)
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not 0 <= self.prefix_len <= self.num_slots:
            raise ValueError(f"prefix_len must be in [0, {self.num_slots}], got {self.prefix_len}")
        if self.target_layer_ids is not None and not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be > 0, got {self.lr}")
        for name in ("warmup", "min_lr", "curriculum", "soft_weight"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be > 0, got {self.grad_clip}")
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        # the first anchor needs one context token, the last label must lie in the window
        if self.seq_len < self.num_slots + 2:
            raise ValueError(f"seq_len must be >= {self.num_slots + 2} (a block of "
                             f"{self.num_slots} labels after one context token), got "
                             f"{self.seq_len}")
        if self.self_distill and not self.num_slots + 1 <= self.distill_new_tokens \
                <= self.seq_len - 1:
            raise ValueError(f"distill_new_tokens must be in [{self.num_slots + 1}, "
                             f"{self.seq_len - 1}] (one block of labels, one prompt token), "
                             f"got {self.distill_new_tokens}")

    def shape_dict(self) -> dict[str, Any]:
        """The fields a resumed run must share with its checkpoint."""
        keep = ("num_layers", "block_size", "target_layer_ids", "domino", "emb_dim",
                "gru_hidden_dim", "shift_label", "prefix_len", "mask_token_id",
                "intermediate_size", "steps", "batch_size", "seq_len", "anchors", "lr", "warmup",
                "min_lr", "weight_decay", "grad_clip", "gamma", "curriculum", "soft_weight",
                "self_distill",
                "distill_new_tokens", "distill_batches", "seed")
        return {k: getattr(self, k) for k in keep}
