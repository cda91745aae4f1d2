"""Drafter folders on disk: ``config.json`` + ``*.safetensors`` in the public z-lab DFlash and
Domino layouts (keys ``fc.weight``, ``layers.{i}.self_attn.q_proj.weight``, …,
``prefix_gru.weight_ih_l0``, ``embed_proj.0.weight``), so released drafters load unchanged."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from .config import DrafterConfig, module_dtype_device, target_io
from .model import Drafter
from .vocab import VOCAB_FILE, read_draft_vocab, save_draft_vocab

logger = logging.getLogger(__name__)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.iterdir()
                        if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".gguf"))
        hint = f" (found {', '.join(others)}; convert to safetensors)" if others else ""
        raise ValueError(f"no *.safetensors weights in {folder}{hint}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for key, tensor in load_file(str(file), device="cpu").items():
            if key in weights:
                raise ValueError(f"weight {key!r} appears in more than one file in {folder}")
            weights[key] = tensor
    return weights


def _summarise(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


def _check_weights(drafter: Drafter, weights: dict[str, torch.Tensor], folder: Path) -> None:
    expected = {k: tuple(v.shape) for k, v in drafter.checkpoint_state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    where = f"drafter checkpoint {folder} (projector_type {drafter.config.projector_type!r})"
    if missing:
        raise ValueError(f"{where} is missing weights: {_summarise(missing)}")
    if unexpected:
        raise ValueError(f"{where} has unexpected weights: {_summarise(unexpected)}")
    for key, shape in expected.items():
        if tuple(weights[key].shape) != shape:
            raise ValueError(f"{where}: weight {key} has shape {list(weights[key].shape)}, "
                             f"the config implies {list(shape)}")
        if not weights[key].is_floating_point():
            raise ValueError(f"{where}: weight {key} has dtype {weights[key].dtype}")


def load_drafter(path: str | Path, target: Any) -> Drafter:
    """Load a DFlash/Domino drafter folder (config.json + *.safetensors) for ``target``.

    ``target`` is a transformers causal LM or a TargetModel; the drafter is placed on the
    target's device in the target's dtype. Raises ValueError naming what does not fit.
    """
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"drafter folder {folder} has no config.json")
    config = DrafterConfig.from_json(json.loads(config_file.read_text()))
    embed, _, _ = target_io(target)
    weights = _read_weights(folder)
    biases = {"gru_bias": "prefix_gru.bias_ih_l0" in weights or "prefix_gru.bias_hh_l0" in weights,
              "w1_bias": "embed_proj.0.bias" in weights,
              "w2_bias": "embed_proj.2.bias" in weights}
    with torch.device("meta"):
        drafter = Drafter(config, target, **biases)
    _check_weights(drafter, weights, folder)
    drafter.load_checkpoint_state_dict(weights)
    dtype, device = module_dtype_device(embed)
    drafter.to(device=device, dtype=dtype)
    drafter.refresh_input_table()
    drafter.set_draft_vocab(read_draft_vocab(folder, drafter.logit_size))
    drafter.path = folder
    drafter.eval()
    logger.info("loaded %s drafter from %s: %d layers, block %d, %d slots, layers %s",
                config.projector_type, folder, config.num_layers, config.block_size,
                config.num_slots, config.target_layer_ids)
    return drafter


def save_drafter(drafter: Drafter, path: str | Path) -> None:
    """Write ``config.json`` + ``model.safetensors`` (z-lab / Domino layout) into ``path``, and
    ``draft_vocab.json`` when the drafter has a draft vocabulary."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    data = drafter.config.to_json()
    data["dtype"] = str(drafter.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    tensors = {k: v.detach().to("cpu").contiguous()
               for k, v in drafter.checkpoint_state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if drafter.draft_vocab is not None:
        save_draft_vocab(folder, drafter.draft_vocab, drafter.logit_size)
    else:
        (folder / VOCAB_FILE).unlink(missing_ok=True)  # not a stale one from an earlier save
