"""torch.compile'd copies of dartree's passes (the target's verify forward, the drafter's block
pass), one per model object and variant.

Dynamo keeps its graphs per code object, with a limit of 8 (`recompile_limit`) after which a
fullgraph compile fails. Each (model, variant) therefore gets its own copy of the function's code:
its graphs (tree sizes, the prefix length specialised and then symbolic) count against its own
limit, and are reused by every decoder and `generate` call on that model object. The copies go
with the model (a weak key)."""

from __future__ import annotations

import time
import types
import weakref
from collections.abc import Callable, Hashable

import torch

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
