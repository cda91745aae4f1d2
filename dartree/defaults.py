"""The bundled default models: a small Python code model and its DFlash + Domino drafter.

Both live in ``dartree/models/`` (``target/``: transformers layout with tokenizer files;
``drafter/``: dartree drafter layout; ``metadata.json``: how they were trained) and are rebuilt
from scratch by ``scripts/make_default_models.py``. Loading never touches the network.

Example::

    target, drafter, tokenizer = dartree.default_models()
    dec = dartree.SpeculativeDecoder(target, drafter)
    res = dec.generate(tokenizer("def fib(n):", return_tensors="pt").input_ids)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

MODELS_DIR = Path(__file__).resolve().parent / "models"
DEFAULT_TARGET_DIR = MODELS_DIR / "target"
DEFAULT_DRAFTER_DIR = MODELS_DIR / "drafter"


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_models(device: str | torch.device | None = None, dtype: torch.dtype | None = None
                   ) -> tuple[Any, Any, Any]:
    """(target, drafter, tokenizer) of the bundled set, loaded offline.

    device: where to put the models (default: CUDA when available, else CPU); dtype: the
    target's dtype (default float32; the drafter follows the target). The target is a
    transformers ``Qwen3ForCausalLM`` in eval mode, the tokenizer a transformers fast tokenizer,
    the drafter a :class:`dartree.Drafter` (``drafter.path`` = its folder).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .drafter import load_drafter

    for folder, what in ((DEFAULT_TARGET_DIR, "config.json"), (DEFAULT_DRAFTER_DIR, "config.json")):
        if not (folder / what).is_file():
            raise FileNotFoundError(f"the bundled models are missing ({folder / what} not found); "
                                    f"rebuild them with scripts/make_default_models.py")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    device = torch.device(device) if device is not None else _default_device()
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TARGET_DIR, local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(
        DEFAULT_TARGET_DIR, dtype=dtype or torch.float32, local_files_only=True)
    target = target.to(device).eval()
    drafter = load_drafter(DEFAULT_DRAFTER_DIR, target)
    return target, drafter, tokenizer


def default_metadata() -> dict[str, Any]:
    """What ``scripts/make_default_models.py`` recorded: held-out losses, steps, times."""
    file = MODELS_DIR / "metadata.json"
    return json.loads(file.read_text()) if file.is_file() else {}
