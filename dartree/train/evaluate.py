"""Held-out evaluation of a drafter: the training objective's terms with fixed anchors."""

from __future__ import annotations

from typing import Any

import torch

from ..drafter import Drafter
from .batches import CachedBatches
from .features import FeatureCache, greedy_continue, target_features
from .objective import block_labels, block_logits, loss_terms, vocab_labels
from .options import TrainOptions, default_gamma


@torch.no_grad()
def evaluate(drafter: Drafter, target: Any, windows: torch.Tensor, options: TrainOptions,
             batch_size: int = 8, seed: int = 1234) -> dict[str, float]:
    """Mean weighted CE and teacher-forced accept lengths on ``windows`` [M, L] (fixed anchors).

    With ``options.self_distill`` each window's tail is replaced by the target's greedy
    continuation first (what the drafter must predict at temperature 0).
    """
    gamma = options.gamma or default_gamma(drafter.block_size)
    device = drafter.device
    generator = torch.Generator().manual_seed(seed)
    k, L = drafter.num_slots, windows.shape[1]
    totals: dict[str, float] = {}
    count = 0
    drafter.eval()
    for i in range(0, len(windows), batch_size):
        tokens = windows[i:i + batch_size].to(device).long()
        low = 1
        if options.self_distill:
            prompt = L - options.distill_new_tokens
            tokens = greedy_continue(target, tokens[:, :prompt], options.distill_new_tokens)
            low = prompt - 1
        choices = L - 1 - k - low + 1
        anchors = torch.stack([torch.randperm(choices, generator=generator)[:options.anchors]
                               for _ in range(len(tokens))]) + low
        terms = loss_terms(drafter, target, tokens, anchors.to(device), gamma)
        for key, value in terms.items():
            totals[key] = totals.get(key, 0.0) + value.item() * len(tokens)
        count += len(tokens)
    return {key: round(value / count, 4) for key, value in totals.items()}


@torch.no_grad()
def evaluate_cached(drafter: Drafter, target: Any, cache: FeatureCache, options: TrainOptions,
                    batch_size: int = 8, seed: int = 1234) -> dict[str, float]:
    """Mean weighted CE (and KL, when the cache has soft labels) and teacher-forced accept
    lengths over every sequence of ``cache`` (anchors drawn with a fixed seed inside each
    answer), and ``accept_by_slot``: per slot m, the share of blocks whose first m + 1 slots
    (corrected logits, else base) all hit their labels. A drafter with a draft vocabulary is
    scored over it, as it drafts (dartree.train.objective)."""
    gamma = options.gamma or default_gamma(drafter.block_size)
    batches = CachedBatches(cache, options, torch.Generator(), drafter.device)
    anchor_generator = torch.Generator().manual_seed(seed)
    totals: dict[str, float] = {}
    hits, count = None, 0
    drafter.eval()
    for i in range(0, len(cache), batch_size):
        picks = list(range(i, min(i + batch_size, len(cache))))
        batch = batches.rows(picks, anchor_generator)
        terms = loss_terms(drafter, target, batch.tokens, batch.anchors, gamma, batch.features,
                           batch.lengths, batch.soft)
        for key, value in terms.items():
            totals[key] = totals.get(key, 0.0) + value.item() * len(picks)
        runs, blocks = _leading_hits(drafter, target, batch)
        hits = runs if hits is None else hits + runs
        count += blocks
    out = {key: round(value / len(cache), 4) for key, value in totals.items()}
    out["accept_by_slot"] = [round(h, 4) for h in (hits / max(count, 1)).tolist()]
    return out


def _leading_hits(drafter: Drafter, target: Any, batch) -> tuple[torch.Tensor, int]:
    """([k] blocks whose slots 0..m all hit, number of blocks) with teacher forcing; a slot
    past a row's end counts as a miss."""
    features = batch.features
    if features is None:
        features = target_features(target, batch.tokens, drafter.config.target_layer_ids)
    h = drafter(features, batch.tokens.gather(1, batch.anchors), batch.anchors)
    base, corrected = block_logits(drafter, h, batch.tokens, batch.anchors)
    logits = corrected if corrected is not None else base
    labels = vocab_labels(block_labels(batch.tokens, batch.anchors, drafter.num_slots, batch.lengths),
                          drafter.draft_vocab)
    runs = (logits.argmax(-1) == labels).long().cumprod(-1)
    return runs.flatten(0, 1).sum(0).double(), runs.shape[0] * runs.shape[1]
