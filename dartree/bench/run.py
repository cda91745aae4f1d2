"""The benchmark run: every configuration on every prompt, interleaved, with the lossless check."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..decoding import SpeculativeDecoder
from ..prompts import PromptSet
from ..target import TargetModel
from .aggregate import aggregate, auto_vs_sweep
from .budget import auto_budget, measure_verify_latency
from ..methods import BASELINE, TREE_METHODS, lookup
from .config import SEARCH, STAGES, BenchSettings, RunConfig, run_configs
from .conversations import answer_first_turns
from .encode import encode_prompts, uses_chat_template
from .hf_baseline import HF_METHOD, timed_hf_generate
from .llamacpp_baseline import LLAMACPP_METHOD, LlamaCpp, LlamaCppResult, agreement

EXTERNAL = (HF_METHOD, LLAMACPP_METHOD)  # baselines outside dartree's round loop
from .machine import PeakMemory, machine_info, model_info

log = logging.getLogger(__name__)


class OutputMismatch(RuntimeError):
    """A method's output at temperature 0 differs from `ar`'s or HF generate's: not lossless."""


@dataclass
class BenchResult:
    """Everything a run produced; `to_dict()` is what results.json holds."""

    settings: dict
    machine: dict
    models: dict
    rows: list[dict] = field(default_factory=list)
    aggregates: list[dict] = field(default_factory=list)
    search: dict = field(default_factory=dict)
    auto_vs_sweep: list[dict] = field(default_factory=list)
    llamacpp_failed: dict[str, str] = field(default_factory=dict)  # n-gram mode -> its error
    latency: dict | None = None
    wall_s: float = 0.0
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def response_row(set_name: str, prompt_index: int, cfg: RunConfig, temperature: float,
                 prompt_tokens: int, res, peak_memory: int) -> dict:
    """One response as a flat record (seconds, tokens, per-stage totals, accepted draft tokens
    by source; llama.cpp: the draft tokens its n-gram mode proposed and the target accepted, and
    as rounds its target passes: one per token after the first, less the accepted draft tokens)."""
    new = len(res.tokens)
    rounds, committed = len(res.acceptance_lengths), int(sum(res.acceptance_lengths))
    drafted, draft_accepted = 0, 0
    if isinstance(res, LlamaCppResult):
        drafted, draft_accepted = res.drafted, res.draft_accepted
        rounds = max(committed - draft_accepted, 1) if committed else 0
    decode = float(res.timings.get("decode", 0.0))
    return dict(set=set_name, prompt=prompt_index, method=cfg.method, budget=cfg.label,
                budget_value=cfg.budget if isinstance(cfg.budget, int) else None, width=cfg.width,
                temperature=float(temperature),
                prompt_tokens=prompt_tokens, new_tokens=new, rounds=rounds, committed=committed,
                speculative_rounds=int(sum(res.speculated)),
                # no round (the first token, from the prefill, ended the response): no τ, no TPOT
                tau=committed / rounds if rounds else None,
                decode_s=decode, tpot_s=decode / new if rounds else None,
                prefill_s=float(res.timings.get("prefill", 0.0)),
                stage_s={s: float(res.timings.get(s, 0.0)) for s in STAGES},
                accepted_by_source={k: int(v) for k, v in res.accepted_by_source.items()},
                drafted=drafted, draft_accepted=draft_accepted,
                peak_memory_bytes=int(peak_memory), match_ar=None, match_hf=None)


