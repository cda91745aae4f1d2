"""The CPU user's alternative as a baseline: llama.cpp decoding the same GGUF file.

Runs llama.cpp through the `xllamacpp` package (an optional dependency: `pip install xllamacpp`), on
the same file, threads and prompt token ids as the methods, greedy, with the same number of new
tokens and the same stop tokens. Each call runs in a child process that loads the file, decodes and
exits: loaded in the bench's own process, llama.cpp's thread pool kept polling between its calls
and took the cores from every method timed after it (dartree's `ar` measured at half its speed).
Its clock follows its own report: decode time = the time it spent generating (`predicted_ms`),
per generated token; prefill = its prompt time.
Its tokens are read from a second, untimed call that asks for log-probabilities (which costs a
softmax per token): llama.cpp quantises activations to 8 bits in its dot products, so its
tokens may differ from dartree's, and the bench reports the share that agree rather than
requiring them to.

llama.cpp's own draftless speculation runs the same way, one mode per configuration
(`NgramMode`: `CommonParamsSpeculative.types` and that mode's settings): ngram_simple (the
continuation after the latest match of the last size_n tokens), ngram_map_k / ngram_map_k4v (keys
of size_n tokens mapped to the size_m tokens that followed them, min_hits times), ngram_mod (a
rolling hash of the last n_match tokens, drafts of n_min..n_max tokens) and ngram_cache (n-gram
statistics of the context, no settings). Their chains are verified by the target, so their tokens
are plain llama.cpp's where a batched verify rounds as one-token steps do (the bench reports the
share that agree). The defaults below suit short chats and functions (llama.cpp's own, size_n 12
and n_match 24, are sized for long rewrites and rarely fire on 128-token answers).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..decoding import GenerationResult

LLAMACPP_METHOD = "llama.cpp"
INSTALL = "pip install xllamacpp==2026.10.11549"

# each n-gram mode's settings (the fields of its CommonParamsSpeculative member) unless overridden
NGRAM_DEFAULTS: dict[str, dict[str, int]] = {
    "ngram_simple": dict(size_n=3, size_m=8),
    "ngram_map_k": dict(size_n=3, size_m=8, min_hits=1),
    "ngram_map_k4v": dict(size_n=3, size_m=8, min_hits=1),
    "ngram_mod": dict(n_match=4, n_min=1, n_max=16),
    "ngram_cache": {},
}


@dataclass(frozen=True)
class NgramMode:
    """One of llama.cpp's draftless speculation modes with its settings.

    name:     a key of NGRAM_DEFAULTS (llama.cpp's `common_speculative_type` without its prefix)
    settings: ((field, int value), ...): the mode's member of CommonParamsSpeculative, defaults
              of NGRAM_DEFAULTS overridden by what a spec names
    """

    name: str
    settings: tuple[tuple[str, int], ...] = ()

    @property
    def label(self) -> str:
        """How the bench names it: the mode, then its settings ("ngram_simple size_n=3 size_m=8")."""
        return " ".join([self.name] + [f"{k}={v}" for k, v in self.settings])

    @classmethod
    def parse(cls, spec: str) -> NgramMode:
        """"ngram_simple" or "ngram_simple:size_n=4:size_m=16" -> that mode with those settings
        over NGRAM_DEFAULTS; ValueError naming the modes or the settings a mode takes."""
        name, *pairs = [part.strip() for part in spec.strip().split(":")]
        if name not in NGRAM_DEFAULTS:
            raise ValueError(f"llama.cpp n-gram mode must be one of {', '.join(NGRAM_DEFAULTS)}, "
                             f"got {name!r}")
        settings = dict(NGRAM_DEFAULTS[name])
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key not in NGRAM_DEFAULTS[name] or not value.strip().lstrip("-").isdigit():
                takes = ", ".join(f"{k}=INT" for k in NGRAM_DEFAULTS[name]) or "no settings"
                raise ValueError(f"llama.cpp mode {name} takes {takes}, got {pair!r} in {spec!r}")
            settings[key] = int(value)
        return cls(name, tuple(settings.items()))


@dataclass
class LlamaCppResult(GenerationResult):
    """A llama.cpp call: `GenerationResult` with the draft tokens its n-gram mode proposed and
    the target accepted (0 and 0 for plain decoding)."""

    drafted: int = 0
    draft_accepted: int = 0


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("xllamacpp") is not None


class LlamaCpp:
    """llama.cpp on one GGUF file: each `generate` a child process (see the module doc)."""

    def __init__(self, gguf_path: str | Path, threads: int, context: int = 4096,
                 mode: NgramMode | None = None):
        if not available():
            raise ModuleNotFoundError(f"the llama.cpp baseline needs xllamacpp: {INSTALL}")
        path = Path(gguf_path)
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.path, self.threads, self.context, self.mode = path, threads, context, mode

    def generate(self, ids: list[int], max_new_tokens: int,
                 eos_token_id: int | list[int] | None = None) -> LlamaCppResult:
        """Greedy decoding after `ids`: the new tokens and llama.cpp's own timings (seconds).

        Stops at the model's end-of-generation tokens only when `eos_token_id` is given (llama.cpp
        knows its file's own; the bench passes the same ids to every method)."""
        job = dict(path=str(self.path), threads=self.threads, context=self.context, ids=list(ids),
                   max_new_tokens=max_new_tokens, eos=eos_token_id is not None,
                   mode=None if self.mode is None else [self.mode.name, dict(self.mode.settings)])
        proc = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(job), text=True,
                              capture_output=True, env=dict(os.environ, PYTHONPATH=_package_root()))
        if proc.returncode != 0:
            raise RuntimeError(f"llama.cpp failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        n = max(int(out["predicted_n"]), 1)
        steps = max(n - 1, 0)
        return LlamaCppResult(tokens=out["tokens"], acceptance_lengths=[1] * steps,
                              speculated=[False] * steps,
                              timings=dict(prefill=out["prompt_ms"] / 1e3,
                                           decode=out["predicted_ms"] / 1e3),
                              drafted=out["draft_n"], draft_accepted=out["draft_n_accepted"])


def _package_root() -> str:
    """The folder that holds the `dartree` package, first on the child's path."""
    root = str(Path(__file__).resolve().parents[2])
    rest = os.environ.get("PYTHONPATH")
    return root + (os.pathsep + rest if rest else "")


def _run_job(job: dict) -> dict:
    """In the child: load the file, decode twice (timed, then with log-probabilities for the
    token ids, which costs a softmax per token), return the tokens and the timed call's clock."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = job["path"]
    params.n_ctx = job["context"]
    params.n_parallel = 1
    params.verbosity = 0  # errors only: its per-request log lines would mix into the bench's
    params.cpuparams.n_threads = job["threads"]
    params.cpuparams_batch.n_threads = job["threads"]
    if job["mode"] is not None:
        name, settings = job["mode"]
        params.speculative.types = [getattr(xllamacpp.common_speculative_type,
                                            "COMMON_SPECULATIVE_TYPE_" + name.upper())]
        member = getattr(params.speculative, name)
        for key, value in settings.items():
            setattr(member, key, value)
    with _quiet():
        server = xllamacpp.Server(params)
    request = {"prompt": job["ids"], "n_predict": job["max_new_tokens"], "temperature": 0.0, "top_k": 1,
               "cache_prompt": False, "stream": False, "ignore_eos": not job["eos"]}
    results = []
    for logprobs in (False, True):
        with _quiet():
            out = server.handle_completions(dict(request, **({"logprobs": 1} if logprobs else {})))
        if not isinstance(out, dict) or "choices" not in out:
            raise RuntimeError(f"llama.cpp returned no completion: {str(out)[:300]}")
        results.append(out)
    timed = results[0]["timings"]
    content = results[1]["choices"][0]
    tokens = [entry["id"] for entry in (content.get("logprobs") or {}).get("content", [])]
    # draft_n / draft_n_accepted: reported once a draft was made (absent: none was)
    return dict(tokens=tokens, prompt_ms=timed["prompt_ms"], predicted_ms=timed["predicted_ms"],
                predicted_n=timed["predicted_n"], draft_n=timed.get("draft_n", 0),
                draft_n_accepted=timed.get("draft_n_accepted", 0))


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


if __name__ == "__main__":  # the child of LlamaCpp.generate: a job on stdin, its result on stdout
    result = _run_job(json.loads(sys.stdin.read()))
    print(json.dumps(result), flush=True)
    os._exit(0)  # without waiting on llama.cpp's server threads
