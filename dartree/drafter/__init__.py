"""The DFlash block-diffusion drafter and the Domino causal-correction head
(research/ALGORITHMS.md §1-2).

    config      DrafterConfig (config.json of z-lab DFlash / Domino checkpoints), what a drafter
                reads from its target (target_io) and must match in it
    model       the layers and the Drafter: draft() with its static context cache (inference),
                forward() over many blocks at once (training)
    head        DominoHead: GRU over the drafted prefix + rank-r logit correction
    checkpoint  load_drafter / save_drafter (config.json + *.safetensors [+ draft_vocab.json])
    vocab       the draft vocabulary: the tokens drafting scores (Drafter.draft_logits)

Example::

    drafter = load_drafter("Qwen3-8B-Domino-b16", target)
    drafter.reset(max_len=4096)
    h = drafter.draft(prompt_features, bonus=first_token, s=prompt_len)   # [k, H]
    logits = drafter.base_logits(h)                                      # [k, V]
    logits = drafter.draft_logits(h)   # [k, V], -inf outside the draft vocabulary if it has one
"""

from .checkpoint import load_drafter, save_drafter
from .config import (ARCHITECTURE, PROJECTOR_TYPES, DrafterConfig, check_fits_target,
                     config_for_target, default_target_layer_ids, target_io)
from .head import DominoHead
from .model import Drafter, DrafterAttention, DrafterLayer, DrafterMLP, RMSNorm

__all__ = ["ARCHITECTURE", "PROJECTOR_TYPES", "DominoHead", "Drafter", "DrafterAttention",
           "DrafterConfig", "DrafterLayer", "DrafterMLP", "RMSNorm", "check_fits_target",
           "config_for_target", "default_target_layer_ids", "load_drafter", "save_drafter",
           "target_io"]
