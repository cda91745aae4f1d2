"""`dartree bench`: the command line of the benchmark."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from ..cli_options import (add_draft_vocab_option, add_model_option, add_weights_option,
                           apply_draft_vocab, packed_choice)
from ..compilation import COMPILE_FLAGS
from ..methods import BASELINE, METHODS, lookup
from ..model_files import drafter_free_methods
from ..prompts import load_prompt_sets
from .config import SEARCH, BenchSettings
from .encode import default_prompt_sets
from .hf_baseline import HF_METHOD
from .llamacpp_baseline import NGRAM_DEFAULTS
from .report import format_table, write_plots, write_results
from .run import BenchResult, OutputMismatch, Progress, run_benchmark

log = logging.getLogger(__name__)


class _StderrProgress:
    """A one-line progress bar on stderr: prompts done, running τ per method, elapsed time."""

    SHORT = {"dartree-fixed": "fixed"}

    def __init__(self, stream=None):
        self.stream = stream  # None: sys.stderr as it is at each call (not at import)

    def __call__(self, p: Progress) -> None:
        width = 20
        filled = int(width * p.done / p.total)
        taus = " ".join(f"{self.SHORT.get(m, m)} {t:.2f}" for m, t in p.tau.items()
                        if m not in (BASELINE, HF_METHOD))
        line = (f"\r{p.set_name} T={p.temperature:g} [{'#' * filled}{'.' * (width - filled)}] "
                f"{p.done}/{p.total} | τ {taus} | {p.elapsed_s:.0f}s")
        stream = self.stream or sys.stderr
        stream.write(line)
        if p.done == p.total:
            stream.write("\n")
        stream.flush()


def _comma_list(kind):
    def parse(text: str):
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of {kind.__name__}, got {text!r}") from None
    return parse


def _budget(text: str) -> int | str:
    text = text.strip()
    return text if text in ("auto", SEARCH) else int(text)


# --fallback and --ngram: the SpeculativeDecoder values each configuration runs with
SWITCH_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}
FALLBACK_CHOICES = NGRAM_CHOICES = SWITCH_CHOICES


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add `dartree bench` to an argparse subparsers object; its handler is `args.run(args)`."""
    p = subparsers.add_parser(
        "bench", help="measure τ and speedup of every method end to end",
        description="End-to-end benchmark: τ, time per output token and speedup over ar and over "
                    "transformers' generate of every method x budget, side by side on the same "
                    "prompts; writes results.json, table.md and PNG plots to --out and prints the "
                    "table last.")
    p.add_argument("--target", help="target: a model folder or a GGUF file (packed, its tokenizer "
                                    "from the file; default: --model)")
    add_model_option(p)
    p.add_argument("--drafter", help="drafter folder (default: --model's drafter, if it has one); "
                                     "'random': a random-init drafter for the target (costs only, "
                                     "no acceptance)")
    p.add_argument("--prompts", default=None,
                   help="comma list of humaneval, mtbench, mtbench2 (two-turn chats: the target's own "
                        "first answer in the context), edit (change a function and return it whole), "
                        "stdlib or .jsonl files ({\"prompt\": ...} per line); default "
                        "humaneval,mtbench for a chat model, + stdlib otherwise. With a chat template "
                        "every set but stdlib goes in as user messages")
    p.add_argument("--limit", type=int, default=6, help="prompts per set (0 = all)")
    p.add_argument("--methods", type=_comma_list(str), default=None,
                   help=f"comma list of {', '.join(METHODS)} (ar always runs: it is the reference; "
                        "default: all of them with a drafter, ar and ngram without one)")
    p.add_argument("--temperatures", type=_comma_list(float), default=[0.0, 1.0])
    p.add_argument("--budgets", type=_comma_list(_budget), default=[8, 16, 32, 64, "auto"],
                   help="comma list of ints, auto (SpeculativeDecoder(budget='auto'): each round's "
                        f"size from measured costs) and/or {SEARCH} (a fixed budget per tree method "
                        "found before the run from timed verifies and the drafter's estimates)")
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
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline")
    add_weights_option(p)
    add_draft_vocab_option(p)
    p.add_argument("--llamacpp", default="auto",
                   help="llama.cpp on the same GGUF file as a baseline (needs xllamacpp): 'auto' (on "
                        "for a target that is a GGUF file, SmolLM2's and the coder's included, when "
                        "xllamacpp is installed), 'off', or a GGUF path")
    p.add_argument("--fallback", choices=list(FALLBACK_CHOICES), default="off",
                   help="speculative methods with SpeculativeDecoder(fallback=...): off (as "
                        "themselves), on, or both side by side (rows labelled budget+fallback)")
    p.add_argument("--ngram", choices=list(NGRAM_CHOICES), default="on",
                   help="tree methods with SpeculativeDecoder(ngram=...): on (the lookup's branches in "
                        "the tree, the default), off (the drafter's tree alone), or both side by side "
                        "(rows labelled budget+no-ngram); --methods ngram runs the lookup alone")
    p.add_argument("--llamacpp-ngram", default="all",
                   help="llama.cpp's n-gram modes beside its plain decoding: 'all' (each of "
                        f"{', '.join(NGRAM_DEFAULTS)} with its default settings), 'off', or a comma "
                        "list of modes with settings, e.g. ngram_simple:size_n=4:size_m=16,ngram_mod")
    p.add_argument("--answers-cache", default=None,
                   help="folder keeping the target's answers to two-turn sets' first turns (default: "
                        "bench_answers in dartree's user cache)")
    p.add_argument("--exact", action="store_true",
                   help="run dartree's methods with exact=True (bit-exact in bfloat16/float16)")
    p.add_argument("--compile", choices=list(COMPILE_FLAGS), default="auto",
                   help="dartree's methods with compile=True/False/'auto' (compiled in the warm-up)")
    p.set_defaults(run=_bench)
    return p