def check_equal(reference: list[int], tokens: list[int], cfg: RunConfig, set_name: str,
                prompt_index: int, reference_name: str = BASELINE) -> None:
    """Raise OutputMismatch unless `tokens` equals `reference` (the output of `reference_name`)
    token for token."""
    if tokens == reference:
        return
    where = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b),
                 min(len(reference), len(tokens)))
    got = tokens[where] if where < len(tokens) else "end of output"
    want = reference[where] if where < len(reference) else "end of output"
    budget = "" if cfg.label == "-" else f" (budget {cfg.label}: {cfg.budget}, width {cfg.width})"
    raise OutputMismatch(
        f"lossless check failed: method {cfg.method!r}{budget} differs from {reference_name!r} at temperature 0 "
        f"on prompt {set_name}[{prompt_index}] at new token {where}: {reference_name} gave {want}, {cfg.method} gave "
        f"{got} ({len(reference)} vs {len(tokens)} tokens)")


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
                  result: BenchResult | None = None, answers_cache=None) -> BenchResult:
    """Run every configuration on every prompt of every set at every temperature.

    target: a transformers causal LM (on its device, in its dtype); drafter: its Drafter (None for
    ar only and ngram); tokenizer: encodes string prompts (None: the byte fallback of
    `encode_prompts`); eos_token_id: stop token (default: the tokenizer's); answers_cache: a
    folder keeping the target's answers to two-turn sets' first turns (`conversations.py`; None:
    answered anew). Returns a BenchResult with rows and aggregates; raises OutputMismatch on a
    lossless-check failure, after storing what was measured so far in `result` when one is passed
    in.
    """
    settings = settings or BenchSettings()
    settings.validate()
    if drafter is None and any(lookup(m).drafter for m in settings.methods):
        raise ValueError("methods other than 'ar' need a drafter")
    model = target.model if isinstance(target, TargetModel) else target
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    if eos_token_id is None and tokenizer is not None:
        eos_token_id = tokenizer.eos_token_id
    vocab = model.get_output_embeddings().out_features
    prompt_sets = [answer_first_turns(ps, target, tokenizer, settings, eos_token_id, answers_cache)
                   for ps in prompt_sets]
    encoded = {ps.name: encode_prompts(ps, tokenizer, vocab, settings.max_prompt_tokens) for ps in prompt_sets}
    chat = {ps.name: uses_chat_template(ps, tokenizer) for ps in prompt_sets}
    if result is None:
        result = BenchResult(settings={}, machine={}, models={})
    result.settings = dict(asdict(settings), prompt_sets={ps.name: dict(source=ps.source, prompts=len(ps.prompts),
                                                                    chat_template=chat[ps.name])
                                                         for ps in prompt_sets},
                           eos_token_id=eos_token_id, tokenizer=type(tokenizer).__name__ if tokenizer else None)
    result.machine = machine_info(device, dtype)
    result.models = model_info(target, drafter)
    memory = PeakMemory(device)
    result.machine["peak_memory"] = memory.kind
    started = time.perf_counter()
    torch.manual_seed(settings.seed)

    for cfg in run_configs(settings, {m: (64, None) for m in TREE_METHODS}):  # search: any budget
        if cfg.method not in EXTERNAL:  # a bad setting fails now, not after the budget search
            _decoder(target, drafter, cfg, settings)
    searched: dict[str, tuple[int, int | None]] = {}
    if SEARCH in settings.budgets and any(m in TREE_METHODS for m in settings.methods):
        calibration = _round_robin([encoded[ps.name] for ps in prompt_sets], settings.auto_prompts)
        latency = measure_verify_latency(model, prefix_len=_typical_prefix(encoded, settings),
                                         feature_layers=drafter.target_layer_ids, exact=settings.exact)
        result.latency = latency.to_dict()
        for method in settings.methods:
            if method in TREE_METHODS:
                budget, width, report = auto_budget(
                    model, drafter, calibration, method=method, budgets=settings.auto_budgets,
                    width=settings.width, widths=settings.auto_widths, candidates=settings.candidates,
                    depth_bonus=settings.depth_bonus, latency=latency,
                    calibration_tokens=settings.auto_tokens, max_new_tokens=settings.max_new_tokens,
                    max_prompt_tokens=settings.max_prompt_tokens, exact=settings.exact)
                searched[method] = (budget, width)
                result.search[method] = report.to_dict()
                log.info("searched budget for %s: budget %d width %s (predicted %.1f tokens/s)",
                         method, budget, width, report.chosen.tokens_per_s)
    configs = run_configs(settings, searched)

    try:
        for temperature in settings.temperatures:
            # one decoder per configuration from its warm-up call to its last prompt, as a user
            # keeps one: its fallback gate, measured costs, calibration and lookup store carry
            # over from call to call. The warm-up prompt is the first one reversed: its output,
            # now in each decoder's store, is no measured prompt's answer
            warmup = next(iter(encoded.values()))[0][::-1]
            decoders = {cfg: _decoder(target, drafter, cfg, settings) for cfg in configs
                        if cfg.method not in EXTERNAL}
            for cfg in _at(configs, temperature, result.llamacpp_failed):  # warm-up: not measured
                _generate_or_fail(target, decoders.get(cfg), cfg, settings, warmup,
                                  settings.warmup_tokens, temperature, eos_token_id, settings.seed,
                                  result.llamacpp_failed)
            for ps in prompt_sets:
                _run_set(target, ps.name, encoded[ps.name], configs, settings, temperature,
                         eos_token_id, memory, result, progress, started, decoders)
    except OutputMismatch as exc:
        result.error = str(exc)
        raise
    finally:
        result.aggregates = aggregate(result.rows) if result.rows else []
        result.auto_vs_sweep = auto_vs_sweep(result.aggregates)
        result.wall_s = time.perf_counter() - started
    return result


def _decoder(target, drafter, cfg: RunConfig, settings: BenchSettings) -> SpeculativeDecoder:
    kwargs = dict(candidates=settings.candidates, depth_bonus=settings.depth_bonus)
    if cfg.budget is not None:
        kwargs["budget"] = cfg.budget
    if cfg.width is not None:
        kwargs["width"] = cfg.width
    return SpeculativeDecoder(target, drafter if lookup(cfg.method).drafter else None, method=cfg.method,
                              exact=settings.exact, compile=settings.compile, fallback=cfg.fallback,
                              ngram=cfg.ngram, **kwargs)


