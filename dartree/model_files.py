"""A `--target` of `dartree generate` and `dartree bench`: a transformers folder or a GGUF file.

    target, tokenizer = load_target("model.Q4_K_M.gguf", torch.float32, "cpu")

A GGUF file (any name ending in .gguf) loads packed through `dartree.load_gguf`; its tokenizer,
chat template included, is built by transformers from the file's metadata, offline. A folder
loads with transformers' `from_pretrained`, its tokenizer from the folder's tokenizer files.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .methods import LOOKUP_ONLY, METHODS, lookup

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def is_gguf(path: str | Path) -> bool:
    """Whether a --target names a GGUF file (by its suffix)."""
    return Path(path).suffix.lower() == ".gguf"


def load_target(path: str | Path, dtype: torch.dtype, device: str | torch.device,
                packed: bool | None = None):
    """(model, tokenizer) of a --target. tokenizer: None for a folder without tokenizer files.

    packed: a GGUF file's weights packed (None, True: `dartree.load_gguf`; dtype is then the
            activations') or dequantised to `dtype` by transformers' GGUF loader (False). A
            folder refuses packed=True (it has no GGUF file to pack)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if is_gguf(path):
        if packed is False:
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                         dtype=dtype).to(device).eval()
        else:
            from .gguf import load_gguf

            model = load_gguf(path, dtype=dtype, device=device)
        return model, gguf_tokenizer(path)
    if packed:
        raise ValueError(f"packed weights come from a GGUF file; {path} is not one (a .gguf file)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        log.warning("no tokenizer in %s", path)
        return model, None
    return model, AutoTokenizer.from_pretrained(path)


def gguf_tokenizer(path: str | Path):
    """The tokenizer a GGUF file's metadata describes (vocabulary, merges, special tokens, chat
    template), built by transformers; ValueError naming the file when it describes none."""
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except (KeyError, ValueError, OSError) as exc:
        raise ValueError(f"{path.name}: transformers cannot build a tokenizer from its metadata "
                         f"({type(exc).__name__}: {exc})") from exc


def default_method(drafter) -> str:
    """The method a command runs when none is named: dartree with a drafter, else the
    drafter-free lookup method."""
    return "dartree" if drafter is not None else LOOKUP_ONLY


def drafter_free_methods() -> list[str]:
    """The methods that run without a drafter (ar and ngram)."""
    return [m for m in METHODS if not lookup(m).drafter]
