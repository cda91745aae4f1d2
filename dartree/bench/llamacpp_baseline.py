"""The CPU user's alternative as a baseline: llama.cpp decoding the same GGUF file.

Runs llama.cpp in-process through the `xllamacpp` package (an optional dependency: `pip install
xllamacpp`), on the same file, threads and prompt token ids as the methods, greedy, with the same
number of new tokens and the same stop tokens. Its clock follows its own report: decode time =
the time it spent generating (`predicted_ms`), per generated token; prefill = its prompt time.
Its tokens are read from a second, untimed call that asks for log-probabilities (which costs a
softmax per token): llama.cpp quantises activations to 8 bits in its dot products, so its
tokens may differ from dartree's, and the bench reports the share that agree rather than
requiring them to.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from ..decoding import GenerationResult

LLAMACPP_METHOD = "llama.cpp"
INSTALL = "pip install xllamacpp==2026.10.11549"


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("xllamacpp") is not None


class LlamaCpp:
    """One llama.cpp model (a GGUF file) kept loaded across calls."""

    def __init__(self, gguf_path: str | Path, threads: int, context: int = 4096):
        if not available():
            raise ModuleNotFoundError(f"the llama.cpp baseline needs xllamacpp: {INSTALL}")
        import xllamacpp

        path = Path(gguf_path)
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        params = xllamacpp.CommonParams()
        params.model.path = str(path)
        params.n_ctx = context
        params.n_parallel = 1
        params.verbosity = 0  # errors only: its per-request log lines would mix into the bench's
        params.cpuparams.n_threads = threads
        params.cpuparams_batch.n_threads = threads
        with _quiet():
            self._server = xllamacpp.Server(params)
        self.path = path

    def _complete(self, ids: list[int], max_new_tokens: int, eos: bool, logprobs: bool) -> dict:
        request = {"prompt": list(ids), "n_predict": max_new_tokens, "temperature": 0.0,
                   "top_k": 1, "cache_prompt": False, "stream": False, "ignore_eos": not eos}
        if logprobs:
            request["logprobs"] = 1
        with _quiet():
            out = self._server.handle_completions(request)
        if not isinstance(out, dict) or "choices" not in out:
            raise RuntimeError(f"llama.cpp returned no completion: {str(out)[:300]}")
        return out

    def generate(self, ids: list[int], max_new_tokens: int,
                 eos_token_id: int | list[int] | None = None) -> GenerationResult:
        """Greedy decoding after `ids`: the new tokens and llama.cpp's own timings (seconds).

        Stops at the model's end-of-generation tokens only when `eos_token_id` is given (llama.cpp
        knows its file's own; the bench passes the same ids to every method)."""
        eos = eos_token_id is not None
        timed = self._complete(ids, max_new_tokens, eos, logprobs=False)["timings"]
        content = self._complete(ids, max_new_tokens, eos, logprobs=True)["choices"][0]
        tokens = [entry["id"] for entry in (content.get("logprobs") or {}).get("content", [])]
        n = max(int(timed["predicted_n"]), 1)
        return GenerationResult(tokens=tokens, acceptance_lengths=[1] * max(n - 1, 0),
                                timings=dict(prefill=timed["prompt_ms"] / 1e3,
                                             decode=timed["predicted_ms"] / 1e3))


def agreement(reference: list[int], tokens: list[int]) -> float:
    """Share of positions where `tokens` equals `reference`, up to the first difference counted
    as the rest (a diverged continuation is not compared token by token)."""
    if not reference:
        return 1.0
    same = 0
    for a, b in zip(reference, tokens):
        if a != b:
            break
        same += 1
    return same / len(reference)


@contextlib.contextmanager
def _quiet():
    """llama.cpp logs every step to stderr (fd 2): silence it for the call."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            with contextlib.redirect_stderr(io.StringIO()):
                yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