def _load_models(args):
    """(target, drafter, tokenizer) on args.device in args.dtype: --target (a folder or a GGUF
    file), or the --model set; --drafter random: a random-init drafter (block 16) for the target."""
    target, drafter, tokenizer = _load_target(args)
    if args.drafter == "random":
        from ..testing import random_drafter

        drafter = random_drafter(target, block_size=16)
    return target, drafter, tokenizer


def _load_target(args):
    from ..model_files import load_target

    dtype = getattr(torch, args.dtype)
    random = args.drafter == "random"
    packed = packed_choice(args)
    if args.target:
        from ..drafter import load_drafter

        target, tokenizer = load_target(args.target, dtype, args.device, packed)
        if tokenizer is None:
            log.warning("no tokenizer in %s: prompts are encoded byte by byte", args.target)
        drafter = load_drafter(args.drafter, target) if args.drafter and not random else None
        return target, drafter, tokenizer
    if args.drafter and not random:
        raise ValueError("--drafter needs --target (the drafter is built for a target)")
    try:
        from ..defaults import default_models
        return default_models(args.model, device=args.device, dtype=dtype, packed=packed)
    except (ImportError, FileNotFoundError) as exc:
        raise SystemExit(f"error: {exc}; or pass --target and --drafter folders") from None


def _llamacpp_file(args) -> str | None:
    """The GGUF file llama.cpp decodes beside the methods, or None."""
    from . import llamacpp_baseline

    if args.llamacpp == "off":
        return None
    if args.llamacpp != "auto":
        if not llamacpp_baseline.available():
            raise SystemExit(f"error: --llamacpp needs xllamacpp: {llamacpp_baseline.INSTALL}")
        return args.llamacpp
    if not llamacpp_baseline.available():
        return None
    from ..model_files import is_gguf

    if args.target:
        return args.target if is_gguf(args.target) else None
    from .. import defaults

    if args.model == "smollm2":
        return str(defaults.smollm2_gguf())
    if args.model == "coder":
        try:
            return str(defaults.coder_folder() / defaults.CODER_GGUF)
        except ImportError as exc:
            raise SystemExit(f"error: {exc}") from None
    return None


def _llamacpp_modes(args, gguf: str | None) -> list[str]:
    """The n-gram mode specs llama.cpp runs on `gguf` (none when it does not run)."""
    if args.llamacpp_ngram == "off" or gguf is None:
        return []
    if args.llamacpp_ngram == "all":
        return list(NGRAM_DEFAULTS)
    return [spec.strip() for spec in args.llamacpp_ngram.split(",") if spec.strip()]


def _answers_cache(args) -> Path:
    if args.answers_cache:
        return Path(args.answers_cache)
    from ..defaults import cache_dir

    return cache_dir() / "bench_answers"


def _bench(args) -> int:
    if args.dtype is None:
        args.dtype = "bfloat16" if str(args.device).startswith("cuda") else "float32"
    if args.threads:
        torch.set_num_threads(args.threads)
    gguf = _llamacpp_file(args)
    settings = BenchSettings(methods=args.methods or METHODS, temperatures=args.temperatures, budgets=args.budgets,
                             width=args.width, candidates=args.candidates, depth_bonus=args.depth_bonus,
                             max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                             seed=args.seed, hf_baseline=not args.no_hf, exact=args.exact,
                             compile=COMPILE_FLAGS[args.compile], llamacpp=gguf,
                             threads=args.threads or torch.get_num_threads(),
                             fallback=FALLBACK_CHOICES[args.fallback], ngram=NGRAM_CHOICES[args.ngram],
                             llamacpp_modes=_llamacpp_modes(args, gguf))
    settings.validate()
    if args.prompts is not None:  # a bad set fails before the models load
        prompt_sets = load_prompt_sets(args.prompts, limit=args.limit or None)
    target, drafter, tokenizer = _load_models(args)
    if args.methods is None and drafter is None:
        settings.methods = drafter_free_methods()
    apply_draft_vocab(drafter, args.draft_vocab)
    if args.prompts is None:
        prompt_sets = load_prompt_sets(default_prompt_sets(tokenizer), limit=args.limit or None)
    if drafter is None and any(lookup(m).drafter for m in settings.methods):
        raise ValueError("methods other than ar and ngram need --drafter")
    result = BenchResult(settings={}, machine={}, models={})
    out = Path(args.out)
    try:
        run_benchmark(target, drafter, prompt_sets, settings, tokenizer=tokenizer,
                      progress=_StderrProgress(), result=result, answers_cache=_answers_cache(args))
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
    """`python -m dartree.bench ...` / bench/e2e.py: the `dartree bench` command alone."""
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
