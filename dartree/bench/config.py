"""What a benchmark run measures: its settings and the decoder configurations they expand to."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..compilation import resolve_compile
from ..methods import BASELINE, METHODS, TREE_METHODS, lookup
from .hf_baseline import HF_METHOD
from .llamacpp_baseline import LLAMACPP_METHOD

STAGES = ("draft", "tree", "verify", "accept", "commit")

LATENCY_SIZES = (1, 2, 4, 8, 13, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
# tree rows = budget + 1: from 16 rows on, multiples of 16 (AMX / tensor-core tiles)
AUTO_BUDGETS = (4, 8, 12, 15, 23, 31, 47, 63, 95, 127, 191, 255)
AUTO_WIDTHS = (4, 8, 16, 24)
FALLBACK = "+fallback"  # the label suffix of a configuration run with SpeculativeDecoder(fallback=True)


def is_fallback(label: str) -> bool:
    """Whether a configuration label names a run with the fallback on."""
    return label.endswith(FALLBACK)


@dataclass
class BenchSettings:
    """What one benchmark run measures.

    budgets:           ints >= 1 and/or "auto" (tree methods; chain methods run once)
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
                       labelled budget + "+fallback")
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
        if not self.fallback or any(not isinstance(f, bool) for f in self.fallback):
            raise ValueError(f"fallback must be a non-empty list of True/False, got {list(self.fallback)!r}")
        resolve_compile(self.compile, self.exact)  # names a bad value or compile with exact


@dataclass(frozen=True)
class RunConfig:
    """One decoder configuration. budget/width None where the method has none; budget "auto": the
    decoder's per-round budget (a method the bench's own search does not cover: ngram);
    label: the budget as reported ("64", "auto", "-"; "64+fallback", "+fallback" with fallback on)."""

    method: str
    budget: int | str | None = None
    width: int | None = None
    label: str = "-"
    fallback: bool = False

    @property
    def name(self) -> str:
        return self.method if self.label == "-" else f"{self.method}@{self.label}"


def run_configs(settings: BenchSettings, auto: dict[str, tuple[int, int | None]]) -> list[RunConfig]:
    """HF generate and llama.cpp (when on), then ar (the references), then every method × budget
    in the order given."""
    configs = [RunConfig(HF_METHOD)] if settings.hf_baseline else []
    if settings.llamacpp:
        configs.append(RunConfig(LLAMACPP_METHOD))
    configs.append(RunConfig(BASELINE))
    for method in settings.methods:
        if method == BASELINE:
            continue
        spec = lookup(method)
        for fallback in dict.fromkeys(settings.fallback):  # duplicates run once
            suffix = FALLBACK if fallback else ""
            if not spec.budget:
                configs.append(RunConfig(method, label=suffix or "-", fallback=fallback))
                continue
            width = settings.width if spec.width else None
            for budget in dict.fromkeys(settings.budgets):
                if budget == "auto" and method not in auto:
                    # no drafter to search budgets with (ngram): the decoder's own budget="auto",
                    # chosen every round
                    configs.append(RunConfig(method, "auto", None, "auto" + suffix, fallback))
                elif budget == "auto":
                    chosen, chosen_width = auto[method]
                    configs.append(RunConfig(method, chosen, chosen_width, "auto" + suffix, fallback))
                else:
                    configs.append(RunConfig(method, int(budget), width, str(budget) + suffix, fallback))
    return configs
