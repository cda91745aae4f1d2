"""The training objective (module docstring of dartree.train): block labels, base and
teacher-forced corrected logits, the gamma-weighted cross-entropies and the teacher-forced
accept lengths."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..drafter import Drafter
from .features import target_features


IGNORE = -100  # label of a slot past the end of its sequence


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, num_slots: int,
                 lengths: torch.Tensor | None = None) -> torch.Tensor:
    """[N, A, k]: slot m of the block at a predicts tokens[a + 1 + m]; with ``lengths`` [N],
    labels at or past a row's length are IGNORE (padding: no loss, end of accepted run)."""
    offsets = anchors[:, :, None] + 1 + torch.arange(num_slots, device=tokens.device)
    labels = tokens.gather(1, offsets.clamp_max(tokens.shape[1] - 1).flatten(1)).view(offsets.shape)
    if lengths is not None:
        labels = labels.masked_fill(offsets >= lengths.to(tokens.device)[:, None, None], IGNORE)
    return labels


def block_logits(drafter: Drafter, h: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(base logits, corrected logits or None) [N, A, k, V] with teacher forcing.

    The head's GRU reads the true tokens tokens[a .. a+k-1] (root first) through
    ``prefix_gru`` on target embeddings, so W_ih gets gradients; slot m >= P is corrected with
    the state after a + m, as ``tree.py`` does at inference.
    """
    base = drafter.base_logits(h).to(h.dtype)
    head = drafter.head
    if head is None:
        return base, None
    N, A, k, H = h.shape
    offsets = anchors[:, :, None] + torch.arange(k, device=tokens.device)
    # past a row's end (cached rows) the GRU reads padding: only ignored slots depend on it
    inputs = tokens.gather(1, offsets.clamp_max(tokens.shape[1] - 1).flatten(1)).view(N * A, k)
    emb = drafter.embed(inputs).to(h.dtype)
    g, _ = head.prefix_gru(emb)  # [N*A, k, G]: state after the root and m true tokens
    P = drafter.config.pure_draft_prefix_len
    delta = head.embed_proj(torch.cat([h.reshape(N * A, k, H)[:, P:], g[:, P:]], dim=-1))
    corrected = torch.cat([base[:, :, :P], base[:, :, P:] + delta.view(N, A, k - P, -1)], dim=2)
    return base, corrected


def _weighted_ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
                 ) -> torch.Tensor:
    """Mean over labelled slots of CE x weight, normalised by the weights of those slots."""
    ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten(), reduction="none",
                         ignore_index=IGNORE)
    w = weights.expand(labels.shape) * (labels != IGNORE)
    return (ce.view(labels.shape) * w).sum() / w.sum().clamp_min(1e-9)


def _accept_length(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean number of leading slots whose argmax equals the label (teacher forced); an ignored
    label ends the run."""
    hits = (logits.argmax(-1) == labels).long()
    return hits.cumprod(-1).sum(-1).float().mean()


def loss_terms(drafter: Drafter, target: Any, tokens: torch.Tensor, anchors: torch.Tensor,
               gamma: float, features: torch.Tensor | None = None,
               lengths: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Weighted CE of the base and corrected logits, and teacher-forced accept lengths.

    features: cached target features [N, L, n*H] (None: run the target on tokens);
    lengths: [N] valid tokens per row (None: every row is full)."""
    if features is None:
        features = target_features(target, tokens, drafter.config.target_layer_ids)
    h = drafter(features, tokens.gather(1, anchors), anchors)
    base, corrected = block_logits(drafter, h, tokens, anchors)
    labels = block_labels(tokens, anchors, drafter.num_slots, lengths)
    weights = torch.exp(-torch.arange(drafter.num_slots, dtype=torch.float32,
                                      device=tokens.device) / gamma)
    out = {"ce_base": _weighted_ce(base, labels, weights)}
    with torch.no_grad():
        out["accept_base"] = _accept_length(base, labels)
    if corrected is not None:
        out["ce_corrected"] = _weighted_ce(corrected, labels, weights)
        with torch.no_grad():
            out["accept_corrected"] = _accept_length(corrected, labels)
    return out
