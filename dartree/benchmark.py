"""End-to-end benchmark: acceptance length and speedup of every method, measured side by side.

    dartree bench                                   # bundled models, default prompt sets
    dartree bench --prompts humaneval --limit 20 --budgets 16,32,64,auto --out bench/results/e2e

Protocol (DESIGN.md "Speed, honestly measured"; research/ALGORITHMS.md §7):

- τ of a response = its mean tokens committed per round, bonus included; τ of a method = mean over
  responses of that (as DFlash and DDTree define it). `tau_micro` = Σ tokens / Σ rounds too.
- TPOT of a response = decode time / new tokens (prefill excluded, batch 1). A method's TPOT =
  mean over responses; speedup = `ar` TPOT ÷ the method's TPOT, `ar` running through the same loop
  on the same prompts with the same max tokens (`speedup_total` uses Σ decode / Σ tokens instead).
- Every configuration (method × budget) runs once on a warm-up prompt before anything is timed;
  the configurations then run interleaved prompt by prompt (`ar` first), so a change of machine
  load hits all of them alike.
- At temperature 0 every output is checked equal to `ar`'s, token for token; a mismatch stops the
  run with `OutputMismatch`, naming the method and the prompt.
- Stage times (draft, tree, verify, accept, commit) are per round; peak memory is CUDA's
  max_memory_allocated per call on a GPU, else the process's peak RSS (which never goes down).

`budget="auto"` (`auto_budget`): the verify latency as a function of tree size is measured once per
target and device (`measure_verify_latency`); for each candidate (budget, width) the drafter's own
estimate of the tokens a round commits, Σ over tree nodes of exp(path score) (DDTree Prop. 1, the
root's exp(0) = 1 being the bonus), is averaged over calibration prompts, and the candidate with the
largest expected tokens per second = expected tokens / (verify latency + the other stages' time
per round) is chosen.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from .decoding import METHODS, SpeculativeDecoder
from .prompts import PromptSet, load_prompt_sets
from .target import TargetModel
from .tree import DraftTree

log = logging.getLogger(__name__)

CHAIN_METHODS = ("ar", "dflash", "domino")          # no budget
TREE_METHODS = ("ddtree", "dartree-fixed", "dartree")
STAGES = ("draft", "tree", "verify", "accept", "commit")

LATENCY_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 257)
AUTO_BUDGETS = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
AUTO_WIDTHS = (4, 8, 16, 24)


class OutputMismatch(RuntimeError):
    """A method's output at temperature 0 differs from `ar`'s: the decoding is not lossless."""


# ------------------------------------------------------------------------------------ settings


@dataclass
class BenchSettings:
    """What one benchmark run measures.

    budgets:           ints >= 1 and/or "auto" (tree methods; chain methods run once)
    width, candidates, depth_bonus: the dartree settings of every fixed-budget run
    max_prompt_tokens: longer prompts keep their last tokens
    warmup_tokens:     new tokens of each configuration's untimed warm-up call
    seed:              sampling generators (temperature > 0) are seeded seed + prompt index
    auto_*:            the candidate grid and calibration of `auto_budget`
    """

    methods: Sequence[str] = METHODS
    temperatures: Sequence[float] = (0.0,)
    budgets: Sequence[int | str] = (8, 16, 32, 64, "auto")
    width: int = 12
    candidates: int = 64
    depth_bonus: float = -0.2
    max_new_tokens: int = 96
    max_prompt_tokens: int = 512
    warmup_tokens: int = 16
    seed: int = 0
    check_equal: bool = True
    auto_budgets: Sequence[int] = AUTO_BUDGETS
    auto_widths: Sequence[int] = AUTO_WIDTHS
    auto_prompts: int = 4
    auto_tokens: int = 16

    def validate(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise ValueError(f"methods must be a non-empty subset of {', '.join(METHODS)}, got {list(self.methods)}")
        for t in self.temperatures:
            if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise ValueError(f"temperatures must be finite numbers >= 0, got {t!r}")
        if not self.temperatures:
            raise ValueError("temperatures must not be empty")
        for b in self.budgets:
            if b != "auto" and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
                raise ValueError(f"budgets must be ints >= 1 or 'auto', got {b!r}")
        if any(m in TREE_METHODS for m in self.methods) and not self.budgets:
            raise ValueError("tree methods need at least one budget")
        for name in ("max_new_tokens", "max_prompt_tokens", "warmup_tokens", "auto_prompts", "auto_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be >= 2 (the first token comes from prefill), "
                             f"got {self.max_new_tokens}")


@dataclass(frozen=True)
class RunConfig:
    """One decoder configuration. budget/width None where the method has none;
    label: the budget as reported ("64", "auto", "-")."""

    method: str
    budget: int | None = None
    width: int | None = None
    label: str = "-"

    @property
    def name(self) -> str:
        return self.method if self.label == "-" else f"{self.method}@{self.label}"


def _configs(settings: BenchSettings, auto: dict[str, tuple[int, int | None]]) -> list[RunConfig]:
    """ar first (the reference), then every method × budget in the order given."""
    configs = [RunConfig("ar")]
    for method in settings.methods:
        if method == "ar":
            continue
        if method in CHAIN_METHODS:
            configs.append(RunConfig(method))
            continue
        width = settings.width if method == "dartree" else None
        for budget in dict.fromkeys(settings.budgets):  # duplicates run once
            if budget == "auto":
                chosen, chosen_width = auto[method]
                configs.append(RunConfig(method, chosen, chosen_width, "auto"))
            else:
                configs.append(RunConfig(method, int(budget), width, str(budget)))
    return configs


def _decoder(target, drafter, cfg: RunConfig, settings: BenchSettings) -> SpeculativeDecoder:
    kwargs = dict(candidates=settings.candidates, depth_bonus=settings.depth_bonus)
    if cfg.budget is not None:
        kwargs["budget"] = cfg.budget
    if cfg.width is not None:
        kwargs["width"] = cfg.width
    return SpeculativeDecoder(target, drafter if cfg.method != "ar" else None, method=cfg.method, **kwargs)


# ------------------------------------------------------------------------------------ prompts


def encode_prompts(prompt_set: PromptSet, tokenizer, vocab_size: int, max_tokens: int) -> list[list[int]]:
    """Token ids of each prompt (its last `max_tokens`). Without a tokenizer, each UTF-8 byte b
    becomes id b % vocab_size (a tokenizer-free path for random test models). Prompts that are
    already lists of ints pass through."""
    encoded = []
    for index, prompt in enumerate(prompt_set.prompts):
        if isinstance(prompt, str):
            if tokenizer is not None:
                ids = list(tokenizer(prompt).input_ids)
            else:
                ids = [b % vocab_size for b in prompt.encode("utf-8")]
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {prompt_set.name}[{index}] is empty after tokenization")
        encoded.append(ids[-max_tokens:])
    return encoded


# ------------------------------------------------------------------------------------ results


@dataclass
class BenchResult:
    """Everything a run produced; `to_dict()` is what results.json holds."""

    settings: dict
    machine: dict
    models: dict
    rows: list[dict] = field(default_factory=list)
    aggregates: list[dict] = field(default_factory=list)
    auto: dict = field(default_factory=dict)
    auto_vs_sweep: list[dict] = field(default_factory=list)
    latency: dict | None = None
    wall_s: float = 0.0
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def response_row(set_name: str, prompt_index: int, cfg: RunConfig, temperature: float,
                 prompt_tokens: int, res, peak_memory: int) -> dict:
    """One response as a flat record (seconds, tokens, per-stage totals)."""
    new = len(res.tokens)
    rounds = len(res.acceptance_lengths)
    decode = float(res.timings.get("decode", 0.0))
    return dict(set=set_name, prompt=prompt_index, method=cfg.method, budget=cfg.label,
                budget_value=cfg.budget, width=cfg.width, temperature=float(temperature),
                prompt_tokens=prompt_tokens, new_tokens=new, rounds=rounds,
                committed=int(sum(res.acceptance_lengths)),
                # no round (the first token, from the prefill, ended the response): no τ, no TPOT
                tau=(sum(res.acceptance_lengths) / rounds) if rounds else None,
                decode_s=decode, tpot_s=decode / new if rounds else None,
                prefill_s=float(res.timings.get("prefill", 0.0)),
                stage_s={s: float(res.timings.get(s, 0.0)) for s in STAGES},
                peak_memory_bytes=int(peak_memory), match_ar=None)


def aggregate(rows: list[dict]) -> list[dict]:
    """Per (set, method, budget, temperature) and pooled over sets (set "all"):

    tau          mean over responses of the per-response τ (responses with a round)
    tau_micro    Σ committed / Σ rounds
    tpot_s       mean over responses of decode / new tokens; tokens_per_s = 1 / tpot_s
    tpot_total_s Σ decode / Σ new tokens
    speedup      ar's tpot_s / tpot_s, ar of the same set and temperature (speedup_total likewise)
    stage_ms     Σ stage time / Σ rounds, milliseconds per round
    """
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        for set_name in (row["set"], "all"):
            key = (set_name, row["method"], row["budget"], row["temperature"])
            groups.setdefault(key, []).append(row)
    aggs = []
    for (set_name, method, budget, temperature), members in groups.items():
        # a response that ended at its first token (EOS from the prefill) ran no round: it has no
        # τ or TPOT and is left out of every mean (counted in `responses`, not in `decoded`)
        decoded = [r for r in members if r["rounds"] > 0]
        rounds = sum(r["rounds"] for r in decoded)
        new = sum(r["new_tokens"] for r in decoded)
        decode = sum(r["decode_s"] for r in decoded)
        tpot = statistics.fmean(r["tpot_s"] for r in decoded) if decoded else float("nan")
        aggs.append(dict(
            set=set_name, method=method, budget=budget, temperature=temperature,
            budget_value=members[0]["budget_value"], width=members[0]["width"],
            responses=len(members), decoded=len(decoded),
            tau=statistics.fmean(r["tau"] for r in decoded) if decoded else float("nan"),
            tau_micro=sum(r["committed"] for r in members) / rounds if rounds else 0.0,
            new_tokens=new, rounds=rounds, decode_s=decode,
            tpot_s=tpot, tpot_total_s=decode / new if new else float("nan"),
            tokens_per_s=1.0 / tpot if tpot > 0 else float("nan"),
            stage_ms={s: 1e3 * sum(r["stage_s"][s] for r in members) / rounds if rounds else 0.0
                      for s in STAGES},
            peak_memory_bytes=max(r["peak_memory_bytes"] for r in members),
            speedup=float("nan"), speedup_total=float("nan")))
    baseline = {(a["set"], a["temperature"]): a for a in aggs if a["method"] == "ar"}
    for a in aggs:
        ar = baseline.get((a["set"], a["temperature"]))
        if ar is not None and a["tpot_s"] > 0:
            a["speedup"] = ar["tpot_s"] / a["tpot_s"]
            a["speedup_total"] = ar["tpot_total_s"] / a["tpot_total_s"]
    order = {m: i for i, m in enumerate(METHODS)}
    aggs.sort(key=lambda a: (a["set"] != "all", a["set"], a["temperature"], order[a["method"]],
                             a["budget_value"] if a["budget"] != "auto" else math.inf))
    return aggs


def best_budgets(aggs: list[dict], set_name: str = "all", fixed_only: bool = True) -> dict[tuple, dict]:
    """{(method, temperature): the aggregate with the highest speedup} over budgets of a set."""
    best: dict[tuple, dict] = {}
    for a in aggs:
        if a["set"] != set_name or (fixed_only and a["budget"] == "auto"):
            continue
        key = (a["method"], a["temperature"])
        if key not in best or _speed(a) > _speed(best[key]):
            best[key] = a
    return best


def _speed(agg: dict) -> float:
    return agg["speedup"] if math.isfinite(agg["speedup"]) else -math.inf


def auto_vs_sweep(aggs: list[dict]) -> list[dict]:
    """For each tree method run with budget auto and with fixed budgets: auto's speedup against
    the best fixed budget's (set "all"), per temperature."""
    best = best_budgets(aggs)
    out = []
    for a in aggs:
        if a["set"] != "all" or a["budget"] != "auto":
            continue
        b = best.get((a["method"], a["temperature"]))
        if b is None:
            continue
        out.append(dict(method=a["method"], temperature=a["temperature"], auto_budget=a["budget_value"],
                        auto_width=a["width"], auto_speedup=a["speedup"], auto_tau=a["tau"],
                        best_budget=b["budget_value"], best_speedup=b["speedup"], best_tau=b["tau"],
                        ratio=a["speedup"] / b["speedup"] if b["speedup"] > 0 else float("nan")))
    return out


