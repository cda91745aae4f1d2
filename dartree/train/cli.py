"""The command line: ``dartree train-drafter`` (a target folder, a corpus -> a drafter folder)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from ..drafter.vocab import frequent_tokens
from .corpus import load_corpus
from .loop import train_drafter
from .options import TrainOptions


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one layer id")
    return values


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``train-drafter`` on an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "train-drafter", help="train a DFlash drafter + Domino head for a target",
        description="Train a DFlash block-diffusion drafter with a Domino head for a frozen "
                    "transformers causal LM, and write it as a dartree drafter folder.")
    p.add_argument("--target", required=True, help="target model folder (transformers layout)")
    p.add_argument("--corpus", required=True, nargs="+",
                   help="text/code files, folders (walked recursively) or .jsonl files")
    p.add_argument("--output", required=True, help="drafter folder to write")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the target folder)")
    p.add_argument("--layers", type=int, default=1, help="drafter decoder layers")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--target-layer-ids", type=_int_list, default=None,
                   help="target layers read as features, e.g. 1,9,17 (default: DFlash's)")
    p.add_argument("--no-domino", dest="domino", action="store_false",
                   help="plain DFlash drafter without the Domino head")
    p.add_argument("--emb-dim", type=int, default=None, help="Domino rank r (default min(256, H))")
    p.add_argument("--gru-hidden-dim", type=int, default=None,
                   help="Domino GRU width G (default min(1024, H))")
    p.add_argument("--no-shift-label", dest="shift_label", action="store_false",
                   help="read slots 1..B-1 (plain DFlash) instead of 0..B-1")
    p.add_argument("--prefix-len", type=int, default=1, help="Domino P: uncorrected first slots")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="default: the tokenizer's mask token, else V - 1")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--anchors", type=int, default=16, help="blocks per sequence")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--gamma", type=float, default=None, help="slot loss decay (default DFlash's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--self-distill", action="store_true",
                   help="train on the target's greedy continuations of corpus prompts")
    p.add_argument("--distill-new-tokens", type=int, default=128)
    p.add_argument("--distill-batches", type=int, default=8,
                   help="self-distill: steps' worth of continuations generated at once")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where to checkpoint and resume (default: OUTPUT/checkpoint)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--no-resume", dest="resume", action="store_false")
    p.add_argument("--init", default=None,
                   help="a drafter folder to start from (fine-tuning) instead of a random init")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="train and draft over the N tokens most frequent in the corpus (EOS "
                        "included; saved as the drafter's draft_vocab.json); 0: all of them")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(run=run_train_command)
    return p


def run_train_command(args: argparse.Namespace) -> int:
    """Entry point of ``dartree train-drafter`` (args from :func:`add_train_parser`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    if not Path(args.target).is_dir():
        raise ValueError(f"--target {args.target} is not a folder")
    missing = [c for c in args.corpus if not Path(c).exists()]
    if missing:
        raise ValueError(f"--corpus path(s) not found: {', '.join(missing)}")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
    mask = args.mask_token_id
    if mask is None:
        mask = getattr(tokenizer, "mask_token_id", None)
    options = TrainOptions(
        num_layers=args.layers, block_size=args.block_size,
        target_layer_ids=args.target_layer_ids, domino=args.domino, emb_dim=args.emb_dim,
        gru_hidden_dim=args.gru_hidden_dim, shift_label=args.shift_label,
        prefix_len=args.prefix_len if args.domino else 0, mask_token_id=mask,
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        anchors=args.anchors, lr=args.lr, gamma=args.gamma, seed=args.seed,
        self_distill=args.self_distill, distill_new_tokens=args.distill_new_tokens,
        distill_batches=args.distill_batches,
        checkpoint_dir=args.checkpoint_dir or str(Path(args.output) / "checkpoint"),
        checkpoint_every=args.checkpoint_every, resume=args.resume)
    options.validate()
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    target = target.to(args.device).eval()
    ids = load_corpus(args.corpus, tokenizer)
    print(f"corpus: {len(ids)} tokens; target: {sum(p.numel() for p in target.parameters())} "
          f"parameters", file=sys.stderr)
    vocab = None
    if args.draft_vocab:
        if args.draft_vocab < 0:
            raise ValueError(f"--draft-vocab must be >= 0, got {args.draft_vocab}")
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        vocab, covered = frequent_tokens([ids.tolist()], args.draft_vocab,
                                         target.get_input_embeddings().num_embeddings, always=eos)
        print(f"draft vocabulary: {len(vocab)} tokens, {covered:.2%} of the corpus",
              file=sys.stderr)
    _, info = train_drafter(target, ids, options, output=args.output, init=args.init,
                            draft_vocab=vocab)
    print(f"wrote {args.output}: {info['step']} steps, loss {info['loss']:.4f}, "
          f"{info['tokens_per_second']:.0f} tokens/s, {info['seconds']:.0f}s", file=sys.stderr)
    return 0
