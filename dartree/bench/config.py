"""What a benchmark run measures: its settings and the decoder configurations they expand to."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..compilation import resolve_compile
from ..methods import BASELINE, METHODS, TREE_METHODS, lookup
from .hf_baseline import HF_METHOD
from .llamacpp_baseline import LLAMACPP_METHOD, NgramMode

STAGES = ("draft", "tree", "verify", "accept", "commit")

LATENCY_SIZES = (1, 2, 4, 8, 13, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
# tree rows = budget + 1: from 16 rows on, multiples of 16 (AMX / tensor-core tiles)
AUTO_BUDGETS = (4, 8, 12, 15, 23, 31, 47, 63, 95, 127, 191, 255)
AUTO_WIDTHS = (4, 8, 16, 24)
# label suffixes of a configuration run with SpeculativeDecoder(ngram=False) / (fallback=True),
# in this order after the budget: "4+no-ngram+fallback"
NO_NGRAM = "+no-ngram"
FALLBACK = "+fallback"
SEARCH = "search"  # the budget found by `auto_budget` before the run (a fixed budget per method)


def is_fallback(label: str) -> bool:
    """Whether a configuration label names a run with the fallback on."""
    return label.endswith(FALLBACK)


def is_no_ngram(label: str) -> bool:
    """Whether a configuration label names a tree method run without the lookup (ngram=False)."""
    return NO_NGRAM in label


def variant_suffix(ngram: bool, fallback: bool) -> str:
    """The label suffix of a configuration's ngram= and fallback= (empty for the defaults)."""
    return ("" if ngram else NO_NGRAM) + (FALLBACK if fallback else "")


def budget_name(label: str) -> str:
    """The budget part of a label: "auto" of "auto+no-ngram", "-" of "+fallback"."""
    return label.split("+", 1)[0] or "-"


def series(method: str, label: str) -> str:
    """A method with its variant suffix, the budget left out: "dartree+no-ngram" of
    ("dartree", "16+no-ngram"); what a budget sweep varies along."""
    return method + ("+" + label.split("+", 1)[1] if "+" in label else "")