def _model(target):
    return target.model if isinstance(target, TargetModel) else target


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


def _at(configs: list[RunConfig], temperature: float, failed: dict[str, str]) -> list[RunConfig]:
    """The configurations that run at `temperature`: llama.cpp decodes greedily only, and its
    n-gram modes that failed run no more."""
    return [c for c in configs if c.method != LLAMACPP_METHOD
            or (temperature == 0 and (c.mode is None or c.label not in failed))]


def _generate(target, decoder, cfg, settings, ids, max_new_tokens, temperature, eos_token_id, seed):
    if cfg.method == HF_METHOD:
        return timed_hf_generate(_model(target), ids, max_new_tokens, temperature, eos_token_id, seed)
    if cfg.method == LLAMACPP_METHOD:  # a child process per call
        llama = LlamaCpp(settings.llamacpp, threads=settings.threads, mode=cfg.mode)
        return llama.generate(ids, max_new_tokens, eos_token_id)
    # T > 0: position-keyed sampling, so every method must return ar's tokens (checked)
    return decoder.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                            eos_token_id=eos_token_id, seed=seed if temperature > 0 else None)


def _generate_or_fail(target, decoder, cfg, settings, ids, max_new_tokens, temperature, eos_token_id,
                      seed, failed: dict[str, str]):
    """`_generate`; a llama.cpp n-gram mode that fails is recorded in `failed` (its label ->
    the error) and returns None, so the run goes on without it and the report names it."""
    try:
        return _generate(target, decoder, cfg, settings, ids, max_new_tokens, temperature,
                         eos_token_id, seed)
    except RuntimeError as exc:
        if cfg.method != LLAMACPP_METHOD or cfg.mode is None:
            raise
        failed[cfg.label] = str(exc)
        log.warning("llama.cpp %s failed; left out from here on: %s", cfg.label, exc)
        return None


def _check_outputs(row, tokens, references, cfg, set_name, index, strict_hf, sampled=False) -> None:
    """Every method's output against ar's, and (at T = 0) every output against HF generate's:
    strictly in float32 (`strict_hf`); in other dtypes a batched verify rounds differently from
    one-token steps, so the HF match is recorded (row["match_hf"]), not enforced. `sampled` (T > 0):
    HF generate samples with its own generator, so only the ar match is checked (position-keyed
    sampling: the same tokens for every method)."""
    if cfg.method == HF_METHOD:
        if not sampled:
            references[HF_METHOD] = tokens
        return
    if cfg.method == LLAMACPP_METHOD:  # its 8-bit activations may round to other tokens: compared
        references.setdefault(LLAMACPP_METHOD, []).append((row, tokens, cfg.mode))  # with ar's
        if cfg.mode is None:  # (once ar has run) and its modes' with its own, never required
            references["llama.cpp plain"] = tokens
        return
    if cfg.method == BASELINE:
        references[BASELINE] = tokens
    else:
        check_equal(references[BASELINE], tokens, cfg, set_name, index)
        row["match_ar"] = True
    if HF_METHOD in references:
        if strict_hf:
            check_equal(references[HF_METHOD], tokens, cfg, set_name, index, HF_METHOD)
        row["match_hf"] = tokens == references[HF_METHOD]


def _run_set(target, set_name, prompts, configs, settings, temperature, eos_token_id, memory,
             result, progress, started, decoders):
    strict_hf = next(_model(target).parameters()).dtype == torch.float32
    taus: dict[str, list[float]] = {}
    for index, ids in enumerate(prompts):
        references: dict = {}
        for cfg in _at(configs, temperature, result.llamacpp_failed):
            memory.start()
            res = _generate_or_fail(target, decoders.get(cfg), cfg, settings, ids,
                                    settings.max_new_tokens, temperature, eos_token_id,
                                    settings.seed + index, result.llamacpp_failed)
            if res is None:
                continue
            row = response_row(set_name, index, cfg, temperature, len(ids), res, memory.peak())
            if settings.check_equal:
                _check_outputs(row, res.tokens, references, cfg, set_name, index, strict_hf,
                               sampled=temperature > 0)
            result.rows.append(row)
            if row["tau"] is not None and cfg.method not in EXTERNAL:
                taus.setdefault(cfg.method, []).append(row["tau"])
        for row, tokens, mode in references.get(LLAMACPP_METHOD, []):
            if BASELINE in references:
                row["agree_ar"] = agreement(references[BASELINE], tokens)
            if mode is not None and "llama.cpp plain" in references:
                row["agree_llamacpp"] = agreement(references["llama.cpp plain"], tokens)
        if progress is not None:
            progress(Progress(set_name, temperature, index + 1, len(prompts), time.perf_counter() - started,
                              {m: statistics.fmean(v) for m, v in taus.items()}))
