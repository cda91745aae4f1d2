"""torch.compile in dartree: when a pass runs compiled (the policy) and the compiled copies.

Policy: `resolve_compile` turns a `compile=` argument (True, False, "auto") into yes or no;
`COMPILE_FLAGS` are the command lines' --compile values.

Copies: `compiled` makes the torch.compile'd copies of dartree's passes (the target's verify
forward, the drafter's block pass), one per model object and variant. Dynamo keeps its graphs per
code object, with a limit of 8 (`recompile_limit`) after which a fullgraph compile fails. Each
(model, variant) therefore gets its own copy of the function's code: its graphs (tree sizes, the
prefix length specialised and then symbolic) count against its own limit, and are reused by every
decoder and `generate` call on that model object. The copies go with the model (a weak key)."""

from __future__ import annotations

import time
import types
import weakref
from collections.abc import Callable, Hashable

import torch

COMPILE_CHOICES = (False, True, "auto")
COMPILE_FLAGS = {"on": True, "off": False, "auto": "auto"}  # the CLIs' --compile values


def resolve_compile(compile, exact: bool) -> bool:
    """Whether the verify forward (and, in a SpeculativeDecoder, the drafter's pass) runs
    compiled, for `compile` in COMPILE_CHOICES.

    "auto" compiles where it pays back, and so far that is nowhere: on a CPU a compiled verify is
    faster than the eager one, but compiling a tree size is paid back only after thousands of
    verifies, more than a generate call runs (bench/results/compile.md, made by bench/compile.py);
    on CUDA, step 6 of bench/gpu_check.sh measures it (inductor's kernels; CUDA graphs would need
    the prefix length on the device).
    True with exact=True is refused: inductor's fused kernels round differently from eager ones,
    and exact mode promises the bits of eager one-token decoding."""
    if not any(compile is c for c in COMPILE_CHOICES):
        raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")
    if compile is True and exact:
        raise ValueError("compile=True cannot keep exact=True's promise (the bits of eager one-token "
                         "decoding): compiled kernels fuse and round differently; use one or the other")
    return compile is True


_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> {key: compiled}


def compiled(function: Callable, owner: object, key: Hashable = None) -> Callable:
    """torch.compile(fullgraph=True) of a fresh copy of `function`, made once per (owner, key)."""
    copies = _COPIES.setdefault(owner, {})
    if (function, key) not in copies:
        code = function.__code__.replace()  # a new code object: a cache of its own
        copy = types.FunctionType(code, function.__globals__, function.__name__,
                                  function.__defaults__, function.__closure__)
        copies[function, key] = torch.compile(copy, fullgraph=True)
    return copies[function, key]


def timed(call: Callable[[], object]) -> tuple[object, float]:
    """(call(), its seconds if it compiled a graph, else 0.0): compile time kept apart from a
    stage's time."""
    graphs, begin = graphs_compiled(), time.perf_counter()
    result = call()
    return result, (time.perf_counter() - begin if graphs_compiled() != graphs else 0.0)


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (to tell a compiling call from a cached one)."""
    import torch._dynamo.utils  # dynamo imports slowly: only once something compiles

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
