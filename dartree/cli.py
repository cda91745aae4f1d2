"""`dartree` command line: generate text with a target and its drafter, or serve it over HTTP.

    dartree generate --prompt "What is the capital of France?"        # SmolLM2 + its drafter
    dartree generate --model tiny --raw --prompt "def fib(n):"        # the bundled code pair
    dartree generate --model coder --prompt "..."   # Qwen2.5-Coder-1.5B packed, no drafter: ngram
    dartree generate --target DIR --drafter DIR --prompt "..." --method dartree
    dartree generate --target model.Q4_K_M.gguf --prompt "..."       # any GGUF file: ngram
    dartree serve --port 8080                                         # OpenAI-compatible server

`generate` and `serve` take the same model and decoder options (`add_model_options`,
`add_decoder_options`) and build their decoder with the same `build_decoder`, so the same prompt
and settings give the same tokens through either.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from .cli_options import (add_draft_vocab_option, add_model_option, add_weights_option,
                          apply_draft_vocab, packed_choice)
from .compilation import COMPILE_FLAGS
from .methods import METHODS, lookup


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The target, its drafter, where they run and in which dtype (generate, serve)."""
    add_model_option(parser)
    parser.add_argument("--target", help="target: a model folder or a GGUF file (packed, its "
                                         "tokenizer from the file; default: --model)")
    parser.add_argument("--drafter", help="drafter folder (DFlash/Domino layout)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the models run (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="the target's dtype (the drafter follows it; default: float32)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's, one per core)")
    add_weights_option(parser)
    add_draft_vocab_option(parser)


def add_decoder_options(parser: argparse.ArgumentParser) -> None:
    """SpeculativeDecoder's settings (generate, serve)."""
    parser.add_argument("--method", choices=METHODS, default=None,
                        help="decoding method (dartree.methods; the tokens are the same for every "
                             "method); default: dartree with a drafter, ngram (the drafter-free "
                             "lookup method) without one")
    parser.add_argument("--budget", type=_budget, default="auto",
                        help="draft nodes verified per round, or auto (the default): chosen every "
                             "round from this machine's measured costs and the candidates' "
                             "acceptance estimates, one-token rounds included")
    parser.add_argument("--ngram", action=argparse.BooleanOptionalAction, default=True,
                        help="tree methods: continuations of the text's last tokens found in the "
                             "prompt, the answer and earlier outputs become branches of the tree "
                             "(default: on)")
    parser.add_argument("--width", type=int, default=12, help="dartree: nodes kept per level")
    parser.add_argument("--candidates", type=int, default=64, help="dartree: tokens per position")
    parser.add_argument("--depth-bonus", type=float, default=-0.2, help="dartree: β (<= 0)")
    parser.add_argument("--compile", choices=list(COMPILE_FLAGS), default="auto",
                        help="the target's verify forward and the drafter's pass through "
                             "torch.compile (auto: where it pays back; nowhere measured yet, so eager)")
    parser.add_argument("--fallback", action=argparse.BooleanOptionalAction, default=True,
                        help="with a fixed --budget: decode one token a round wherever "
                             "speculation measures slower per token on this machine and text, "
                             "trying it again now and then (the tokens are the same either way; "
                             "default: on; --budget auto makes this choice itself)")
    parser.add_argument("--exact", action="store_true",
                        help="verify on the batch-invariant kernels: at temperature 0 the tokens "
                             "equal the target's own greedy decoding bit for bit in every dtype")