def check_equal(reference: list[int], tokens: list[int], cfg: RunConfig, set_name: str,
                prompt_index: int) -> None:
    """Raise OutputMismatch unless `tokens` equals ar's `reference` token for token."""
    if tokens == reference:
        return
    where = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b),
                 min(len(reference), len(tokens)))
    got = tokens[where] if where < len(tokens) else "end of output"
    want = reference[where] if where < len(reference) else "end of output"
    budget = "" if cfg.label == "-" else f" (budget {cfg.label}: {cfg.budget}, width {cfg.width})"
    raise OutputMismatch(
        f"lossless check failed: method {cfg.method!r}{budget} differs from 'ar' at temperature 0 on "
        f"prompt {set_name}[{prompt_index}] at new token {where}: ar gave {want}, {cfg.method} gave "
        f"{got} ({len(reference)} vs {len(tokens)} tokens)")


# ------------------------------------------------------------------------------------ machine


def machine_info(device: torch.device, dtype: torch.dtype) -> dict:
    """CPU model, threads, library versions, device and dtype: recorded with every result."""
    from . import __version__, ops

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = dict(cpu=cpu, cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
                torch=torch.__version__, python=platform.python_version(), platform=platform.platform(),
                dartree=__version__, extension=ops.HAS_EXTENSION, cuda_kernels=ops.HAS_CUDA_KERNELS,
                device=str(device), dtype=str(dtype).removeprefix("torch."))
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def model_info(target, drafter) -> dict:
    model = target.model if isinstance(target, TargetModel) else target
    cfg = model.config
    info = dict(target=type(model).__name__, target_path=getattr(cfg, "_name_or_path", "") or None,
                target_params=sum(p.numel() for p in model.parameters()),
                target_layers=getattr(cfg, "num_hidden_layers", None),
                vocab_size=model.get_output_embeddings().weight.shape[0])
    if drafter is not None:
        info.update(drafter_path=str(drafter.path) if getattr(drafter, "path", None) else None,
                    drafter_params=sum(p.numel() for p in drafter.parameters()),
                    drafter_block_size=drafter.block_size, drafter_slots=drafter.num_slots,
                    drafter_head=drafter.head is not None)
    return info


