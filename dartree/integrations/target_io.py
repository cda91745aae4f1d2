"""An engine's target model as `dartree.load_drafter` reads a target: embedding, LM head, config."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class EngineTargetIO:
    """What `load_drafter` reads of a target (`drafter.config.target_io`), from an engine's model
    (vLLM's and SGLang's Llama-family models: ``model.model.embed_tokens``, ``model.lm_head``):
    the embedding and LM head as plain modules sharing the engine's weights, cut to the
    vocabulary (the engines pad the rows), and the transformers config. One rank's weights: the
    callers refuse tensor parallelism."""

    def __init__(self, model: nn.Module, hf_config: Any):
        self.config = hf_config
        vocab = hf_config.get_text_config().vocab_size
        embed = model.model.embed_tokens.weight
        head = getattr(model, "lm_head", None)
        head_weight = getattr(head, "weight", None)
        if not isinstance(head_weight, torch.Tensor) or head_weight.shape[1] != embed.shape[1]:
            raise ValueError(f"the target {type(model).__name__} has no dense LM head weight "
                             "(quantized heads are not supported)")
        self._embed = nn.Embedding.from_pretrained(embed.detach()[:vocab], freeze=True)
        self._head = nn.Linear(embed.shape[1], vocab, bias=False, device=embed.device,
                               dtype=head_weight.dtype)
        self._head.weight = nn.Parameter(head_weight.detach()[:vocab], requires_grad=False)

    def get_input_embeddings(self) -> nn.Module:
        return self._embed

    def get_output_embeddings(self) -> nn.Module:
        return self._head
