"""The (tokens, anchors, features, lengths) of each training step: windows of a token stream
(WindowBatches, optionally continued by the target) or whole sequences of a FeatureCache
(CachedBatches)."""

from __future__ import annotations

from typing import Any

import torch

from .corpus import TokenStream
from .features import FeatureCache, greedy_continue
from .options import TrainOptions


class WindowBatches:
    """(tokens [N, L], anchors [N, A], None, None) for each step, drawn from ``generator``.

    With self-distillation, windows come from a pool of ``distill_batches * N`` prompts
    continued by the target in one batched greedy decode; the pool is part of the checkpoint
    state so that a resumed run sees the same windows.
    """

    def __init__(self, target: Any, data: TokenStream, options: TrainOptions,
                 generator: torch.Generator, device: torch.device):
        self.target, self.data, self.options = target, data, options
        self.generator, self.device = generator, device
        self.pool: torch.Tensor | None = None

    def next(self) -> tuple[torch.Tensor, torch.Tensor, None, None]:
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
        return tokens, anchors.to(self.device), None, None


class CachedBatches:
    """(tokens [N, L], anchors [N, A], features [N, L, n*H], lengths [N]) from a FeatureCache.

    Each row is one whole sequence (cut to L, padded after its end); anchors lie in its
    answer, a block's root on an answer token (as at inference, where the first root is the
    target's own first answer token), labels past the end ignored. Sequences are drawn in
    proportion to their anchor positions, so every answer token is a root equally often whatever
    the length of its answer (drawn uniformly per sequence, a token of a 20-token answer was
    trained about six times as often as one of a 128-token answer)."""

    def __init__(self, cache: FeatureCache, options: TrainOptions, generator: torch.Generator,
                 device: torch.device):
        self.cache, self.options, self.generator, self.device = cache, options, generator, device
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

    def rows(self, picks: list[int], anchor_generator: torch.Generator):
        opts = self.options
        L, A = opts.seq_len, opts.anchors
        width = self.cache.features.shape[1]
        tokens = torch.full((len(picks), L), 0, dtype=torch.long)
        feats = torch.zeros(len(picks), L, width, dtype=torch.bfloat16)
        lengths = torch.zeros(len(picks), dtype=torch.long)
        anchors = torch.zeros(len(picks), A, dtype=torch.long)
        for r, i in enumerate(picks):
            ids, f, start = self.cache.sequence(i)
            n = min(len(ids), L)
            tokens[r, :n], feats[r, :n], lengths[r] = ids[:n], f[:n], n
            low, high = self.span(i)
            choices = max(1, high - low + 1)
            pick = (torch.randperm(choices, generator=anchor_generator)[:A] if A <= choices
                    else torch.randint(0, choices, (A,), generator=anchor_generator))
            anchors[r] = (pick + low).clamp_max(max(low, high))
        return (tokens.to(self.device), anchors.to(self.device), feats.to(self.device),
                lengths.to(self.device))

    def next(self):
        picks = torch.multinomial(self.weights, self.options.batch_size, replacement=True,
                                  generator=self.generator).tolist()
        return self.rows(picks, self.generator)