@dataclass
class BenchSettings:
    """What one benchmark run measures.

    budgets:           ints >= 1, "auto" (SpeculativeDecoder(budget="auto"): each round's size
                       chosen from the decoder's measured costs) and/or "search" (one fixed budget
                       and width per drafter tree method, found before the run by `auto_budget`)
                       (tree methods and ngram; chain methods run once)
    width, candidates, depth_bonus: the dartree settings of every fixed-budget run
    max_prompt_tokens: longer prompts keep their last tokens
    warmup_tokens:     new tokens of each configuration's untimed warm-up call
    seed:              temperature > 0: dartree's position-keyed sampling seed (seed + prompt
                       index); HF generate's torch seed
    check_equal:       every output must equal ar's (T > 0 too: keyed sampling), and at T = 0
                       HF generate's in float32
    hf_baseline:       also time transformers' own `generate` of the target (`hf_baseline.py`)
    llamacpp:          a GGUF file (the target's own) that llama.cpp also decodes, greedy, at
                       temperature 0 (`llamacpp_baseline.py`); None: not run
    threads:           CPU threads llama.cpp uses (the methods use torch's)
    exact:             dartree's methods (ar included) run with exact=True (batch-invariant
                       kernels: in 16-bit dtypes their outputs equal ar's bitwise); HF generate
                       stays the vendor-kernel baseline
    fallback:          SpeculativeDecoder's fallback= values each speculative configuration runs
                       with ((False,): as themselves; (False, True): each also with the fallback,
                       labelled budget + "+fallback"; budget "auto" runs once, with
                       fallback=False: it chooses its one-token rounds itself)
    ngram:             SpeculativeDecoder's ngram= values each drafter tree method runs with
                       ((True,): the lookup's branches in the tree, the decoder's default;
                       (False, True): each also without them, labelled budget + "+no-ngram");
                       method "ngram" is the lookup alone
    llamacpp_modes:    llama.cpp's n-gram modes run beside its plain decoding (`NgramMode.parse`
                       specs: "ngram_simple", "ngram_mod:n_match=8"); needs llamacpp
    compile:           SpeculativeDecoder's compile= (True, False, "auto") for dartree's methods;
                       graphs compile in each configuration's warm-up call (auto budgets are
                       picked from eager verify timings)
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
    hf_baseline: bool = True
    llamacpp: str | None = None
    threads: int = 1
    exact: bool = False
    compile: bool | str = "auto"
    fallback: Sequence[bool] = (False,)
    ngram: Sequence[bool] = (True,)
    llamacpp_modes: Sequence[str] = ()
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
            if b not in ("auto", SEARCH) and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
                raise ValueError(f"budgets must be ints >= 1, 'auto' or '{SEARCH}', got {b!r}")
        if any(lookup(m).budget for m in self.methods) and not self.budgets:
            raise ValueError("tree methods need at least one budget")
        for name in ("max_new_tokens", "max_prompt_tokens", "warmup_tokens", "auto_prompts", "auto_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be >= 2 (the first token comes from prefill), "
                             f"got {self.max_new_tokens}")
        if not self.fallback or any(not isinstance(f, bool) for f in self.fallback):
            raise ValueError(f"fallback must be a non-empty list of True/False, got {list(self.fallback)!r}")
        if not self.ngram or any(not isinstance(f, bool) for f in self.ngram):
            raise ValueError(f"ngram must be a non-empty list of True/False, got {list(self.ngram)!r}")
        modes = [NgramMode.parse(spec) for spec in self.llamacpp_modes]  # names a bad spec
        if modes and not self.llamacpp:
            raise ValueError("llamacpp_modes need llamacpp (the GGUF file llama.cpp decodes)")
        if len({m.label for m in modes}) != len(modes):
            raise ValueError(f"llamacpp_modes must differ, got {list(self.llamacpp_modes)}")
        resolve_compile(self.compile, self.exact)  # names a bad value or compile with exact


@dataclass(frozen=True)
class RunConfig:
    """One decoder configuration. budget: an int, "auto" (chosen every round) or None where the
    method has none; width None likewise; label: the budget as reported ("64", "auto", "search",
    "-"; "64+no-ngram" with ngram=False, "64+fallback", "+fallback" with fallback on; llama.cpp:
    its n-gram mode and settings); mode: llama.cpp's n-gram mode (None: plain decoding)."""

    method: str
    budget: int | str | None = None
    width: int | None = None
    label: str = "-"
    fallback: bool = False
    ngram: bool = True
    mode: NgramMode | None = None

    @property
    def name(self) -> str:
        return self.method if self.label == "-" else f"{self.method}@{self.label}"


def run_configs(settings: BenchSettings, searched: dict[str, tuple[int, int | None]]) -> list[RunConfig]:
    """HF generate and llama.cpp (when on: plain, then each n-gram mode), then ar (the
    references), then every method × fallback × ngram × budget in the order given.

    searched: budget "search"'s (budget, width) per drafter tree method (other methods skip it)."""
    configs = [RunConfig(HF_METHOD)] if settings.hf_baseline else []
    if settings.llamacpp:
        configs.append(RunConfig(LLAMACPP_METHOD))
        configs += [RunConfig(LLAMACPP_METHOD, label=m.label, mode=m)
                    for m in map(NgramMode.parse, settings.llamacpp_modes)]
    configs.append(RunConfig(BASELINE))
    for method in settings.methods:
        if method == BASELINE:
            continue
        spec = lookup(method)
        # ngram= changes the drafter's trees only (chains ignore it; method ngram is the lookup)
        ngrams = dict.fromkeys(settings.ngram) if method in TREE_METHODS else (True,)
        for fallback in dict.fromkeys(settings.fallback):  # duplicates run once
            for ngram in ngrams:
                suffix = variant_suffix(ngram, fallback)
                if not spec.budget:
                    configs.append(RunConfig(method, label=suffix or "-", fallback=fallback))
                    continue
                width = settings.width if spec.width else None
                for budget in dict.fromkeys(settings.budgets):
                    if budget == "auto":  # it picks its one-token rounds itself: run once,
                        if not fallback or False not in settings.fallback:  # without the fallback
                            configs.append(RunConfig(method, "auto", width,
                                                     "auto" + variant_suffix(ngram, False), False, ngram))
                    elif budget == SEARCH:
                        if method in searched:
                            chosen, chosen_width = searched[method]
                            configs.append(RunConfig(method, chosen, chosen_width, SEARCH + suffix,
                                                     fallback, ngram))
                    else:
                        configs.append(RunConfig(method, int(budget), width, str(budget) + suffix,
                                                 fallback, ngram))
    return configs
