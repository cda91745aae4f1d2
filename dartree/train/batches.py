"""The Batch of each training step: windows of a token stream (WindowBatches, optionally
continued by the target) or whole sequences of a FeatureCache (CachedBatches)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .corpus import TokenStream
from .features import FeatureCache, greedy_continue
from .options import TrainOptions


class Batch(NamedTuple):
    """One training step's rows.

    tokens [N, L], anchors [N, A] (block roots); features [N, L, n*H] (None: run the target);
    lengths [N] valid tokens per row (None: every row is full); soft: the target's top-K soft
    labels (ids [N, L, K], log-probs [N, L, K]) at each position, or None."""

    tokens: torch.Tensor
    anchors: torch.Tensor
    features: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    soft: tuple[torch.Tensor, torch.Tensor] | None = None


class WindowBatches:
    """A Batch of tokens and anchors (no features, no soft labels) for each step, drawn from ``generator``.

    With self-distillation, windows come from a pool of ``distill_batches * N`` prompts
    continued by the target in one batched greedy decode; the pool is part of the checkpoint
    state so that a resumed run sees the same windows.
    """

    def __init__(self, target: Any, data: TokenStream, options: TrainOptions,
                 generator: torch.Generator, device: torch.device):
        self.target, self.data, self.options = target, data, options
        self.generator, self.device = generator, device
        self.pool: torch.Tensor | None = None

    def next(self) -> Batch:
        opts = self.options
        N, L, A, k = opts.batch_size, opts.seq_len, opts.anchors, opts.num_slots
        if opts.self_distill:
            prompt_len = L - opts.distill_new_tokens
            if self.pool is None or len(self.pool) == 0:
                prompts = self.data.sample(N * opts.distill_batches, prompt_len, self.generator)
                self.pool = greedy_continue(self.target, prompts.to(self.device),
                                            opts.distill_new_tokens).cpu()
            tokens, self.pool = self.pool[:N].to(self.device), self.pool[N:]
            low = prompt_len - 1  # the last prompt token opens the first block of target tokens
        else:
            tokens = self.data.sample(N, L, self.generator).to(self.device)
            low = 1
        high = L - 1 - k  # the last label a + k must lie in the window
        choices = high - low + 1
        anchors = torch.stack([
            torch.randperm(choices, generator=self.generator)[:A] if A <= choices
            else torch.randint(0, choices, (A,), generator=self.generator)
            for _ in range(N)]) + low
        return Batch(tokens, anchors.to(self.device))


class CachedBatches:
    """Batches of whole sequences of a FeatureCache, with their features, lengths and (when
    ``soft`` and the cache has them) soft labels.

    Each row is one whole sequence (cut to L, padded after its end); anchors lie in its
    answer, a block's root on an answer token (as at inference, where the first root is the
    target's own first answer token), labels past the end ignored. Sequences are drawn in
    proportion to their anchor positions, so every answer token is a root equally often whatever
    the length of its answer (drawn uniformly per sequence, a token of a 20-token answer was
    trained about six times as often as one of a 128-token answer)."""

    def __init__(self, cache: FeatureCache, options: TrainOptions, generator: torch.Generator,
                 device: torch.device, soft: bool | None = None):
        self.cache, self.options, self.generator, self.device = cache, options, generator, device
        self.soft = cache.topk > 0 if soft is None else soft
        if self.soft and not cache.topk:
            raise ValueError("soft labels asked for, but the feature cache has none (build it "
                             "with topk > 0)")
        self.pool = None  # checkpoint compatibility with WindowBatches
        self.weights = torch.tensor([float(self.span(i)[1] - self.span(i)[0] + 1) for i in range(len(cache))])
        if not bool((self.weights > 0).any()):
            raise ValueError("no cached sequence has an answer token to anchor a block at "
                             f"(seq_len {options.seq_len})")

    def span(self, i: int) -> tuple[int, int]:
        """[low, high]: the anchor positions of sequence i (high < low: none): answer tokens
        a >= 1 (a root has context) with at least one label inside the row (a <= n - 2)."""
        offsets, start = self.cache.offsets, int(self.cache.starts[i])
        n = min(int(offsets[i + 1] - offsets[i]), self.options.seq_len)
        return max(1, start), n - 2

    def rows(self, picks: list[int], anchor_generator: torch.Generator) -> Batch:
        opts = self.options
        L, A, K = opts.seq_len, opts.anchors, self.cache.topk
        width = self.cache.width
        tokens = torch.full((len(picks), L), 0, dtype=torch.long)
        feats = torch.zeros(len(picks), L, width, dtype=torch.bfloat16)
        lengths = torch.zeros(len(picks), dtype=torch.long)
        anchors = torch.zeros(len(picks), A, dtype=torch.long)
        soft_ids = torch.zeros(len(picks), L, K, dtype=torch.long) if self.soft else None
        soft_lp = torch.zeros(len(picks), L, K, dtype=torch.float32) if self.soft else None
        for r, i in enumerate(picks):
            ids, f, start = self.cache.sequence(i)
            n = min(len(ids), L)
            tokens[r, :n], feats[r, :n], lengths[r] = ids[:n], f[:n], n
            if self.soft:
                top_ids, top_lp = self.cache.soft(i)
                soft_ids[r, :n], soft_lp[r, :n] = top_ids[:n], top_lp[:n]
            low, high = self.span(i)
            choices = max(1, high - low + 1)
            pick = (torch.randperm(choices, generator=anchor_generator)[:A] if A <= choices
                    else torch.randint(0, choices, (A,), generator=anchor_generator))
            anchors[r] = (pick + low).clamp_max(max(low, high))
        soft = None if soft_ids is None else (soft_ids.to(self.device), soft_lp.to(self.device))
        return Batch(tokens.to(self.device), anchors.to(self.device), feats.to(self.device),
                     lengths.to(self.device), soft)

    def next(self) -> Batch:
        picks = torch.multinomial(self.weights, self.options.batch_size, replacement=True,
                                  generator=self.generator).tolist()
        return self.rows(picks, self.generator)