def _budget(value: str) -> int | str:
    """--budget: an int >= 1 or auto."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1 or auto, got {value!r}") from None


def _load(args):
    """(target, drafter, tokenizer) from --target (a folder or a GGUF file) and --drafter, else
    the --model set; sets args.method when none was named (dartree with a drafter, else ngram)."""
    from .drafter import load_drafter
    from .model_files import default_method, load_target

    dtype = getattr(torch, args.dtype)
    packed = packed_choice(args)
    if not args.target:
        if args.drafter:
            raise SystemExit("error: --drafter needs --target (a drafter is built for a target)")
        from .defaults import default_models

        try:
            target, drafter, tokenizer = default_models(args.model, device=args.device, dtype=dtype,
                                                        packed=packed)
        except ImportError as exc:  # a model not installed: the message names the command
            raise SystemExit(f"error: {exc}") from None
    else:
        target, tokenizer = load_target(args.target, dtype, args.device, packed)
        if tokenizer is None:
            raise SystemExit(f"error: {args.target} has no tokenizer files")
        drafter = load_drafter(args.drafter, target) if args.drafter else None
    args.method = args.method or default_method(drafter)
    if args.drafter and not lookup(args.method).drafter:
        raise SystemExit(f"error: method {args.method!r} runs without a drafter: leave out "
                         "--drafter, or pick a method that drafts (its tree takes the lookup's "
                         "branches too)")
    if lookup(args.method).drafter and drafter is None:
        where = f"--model {args.model}" if not args.target else args.target
        raise SystemExit(f"error: method {args.method!r} needs a drafter and {where} has none "
                         "(--drafter DIR; ar and ngram run without one)")
    return target, (drafter if lookup(args.method).drafter else None), tokenizer


def build_decoder(args):
    """(SpeculativeDecoder, tokenizer) from parsed `add_model_options` + `add_decoder_options`
    arguments: the one way `dartree generate` and `dartree serve` build their decoder."""
    from .decoding import SpeculativeDecoder

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    target, drafter, tokenizer = _load(args)
    apply_draft_vocab(drafter, args.draft_vocab)
    dec = SpeculativeDecoder(target, drafter, method=args.method, budget=args.budget,
                             width=args.width, candidates=args.candidates,
                             depth_bonus=args.depth_bonus, ngram=args.ngram, exact=args.exact,
                             compile=COMPILE_FLAGS[args.compile], fallback=args.fallback)
    return dec, tokenizer


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer carries a chat template (else prompts go in as plain text)."""
    return bool(getattr(tokenizer, "chat_template", None))


def chat_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """LongTensor [1, n]: messages ([{"role", "content"}, ...]) through the tokenizer's chat
    template, with the assistant's turn opened."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


def prompt_ids(tokenizer, prompt: str, raw: bool = False) -> torch.Tensor:
    """LongTensor [1, n]: the prompt as one user message through the tokenizer's chat template
    (with the assistant's turn opened), or its plain tokens when `raw` or there is no template."""
    if raw or not has_chat_template(tokenizer):
        return tokenizer(prompt, return_tensors="pt").input_ids
    return chat_ids(tokenizer, [{"role": "user", "content": prompt}])


class _TextStream:
    """Prints the decoded text of the tokens seen so far as it grows (whole characters only)."""

    def __init__(self, tokenizer, out):
        self.tokenizer, self.out, self.tokens, self.shown = tokenizer, out, [], 0

    def __call__(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)


def _generate(args) -> int:
    dec, tokenizer = build_decoder(args)
    ids = prompt_ids(tokenizer, args.prompt, args.raw)
    if args.raw or not has_chat_template(tokenizer):
        sys.stdout.write(args.prompt)
    # position-keyed sampling: the same tokens for every --method with the same --seed
    res = dec.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       eos_token_id=tokenizer.eos_token_id, seed=args.seed,
                       streamer=_TextStream(tokenizer, sys.stdout))
    print()
    compiling = res.timings.get("compile", 0.0)
    decode = res.timings.get("decode", 0.0) - compiling
    rate = len(res.tokens) / decode if decode > 0 else float("nan")
    print(f"[{args.method}] {len(res.tokens)} tokens in {len(res.acceptance_lengths)} rounds"
          f"{_round_kinds(res, dec)} | tau {res.mean_acceptance:.2f} | "
          f"{rate:.1f} tokens/s (prefill excluded"
          + (f"; compiling, {compiling:.1f} s, too)" if compiling else ")"), file=sys.stderr)
    return 0


def _round_kinds(res, dec) -> str:
    """' (S speculative at tau t, F one-token; accepted: drafter d, lookup l, both b)': how a
    call's rounds split, and where its accepted draft tokens came from."""
    if dec.method == "ar":
        return ""
    spec = [n for n, s in zip(res.acceptance_lengths, res.speculated) if s]
    tau = f" at tau {sum(spec) / len(spec):.2f}" if spec else ""
    sources = ", ".join(f"{name} {count}" for name, count in res.accepted_by_source.items())
    return f" ({len(spec)} speculative{tau}, {len(res.speculated) - len(spec)} one-token; " \
           f"accepted: {sources})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dartree", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer a prompt (chat template) or continue it (--raw)")
    add_model_options(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true",
                     help="continue the prompt as plain text instead of answering it as a chat")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0,
                     help="sampling seed (temperature > 0): every method gives the same tokens")
    add_decoder_options(gen)
    gen.set_defaults(run=_generate)

    from .bench import add_bench_parser
    from .serve.command import add_serve_parser
    from .train import add_train_parser

    add_bench_parser(sub)
    add_serve_parser(sub)
    add_train_parser(sub)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except ValueError as exc:  # bad input: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
