"""Budget "search": the verify latency against tree size and the budget that maximises tokens/s."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from ..decoding import SpeculativeDecoder
from ..methods import TREE_METHODS, lookup
from ..target import TargetModel
from ..tree import DraftTree
from .config import AUTO_BUDGETS, AUTO_WIDTHS, LATENCY_SIZES, STAGES

@dataclass
class LatencyProfile:
    """Median seconds of one target verify pass over a tree of `sizes[i]` tokens (root included),
    after a prefix of `prefix_len` tokens. Calling it interpolates linearly (extrapolates past the
    ends) on the running maximum of the medians, so it never decreases with size."""

    sizes: list[int]
    seconds: list[float]
    prefix_len: int = 0
    device: str = "cpu"
    dtype: str = "float32"

    def __call__(self, size: float) -> float:
        xs, ys = self.sizes, _running_max(self.seconds)
        if len(xs) == 1:
            return ys[0]
        if size <= xs[0]:
            i = 0
        elif size >= xs[-1]:
            i = len(xs) - 2
        else:
            i = next(j for j in range(len(xs) - 1) if xs[j] <= size <= xs[j + 1])
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        return max(0.0, y0 + (y1 - y0) * (size - x0) / (x1 - x0))

    def to_dict(self) -> dict:
        return asdict(self)


def _running_max(values: list[float]) -> list[float]:
    out, top = [], -math.inf
    for v in values:
        top = max(top, v)
        out.append(top)
    return out


def _synthetic_tree(size: int, vocab: int, device, generator) -> DraftTree:
    """A 4-ary tree of `size` nodes (breadth-first, parents first) with random tokens."""
    parents = torch.tensor([-1] + [(i - 1) // 4 for i in range(1, size)], dtype=torch.int64)
    depths = torch.zeros(size, dtype=torch.int64)
    for i in range(1, size):
        depths[i] = depths[parents[i]] + 1
    tokens = torch.randint(0, vocab, (size,), generator=generator)
    return DraftTree(tokens.to(device), parents.to(device), depths.to(device), torch.zeros(size, device=device))


@torch.inference_mode()
def measure_verify_latency(target, sizes: Sequence[int] = LATENCY_SIZES, prefix_len: int = 128,
                           repeats: int = 5, warmup: int = 2, feature_layers: Sequence[int] = (),
                           seed: int = 0, exact: bool = False) -> LatencyProfile:
    """Time `TargetModel.verify` on synthetic trees of each size after a random prefill.

    target: a transformers causal LM (or TargetModel); feature_layers: the drafter's target layers
    (their capture is part of a real verify); exact: time the batch-invariant verify. Sizes are
    visited round-robin `repeats` times after `warmup` untimed rounds; each size's median is kept.
    """
    sizes = sorted({int(s) for s in sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"sizes must be ints >= 1, got {sizes}")
    model = target.model if isinstance(target, TargetModel) else target
    tm = TargetModel(model, feature_layers=list(feature_layers), exact=exact)
    generator = torch.Generator().manual_seed(seed)
    limit = getattr(model.config, "max_position_embeddings", None) or 1 << 20
    prefix_len = max(1, min(prefix_len, limit - max(sizes) - 1))
    tm.allocate(prefix_len + max(sizes))
    prefix = torch.randint(0, tm.vocab_size, (prefix_len,), generator=generator).to(tm.device)
    tm.prefill(prefix)
    trees = {s: _synthetic_tree(s, tm.vocab_size, tm.device, generator) for s in sizes}
    cuda = tm.device.type == "cuda"
    times: dict[int, list[float]] = {s: [] for s in sizes}
    for rep in range(warmup + repeats):
        for s in sizes:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            tm.verify(trees[s], check=False)
            if cuda:
                torch.cuda.synchronize()
            if rep >= warmup:
                times[s].append(time.perf_counter() - t0)
    tm.cache.free()
    return LatencyProfile(sizes, [statistics.median(times[s]) for s in sizes], prefix_len,
                          str(tm.device), str(tm.dtype).removeprefix("torch."))


@dataclass
class Candidate:
    """One (budget, width) of the auto search, with what it predicts per round.

    nodes:           mean verified tree size, root included
    expected_tokens: mean Σ exp(path score) over the tree's nodes (root included: the bonus)
    verify_s:        the latency profile at `nodes`
    other_s:         measured draft + tree + accept + commit seconds per round
    """

    budget: int
    width: int | None
    nodes: float
    expected_tokens: float
    verify_s: float
    other_s: float

    @property
    def seconds_per_round(self) -> float:
        return self.verify_s + self.other_s

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.seconds_per_round if self.seconds_per_round > 0 else math.inf

    def to_dict(self) -> dict:
        return dict(asdict(self), seconds_per_round=self.seconds_per_round, tokens_per_s=self.tokens_per_s)


def choose_budget(candidates: Sequence[Candidate]) -> Candidate:
    """The candidate with the most expected tokens per second (ties: the smaller budget, then width)."""
    if not candidates:
        raise ValueError("choose_budget needs at least one candidate")
    return max(candidates, key=lambda c: (c.tokens_per_s, -c.budget, -(c.width or 0)))


@dataclass
class AutoBudgetReport:
    method: str
    chosen: Candidate
    candidates: list[Candidate]
    latency: LatencyProfile
    calibration_prompts: int
    search_s: float

    def to_dict(self) -> dict:
        return dict(method=self.method, budget=self.chosen.budget, width=self.chosen.width,
                    chosen=self.chosen.to_dict(), candidates=[c.to_dict() for c in self.candidates],
                    latency=self.latency.to_dict(), calibration_prompts=self.calibration_prompts,
                    search_s=self.search_s)


def auto_budget(target, drafter, prompts: Sequence, method: str = "dartree",
                budgets: Sequence[int] = AUTO_BUDGETS, width: int = 12, widths: Sequence[int] = AUTO_WIDTHS,
                candidates: int = 64, depth_bonus: float = -0.2, latency: LatencyProfile | None = None,
                calibration_tokens: int = 16, max_new_tokens: int = 256, max_prompt_tokens: int = 256,
                exact: bool = False) -> tuple[int, int | None, AutoBudgetReport]:
    """Pick the budget (and, for dartree, width) that maximises expected tokens per second.

    prompts:  calibration prompts, token ids (lists of ints or LongTensors), at least one; each
              keeps its last `max_prompt_tokens` tokens
    latency:  a `measure_verify_latency` profile for this target and device (measured here at the
              prompts' mean length + max_new_tokens / 2 when None)
    Search: every budget at `width`, then (dartree) every width of `widths` at the best budget; a
    dartree budget above its supertree (slots × min(width, candidates) nodes) is folded into that
    cap. Each candidate is scored by expected tokens per round / (verify latency + the other stages'
    time per round): expected tokens = mean over prompts of Σ exp(tree.scores) of
    `SpeculativeDecoder.propose` (DDTree Prop. 1, the drafter's own estimate); the other stages'
    seconds from the decoder's own timings over a `calibration_tokens` generate on the first prompt.
    exact: decoders (and the measured latency) with exact=True.
    Returns (budget, width or None, report).
    """
    if method not in TREE_METHODS:
        raise ValueError(f"auto budget applies to the tree methods {', '.join(TREE_METHODS)}, got {method!r}")
    if drafter is None:
        raise ValueError(f"method {method!r} needs a drafter")
    prompts = [torch.as_tensor(p).reshape(-1).tolist()[-max_prompt_tokens:] for p in prompts]
    if not prompts or not all(prompts):
        raise ValueError("auto_budget needs at least one non-empty calibration prompt")
    budgets = sorted({int(b) for b in budgets})
    if not budgets or budgets[0] < 1:
        raise ValueError(f"budgets must be ints >= 1, got {budgets}")
    started = time.perf_counter()
    model = target.model if isinstance(target, TargetModel) else target
    if latency is None:
        prefix = int(statistics.fmean(len(p) for p in prompts)) + max_new_tokens // 2
        latency = measure_verify_latency(model, prefix_len=prefix, feature_layers=drafter.target_layer_ids,
                                         exact=exact)
    found: dict[tuple[int, int | None], Candidate] = {}

    def evaluate(budget: int, w: int | None) -> None:
        if w is not None:
            budget = min(budget, drafter.num_slots * min(w, candidates))
        if (budget, w) in found:
            return
        kwargs = dict(budget=budget, candidates=candidates, depth_bonus=depth_bonus)
        if w is not None:
            kwargs["width"] = w
        dec = SpeculativeDecoder(model, drafter, method=method, exact=exact, **kwargs)
        expected, nodes = [], []
        for ids in prompts:
            tree = dec.propose(ids)
            expected.append(float(torch.exp(tree.scores.double()).sum()))
            nodes.append(tree.num_nodes)
        res = dec.generate(prompts[0], max_new_tokens=calibration_tokens)
        rounds = max(1, len(res.acceptance_lengths))
        other = sum(res.timings.get(s, 0.0) for s in STAGES if s != "verify") / rounds
        mean_nodes = statistics.fmean(nodes)
        found[(budget, w)] = Candidate(budget, w, mean_nodes, statistics.fmean(expected),
                                       latency(mean_nodes), other)

    searches_width = lookup(method).width
    for budget in budgets:
        evaluate(budget, width if searches_width else None)
    if searches_width:
        best = choose_budget(list(found.values()))
        for w in sorted({int(w) for w in widths}):
            evaluate(best.budget, w)
    chosen = choose_budget(list(found.values()))
    report = AutoBudgetReport(method, chosen, list(found.values()), latency, len(prompts),
                              time.perf_counter() - started)
    return chosen.budget, chosen.width, report