class _PeakMemory:
    """Peak memory of one call: CUDA max_memory_allocated, else the process's peak RSS."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.kind = "cuda_max_memory_allocated" if self.cuda else "process_peak_rss"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        import resource  # Unix only

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)


# ------------------------------------------------------------------------------------ the run


@dataclass
class Progress:
    """What a progress callback receives after each prompt (all configurations done)."""

    set_name: str
    temperature: float
    done: int
    total: int
    elapsed_s: float
    tau: dict[str, float]  # running τ per method, over its configurations so far


def run_benchmark(target, drafter, prompt_sets: list[PromptSet], settings: BenchSettings | None = None,
                  tokenizer=None, eos_token_id=None, progress: Callable[[Progress], None] | None = None,
                  result: BenchResult | None = None) -> BenchResult:
    """Run every configuration on every prompt of every set at every temperature.

    target: a transformers causal LM (on its device, in its dtype); drafter: its Drafter (None for
    ar only); tokenizer: encodes string prompts (None: the byte fallback of `encode_prompts`);
    eos_token_id: stop token (default: the tokenizer's). Returns a BenchResult with rows and
    aggregates; raises OutputMismatch on a lossless-check failure, after storing what was measured
    so far in `result` when one is passed in.
    """
    settings = settings or BenchSettings()
    settings.validate()
    if drafter is None and any(m != "ar" for m in settings.methods):
        raise ValueError("methods other than 'ar' need a drafter")
    model = target.model if isinstance(target, TargetModel) else target
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    if eos_token_id is None and tokenizer is not None:
        eos_token_id = tokenizer.eos_token_id
    vocab = model.get_output_embeddings().weight.shape[0]
    encoded = {ps.name: encode_prompts(ps, tokenizer, vocab, settings.max_prompt_tokens) for ps in prompt_sets}
    if result is None:
        result = BenchResult(settings={}, machine={}, models={})
    result.settings = dict(asdict(settings), prompt_sets={ps.name: dict(source=ps.source, prompts=len(ps.prompts))
                                                         for ps in prompt_sets},
                           eos_token_id=eos_token_id, tokenizer=type(tokenizer).__name__ if tokenizer else None)
    result.machine = machine_info(device, dtype)
    result.models = model_info(target, drafter)
    memory = _PeakMemory(device)
    result.machine["peak_memory"] = memory.kind
    started = time.perf_counter()
    torch.manual_seed(settings.seed)

    for cfg in _configs(settings, {m: (64, None) for m in TREE_METHODS}):  # auto: any valid budget
        _decoder(target, drafter, cfg, settings)  # a bad setting fails now, not after the auto search
    auto: dict[str, tuple[int, int | None]] = {}
    if "auto" in settings.budgets and any(m in TREE_METHODS for m in settings.methods):
        calibration = _round_robin([encoded[ps.name] for ps in prompt_sets], settings.auto_prompts)
        latency = measure_verify_latency(model, prefix_len=_typical_prefix(encoded, settings),
                                         feature_layers=drafter.target_layer_ids)
        result.latency = latency.to_dict()
        for method in settings.methods:
            if method in TREE_METHODS:
                budget, width, report = auto_budget(
                    model, drafter, calibration, method=method, budgets=settings.auto_budgets,
                    width=settings.width, widths=settings.auto_widths, candidates=settings.candidates,
                    depth_bonus=settings.depth_bonus, latency=latency,
                    calibration_tokens=settings.auto_tokens, max_new_tokens=settings.max_new_tokens,
                    max_prompt_tokens=settings.max_prompt_tokens)
                auto[method] = (budget, width)
                result.auto[method] = report.to_dict()
                log.info("auto budget for %s: budget %d width %s (predicted %.1f tokens/s)", method,
                         budget, width, report.chosen.tokens_per_s)
    configs = _configs(settings, auto)

    try:
        for temperature in settings.temperatures:
            first = next(iter(encoded.values()))[0]
            for cfg in configs:  # warm-up: excluded from every measurement
                _generate(target, drafter, cfg, settings, first, settings.warmup_tokens, temperature,
                          eos_token_id, device, settings.seed)
            for ps in prompt_sets:
                _run_set(target, drafter, ps.name, encoded[ps.name], configs, settings, temperature,
                         eos_token_id, device, memory, result.rows, progress, started)
    except OutputMismatch as exc:
        result.error = str(exc)
        raise
    finally:
        result.aggregates = aggregate(result.rows) if result.rows else []
        result.auto_vs_sweep = auto_vs_sweep(result.aggregates)
        result.wall_s = time.perf_counter() - started
    return result


def _round_robin(lists: list[list], count: int) -> list:
    """Up to `count` items taken from each list in turn: calibration prompts from every set."""
    out = []
    for i in range(max(len(x) for x in lists)):
        out.extend(x[i] for x in lists if i < len(x))
    return out[:count]


def _typical_prefix(encoded: dict[str, list[list[int]]], settings: BenchSettings) -> int:
    """Context length the latency profile is measured at: mean prompt + half the new tokens."""
    lengths = [len(ids) for prompts in encoded.values() for ids in prompts]
    return max(1, int(statistics.fmean(lengths)) + settings.max_new_tokens // 2)


def _generate(target, drafter, cfg, settings, ids, max_new_tokens, temperature, eos_token_id, device, seed):
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device).manual_seed(seed)
    dec = _decoder(target, drafter, cfg, settings)
    return dec.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                        eos_token_id=eos_token_id, generator=generator)


def _run_set(target, drafter, set_name, prompts, configs, settings, temperature, eos_token_id, device,
             memory, rows, progress, started):
    taus: dict[str, list[float]] = {}
    for index, ids in enumerate(prompts):
        reference = None
        for cfg in configs:
            memory.start()
            res = _generate(target, drafter, cfg, settings, ids, settings.max_new_tokens, temperature,
                            eos_token_id, device, settings.seed + index)
            row = response_row(set_name, index, cfg, temperature, len(ids), res, memory.peak())
            if temperature == 0 and settings.check_equal:
                if cfg.method == "ar":
                    reference = res.tokens
                else:
                    check_equal(reference, res.tokens, cfg, set_name, index)
                    row["match_ar"] = True
            rows.append(row)
            if row["tau"] is not None:
                taus.setdefault(cfg.method, []).append(row["tau"])
        if progress is not None:
            progress(Progress(set_name, temperature, index + 1, len(prompts), time.perf_counter() - started,
                              {m: statistics.fmean(v) for m, v in taus.items()}))


# ------------------------------------------------------------------------------------ auto budget


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
                           seed: int = 0) -> LatencyProfile:
    """Time `TargetModel.verify` on synthetic trees of each size after a random prefill.

    target: a transformers causal LM (or TargetModel); feature_layers: the drafter's target layers
    (their capture is part of a real verify). Sizes are visited round-robin `repeats` times after
    `warmup` untimed rounds; each size's median is kept.
    """
    sizes = sorted({int(s) for s in sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"sizes must be ints >= 1, got {sizes}")
    model = target.model if isinstance(target, TargetModel) else target
    tm = TargetModel(model, feature_layers=list(feature_layers))
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
    tm.kv = None
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
                ) -> tuple[int, int | None, AutoBudgetReport]:
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
        latency = measure_verify_latency(model, prefix_len=prefix, feature_layers=drafter.target_layer_ids)
    found: dict[tuple[int, int | None], Candidate] = {}

    def evaluate(budget: int, w: int | None) -> None:
        if w is not None:
            budget = min(budget, drafter.num_slots * min(w, candidates))
        if (budget, w) in found:
            return
        kwargs = dict(budget=budget, candidates=candidates, depth_bonus=depth_bonus)
        if w is not None:
            kwargs["width"] = w
        dec = SpeculativeDecoder(model, drafter, method=method, **kwargs)
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

    first_width = width if method == "dartree" else None
    for budget in budgets:
        evaluate(budget, first_width)
    if method == "dartree":
        best = choose_budget(list(found.values()))
        for w in sorted({int(w) for w in widths}):
            evaluate(best.budget, w)
    chosen = choose_budget(list(found.values()))
    report = AutoBudgetReport(method, chosen, list(found.values()), latency, len(prompts),
                              time.perf_counter() - started)
    return chosen.budget, chosen.width, report


# ------------------------------------------------------------------------------------ output


def _fmt(value, digits=2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if not math.isfinite(value) else f"{value:.{digits}f}"
    return str(value)


def format_table(result: BenchResult) -> str:
    """Markdown: per temperature, every configuration pooled over the prompt sets; then each
    method at its best budget per set; then auto against the sweep."""
    aggs = result.aggregates
    m = result.machine
    lines = [f"Machine: {m.get('cpu')} ({m.get('torch_threads')} threads), {m.get('device')} "
             f"{m.get('dtype')}, torch {m.get('torch')}" + (f", GPU {m['gpu']}" if "gpu" in m else "")]
    sets = result.settings.get("prompt_sets", {})
    lines.append("Prompts: " + ", ".join(f"{k} ({v['prompts']})" for k, v in sets.items())
                 + f"; max new tokens {result.settings.get('max_new_tokens')}; batch 1; prefill excluded")
    mem = "peak MiB" + (" (process RSS)" if m.get("peak_memory") == "process_peak_rss" else "")
    for temperature in sorted({a["temperature"] for a in aggs}):
        lines += ["", f"**Temperature {temperature:g}**, all prompt sets", "",
                  f"| method | budget | width | τ | TPOT ms | tokens/s | speedup | draft | tree | verify | "
                  f"accept+commit (ms/round) | {mem} |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for a in aggs:
            if a["set"] != "all" or a["temperature"] != temperature:
                continue
            budget = a["budget"] if a["budget"] != "auto" else f"auto ({a['budget_value']})"
            st = a["stage_ms"]
            lines.append(f"| {a['method']} | {budget} | {_fmt(a['width'])} | {_fmt(a['tau'])} | "
                         f"{_fmt(1e3 * a['tpot_s'], 3)} | {_fmt(a['tokens_per_s'], 1)} | "
                         f"**{_fmt(a['speedup'])}×** | {_fmt(st['draft'])} | {_fmt(st['tree'])} | "
                         f"{_fmt(st['verify'])} | {_fmt(st['accept'] + st['commit'])} | "
                         f"{a['peak_memory_bytes'] / 2**20:.0f} |")
    set_names = ["all"] + [s for s in dict.fromkeys(a["set"] for a in aggs) if s != "all"]
    if aggs:
        lines += ["", "Each method at its best fixed budget, per prompt set: speedup (τ, budget)", "",
                  "| method | T | " + " | ".join(set_names) + " |",
                  "|---|---|" + "---|" * len(set_names)]
        per_set = {s: best_budgets(aggs, s) for s in set_names}
        for method, temperature in best_budgets(aggs):
            if method == "ar":
                continue
            cells = []
            for s in set_names:
                a = per_set[s].get((method, temperature))
                cells.append("-" if a is None else f"{_fmt(a['speedup'])}× ({_fmt(a['tau'])}, {a['budget']})")
            lines.append(f"| {method} | {temperature:g} | " + " | ".join(cells) + " |")
    if result.auto_vs_sweep:
        lines += ["", "Budget auto against the best fixed budget of the sweep (all prompt sets)", "",
                  "| method | T | auto budget (width) | auto speedup | best fixed budget | best speedup "
                  "| auto / best |",
                  "|---|---|---|---|---|---|---|"]
        for r in result.auto_vs_sweep:
            lines.append(f"| {r['method']} | {r['temperature']:g} | {r['auto_budget']} ({_fmt(r['auto_width'])}) | "
                         f"{_fmt(r['auto_speedup'])}× | {r['best_budget']} | {_fmt(r['best_speedup'])}× | "
                         f"{_fmt(100 * r['ratio'], 0)}% |")
    return "\n".join(lines) + "\n"


def write_results(result: BenchResult, out: str | Path) -> dict[str, Path]:
    """results.json (settings, machine, models, rows, aggregates, auto) and table.md in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = dict(json=out / "results.json", table=out / "table.md")
    data = _finite(result.to_dict())
    paths["json"].write_text(json.dumps(data, indent=1, default=_json_default, allow_nan=False) + "\n")
    paths["table"].write_text(format_table(result))
    return paths


def _finite(value):
    """NaN and ±inf become None, so results.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default(value):
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def write_plots(result: BenchResult, out: str | Path) -> list[Path]:
    """PNGs in `out`: tau_hist.png (per-response τ of each method at its best budget) and
    budget_sweep_T<t>.png (speedup and τ against budget). Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install matplotlib") from None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    aggs, rows = result.aggregates, result.rows
    temperatures = sorted({a["temperature"] for a in aggs})
    best = best_budgets(aggs, fixed_only=False)
    methods = [m for m in METHODS if m != "ar" and any(a["method"] == m for a in aggs)]
    paths = []
    if methods:
        t0 = temperatures[0]
        cols = min(3, len(methods))
        nrows = -(-len(methods) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3 * nrows), squeeze=False, sharex=True)
        chosen = {m: best[(m, t0)] for m in methods}
        taus = {m: [r["tau"] for r in rows if r["method"] == m and r["budget"] == a["budget"]
                    and r["temperature"] == t0 and r["tau"] is not None] for m, a in chosen.items()}
        low = min((min(v) for v in taus.values() if v), default=1.0)
        high = max((max(v) for v in taus.values() if v), default=1.0)
        bins = [low + (high - low + 1e-9) * i / 20 for i in range(21)] if high > low else 10
        for ax, method in zip(axes.flat, methods):
            a = chosen[method]
            ax.hist(taus[method], bins=bins, color="C0", edgecolor="white")
            ax.axvline(a["tau"], color="C3", linestyle="--")
            budget = {"-": "", "auto": f", budget auto ({a['budget_value']})"}.get(
                a["budget"], f", budget {a['budget']}")
            ax.set_title(f"{method}{budget}: τ {a['tau']:.2f}", fontsize=10)
            ax.set_xlabel("τ of a response (tokens per round)")
            ax.set_ylabel("responses")
        for ax in list(axes.flat)[len(methods):]:
            ax.axis("off")
        fig.suptitle(f"Acceptance length per response, temperature {t0:g}, each method at its best budget")
        fig.tight_layout()
        paths.append(out / "tau_hist.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    for temperature in temperatures:
        fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
        for i, method in enumerate(methods):
            mine = [a for a in aggs if a["set"] == "all" and a["method"] == method and a["temperature"] == temperature]
            color = f"C{i}"
            if method in CHAIN_METHODS:
                for ax, key in ((ax_s, "speedup"), (ax_t, "tau")):
                    ax.axhline(mine[0][key], color=color, linestyle="--", label=f"{method} (chain)")
                continue
            fixed = sorted((a for a in mine if a["budget"] != "auto"), key=lambda a: a["budget_value"])
            autos = [a for a in mine if a["budget"] == "auto"]
            for ax, key in ((ax_s, "speedup"), (ax_t, "tau")):
                ax.plot([a["budget_value"] for a in fixed], [a[key] for a in fixed], "o-", color=color, label=method)
                for a in autos:
                    ax.plot([a["budget_value"]], [a[key]], "*", color=color, markersize=14,
                            markeredgecolor="black", label=f"{method} auto")
        ax_s.axhline(1.0, color="grey", linewidth=0.8)
        for ax, label in ((ax_s, "speedup over ar"), (ax_t, "τ (tokens per round)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (draft nodes verified per round)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        ax_t.legend(fontsize=8, loc="best")
        m = result.machine
        fig.suptitle(f"Temperature {temperature:g} — {m.get('device')} {m.get('dtype')}, {m.get('cpu')}", fontsize=10)
        fig.tight_layout()
        paths.append(out / f"budget_sweep_T{temperature:g}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


# ------------------------------------------------------------------------------------ CLI


class _StderrProgress:
    """A one-line progress bar on stderr: prompts done, running τ per method, elapsed time."""

    SHORT = {"dartree-fixed": "fixed"}

    def __init__(self, stream=sys.stderr):
        self.stream = stream

    def __call__(self, p: Progress) -> None:
        width = 20
        filled = int(width * p.done / p.total)
        taus = " ".join(f"{self.SHORT.get(m, m)} {t:.2f}" for m, t in p.tau.items() if m != "ar")
        line = (f"\r{p.set_name} T={p.temperature:g} [{'#' * filled}{'.' * (width - filled)}] "
                f"{p.done}/{p.total} | τ {taus} | {p.elapsed_s:.0f}s")
        self.stream.write(line)
        if p.done == p.total:
            self.stream.write("\n")
        self.stream.flush()


def _comma_list(kind):
    def parse(text: str):
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of {kind.__name__}, got {text!r}") from None
    return parse


def _budget(text: str) -> int | str:
    text = text.strip()
    return "auto" if text == "auto" else int(text)


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add `dartree bench` to an argparse subparsers object; its handler is `args.run(args)`."""
    p = subparsers.add_parser(
        "bench", help="measure τ and speedup of every method end to end",
        description="End-to-end benchmark: τ, time per output token and speedup over ar of every "
                    "method x budget, side by side on the same prompts; writes results.json, table.md "
                    "and PNG plots to --out and prints the table last.")
    p.add_argument("--target", help="target model folder (default: the bundled model)")
    p.add_argument("--drafter", help="drafter folder (default: the bundled drafter)")
    p.add_argument("--prompts", default="humaneval,mtbench,stdlib",
                   help="comma list of humaneval, mtbench, stdlib or .jsonl files ({\"prompt\": ...} per line)")
    p.add_argument("--limit", type=int, default=6, help="prompts per set (0 = all)")
    p.add_argument("--methods", type=_comma_list(str), default=list(METHODS),
                   help=f"comma list of {', '.join(METHODS)} (ar always runs: it is the reference)")
    p.add_argument("--temperatures", type=_comma_list(float), default=[0.0])
    p.add_argument("--budgets", type=_comma_list(_budget), default=[8, 16, 32, 64, "auto"],
                   help="comma list of ints and/or auto")
    p.add_argument("--width", type=int, default=12, help="dartree: nodes kept per level")
    p.add_argument("--candidates", type=int, default=64, help="dartree: tokens per position")
    p.add_argument("--depth-bonus", type=float, default=-0.2, help="dartree: β (<= 0)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--out", default="bench/results/e2e", help="folder for results.json, table.md, PNGs")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=_bench)
    return p


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_models(args):
    """(target, drafter, tokenizer) on args.device in args.dtype: folders, or the bundled set."""
    dtype = getattr(torch, args.dtype)
    if args.target:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .drafter import load_drafter

        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(args.device).eval()
        tokenizer = None
        if any((Path(args.target) / f).is_file() for f in _TOKENIZER_FILES):
            tokenizer = AutoTokenizer.from_pretrained(args.target)
        else:
            log.warning("no tokenizer in %s: prompts are encoded byte by byte", args.target)
        drafter = load_drafter(args.drafter, target) if args.drafter else None
        return target, drafter, tokenizer
    if args.drafter:
        raise ValueError("--drafter needs --target (the drafter is built for a target)")
    try:
        from .defaults import default_models
        return default_models(device=args.device, dtype=dtype)
    except (ImportError, FileNotFoundError) as exc:
        raise SystemExit(f"error: {exc}; or pass --target and --drafter folders") from None


def _bench(args) -> int:
    if args.dtype is None:
        args.dtype = "bfloat16" if str(args.device).startswith("cuda") else "float32"
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = BenchSettings(methods=args.methods, temperatures=args.temperatures, budgets=args.budgets,
                             width=args.width, candidates=args.candidates, depth_bonus=args.depth_bonus,
                             max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                             seed=args.seed)
    settings.validate()
    prompt_sets = load_prompt_sets(args.prompts, limit=args.limit or None)
    target, drafter, tokenizer = _load_models(args)
    if drafter is None and any(m != "ar" for m in settings.methods):
        raise ValueError("methods other than ar need --drafter")
    result = BenchResult(settings={}, machine={}, models={})
    out = Path(args.out)
    try:
        run_benchmark(target, drafter, prompt_sets, settings, tokenizer=tokenizer,
                      progress=_StderrProgress(), result=result)
    except OutputMismatch as exc:
        write_results(result, out)
        print(f"\nerror: {exc}\n(partial results in {out / 'results.json'})", file=sys.stderr)
        return 1
    paths = write_results(result, out)
    written = [paths["json"], paths["table"]]
    if not args.no_plots:
        try:
            written += write_plots(result, out)
        except ImportError as exc:
            print(f"warning: {exc} (plots skipped)", file=sys.stderr)
    print(f"wrote {', '.join(str(p) for p in written)} in {result.wall_s:.0f}s", file=sys.stderr)
    print(format_table(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m dartree.benchmark ...` / bench/e2e.py: the `dartree bench` command alone."""
    parser = argparse.ArgumentParser(prog="dartree")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command")
    add_bench_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = [a for a in argv if a in ("-v", "--verbose")]
    rest = [a for a in argv if a not in ("-v", "--verbose")]
    argv = verbose[:1] + ["bench"] + (rest[1:] if rest[:1] == ["bench"] else rest)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
