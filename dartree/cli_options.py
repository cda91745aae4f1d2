"""Command-line options shared by `dartree generate` and `dartree bench`."""

from __future__ import annotations

import argparse


def add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=["smollm2", "coder", "tiny"], default="smollm2",
                        help="default set when --target is not given: SmolLM2-135M-Instruct + its "
                             "drafter; Qwen2.5-Coder-1.5B-Instruct packed, no drafter (installed by "
                             "bash scripts/install.sh --coder); or the bundled 2.4M code pair")


def add_weights_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weights", choices=["auto", "packed", "dequantized"], default="auto",
                        help="a GGUF model's weights (SmolLM2, the coder, a --target FILE.gguf): "
                             "packed (the file as it is, read by dartree's kernels; --dtype is the "
                             "activations') or dequantized to --dtype; auto: packed, except "
                             "SmolLM2 on CUDA (dequantized)")


def weights_choice(weights: str) -> bool | None:
    """default_models' `packed` for a --weights value (None: its own default)."""
    return {"auto": None, "packed": True, "dequantized": False}[weights]


def packed_choice(args: argparse.Namespace) -> bool | None:
    """default_models' and load_target's `packed` for a command's --weights, --model and
    --target; ValueError when --weights packed names no GGUF file (the tiny set, a folder)."""
    from .model_files import is_gguf

    packed = weights_choice(args.weights)
    if packed and (args.model == "tiny" if not args.target else not is_gguf(args.target)):
        raise ValueError("--weights packed needs a GGUF file: --model smollm2 or coder, or "
                         "--target FILE.gguf")
    return packed


def add_draft_vocab_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-vocab", choices=["auto", "full"], default="auto",
                        help="tokens the drafter scores: auto, its folder's draft_vocab.json where it "
                             "has one (the shipped SmolLM2 drafter does), else all; full: all of them")


def apply_draft_vocab(drafter, choice: str) -> None:
    """--draft-vocab full: the drafter drafts over the whole vocabulary."""
    if choice == "full" and drafter is not None:
        drafter.set_draft_vocab(None)
