"""The training objective (module docstring of dartree.train): block labels, base and
teacher-forced corrected logits, the gamma-weighted cross-entropies, the KL to the target's
top-K distribution (soft labels) and the teacher-forced accept lengths.

A drafter with a draft vocabulary (dartree.drafter.vocab) is scored over those tokens only, as it
drafts: its logits are [..., S] in the vocabulary's order, labels are mapped to their places in
it, a label outside it is ignored (no loss; it ends an accepted run, as it would at inference),
and the target's top-K distribution is renormalised over its tokens inside it. This is also what
makes a training step cheaper: the LM head and the softmax over S of V columns.
"""

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


def in_vocab(ids: torch.Tensor, vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(places, found): each id's index in the ascending ``vocab`` and whether it is there (a
    place of 0 where not). vocab None: the ids themselves, found where >= 0 (not IGNORE)."""
    if vocab is None:
        return ids.clamp_min(0), ids >= 0
    vocab = vocab.to(ids.device)
    places = torch.searchsorted(vocab, ids.clamp_min(0)).clamp_max(vocab.numel() - 1)
    found = (vocab[places] == ids) & (ids >= 0)
    return places.masked_fill(~found, 0), found


def vocab_labels(labels: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """Labels as places in the draft vocabulary, IGNORE where outside it (vocab None: as they are)."""
    if vocab is None:
        return labels
    places, found = in_vocab(labels, vocab)
    return places.masked_fill(~found, IGNORE)


def block_logits(drafter: Drafter, h: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(base logits, corrected logits or None) [N, A, k, S] with teacher forcing: S = V, or the
    drafter's draft vocabulary (its tokens in its order) when it has one.

    The head's GRU reads the true tokens tokens[a .. a+k-1] (root first) through
    ``prefix_gru`` on target embeddings, so W_ih gets gradients; slot m >= P is corrected with
    the state after a + m, as ``tree.py`` does at inference.
    """
    vocab = drafter.draft_vocab
    base = (drafter.base_logits(h) if vocab is None else drafter.vocab_logits(h)).to(h.dtype)
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
    act = head.embed_proj[1](head.embed_proj[0](torch.cat([h.reshape(N * A, k, H)[:, P:],
                                                            g[:, P:]], dim=-1)))
    w2, b2 = head.W_2, head.b_2
    if vocab is not None:  # the correction's rows of the draft vocabulary only
        ids = vocab.to(w2.device)
        w2, b2 = w2[ids], None if b2 is None else b2[ids]
    delta = F.linear(act, w2, b2)
    corrected = torch.cat([base[:, :, :P], base[:, :, P:] + delta.view(N, A, k - P, -1)], dim=2)
    return base, corrected


def _slot_weights(labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[N, A, k]: each slot's weight exp(-m / gamma), 0 at ignored labels, summing to 1."""
    w = weights.expand(labels.shape) * (labels != IGNORE)
    return w / w.sum().clamp_min(1e-9)


def _weighted_ce(logprobs: torch.Tensor, labels: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Sum over slots of weight x CE (weights from _slot_weights)."""
    picked = logprobs.gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    return -(picked * w).sum()


def _weighted_kl(logprobs: torch.Tensor, soft: tuple[torch.Tensor, torch.Tensor],
                 w: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over slots of weight x KL(p || q): p the target's top-K distribution (renormalised
    over those of its K tokens in the draft vocabulary: all of them when vocab is None), q the
    drafter's; soft = (ids, log-probs) [N, A, k, K]. A slot none of whose K tokens is in the
    vocabulary adds nothing."""
    ids, target_lp = soft
    places, found = in_vocab(ids, vocab)
    p_log = target_lp.float().masked_fill(~found, float("-inf")).log_softmax(-1)
    p_log = p_log.masked_fill(~found, 0.0)  # finite everywhere: no NaN reaches the gradient
    p = p_log.exp().masked_fill(~found, 0.0)
    kl = (p * (p_log - logprobs.gather(-1, places))).sum(-1)
    return (kl * w).sum()


def _soft_at_slots(soft: tuple[torch.Tensor, torch.Tensor], anchors: torch.Tensor,
                   num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log-probs) [N, L, K] -> [N, A, k, K]: slot m of the block at a is labelled
    tokens[a + 1 + m], the target's distribution at position a + m."""
    ids, lp = soft
    N, L, K = ids.shape
    offsets = (anchors[:, :, None] + torch.arange(num_slots, device=anchors.device)).clamp_max(L - 1)
    index = offsets.flatten(1)[..., None].expand(-1, -1, K)
    shape = (*offsets.shape, K)
    return ids.gather(1, index).view(shape), lp.gather(1, index).view(shape)


def _accept_length(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean number of leading slots whose argmax equals the label (teacher forced); an ignored
    label ends the run."""
    hits = (logits.argmax(-1) == labels).long()
    return hits.cumprod(-1).sum(-1).float().mean()


def loss_terms(drafter: Drafter, target: Any, tokens: torch.Tensor, anchors: torch.Tensor,
               gamma: float, features: torch.Tensor | None = None,
               lengths: torch.Tensor | None = None,
               soft: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Weighted CE (``ce_*``) and, with soft labels, weighted KL to the target's top-K
    distribution (``kl_*``) of the base and corrected logits; teacher-forced accept lengths.

    features: cached target features [N, L, n*H] (None: run the target on tokens);
    lengths: [N] valid tokens per row (None: every row is full);
    soft: the target's top-K (ids, log-probs) [N, L, K] at each position (None: no KL terms)."""
    if features is None:
        features = target_features(target, tokens, drafter.config.target_layer_ids)
    h = drafter(features, tokens.gather(1, anchors), anchors)
    base, corrected = block_logits(drafter, h, tokens, anchors)
    labels = vocab_labels(block_labels(tokens, anchors, drafter.num_slots, lengths),
                          drafter.draft_vocab)
    w = _slot_weights(labels, torch.exp(-torch.arange(drafter.num_slots, dtype=torch.float32,
                                                      device=tokens.device) / gamma))
    soft = None if soft is None else _soft_at_slots(soft, anchors, drafter.num_slots)
    out: dict[str, torch.Tensor] = {}
    for name, logits in (("base", base), ("corrected", corrected)):
        if logits is None:
            continue
        logprobs = logits.float().log_softmax(-1)  # once for both terms
        out[f"ce_{name}"] = _weighted_ce(logprobs, labels, w)
        if soft is not None:
            out[f"kl_{name}"] = _weighted_kl(logprobs, soft, w, drafter.draft_vocab)
        with torch.no_grad():
            out[f"accept_{name}"] = _accept_length(logits, labels)
    return out
