"""dartree's drafters inside vLLM: a ``custom_class`` speculative proposer.

    from vllm import LLM
    llm = LLM(model=folder, dtype="float32", enable_prefix_caching=False, enforce_eager=True,
              speculative_config={"method": "custom_class",
                                  "model": "dartree.integrations.vllm.DartreeProposer",
                                  "num_speculative_tokens": 2})

vLLM verifies chains only (it has no tree attention), so each request gets one chain per step:
the DFlash drafter's argmaxes, with the Domino correction where the drafter has a head
(`chains.ChainDrafter`). vLLM's rejection sampler verifies and commits them, so the output is
vLLM's own decoding whatever the drafter proposes.

The drafter folder is ``$DARTREE_DRAFTER``, by default the shipped SmolLM2-135M-Instruct drafter
(it is refused, by name, for a target it does not fit). Its context features are the target's
hidden states of the verify pass, caught by forward hooks that `DartreeProposer.load_model` sets
on the target's decoder layers, with the pass's positions and per-request row ranges
(``query_start_loc``) read from vLLM's forward context.

Limits, each refused with a message: tensor and pipeline parallel size 1 (the hooks see one rank's
rows); prefix caching off (a cached prefix's hidden states are never computed, and the drafter
needs every position's); ``enforce_eager=True`` (vLLM's compiled decoder stack runs no module
hooks). The ``vllm.general_plugins`` entry point (`register`) imports this module in every vLLM
process, so that dartree's ops are registered before the model loads.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from vllm.config import CompilationMode
from vllm.forward_context import get_forward_context

from ..defaults import SMOLLM2_DRAFTER_DIR
from ..drafter import load_drafter
from .chains import ChainDrafter, RowStep
from .target_io import EngineTargetIO

logger = logging.getLogger(__name__)

DRAFTER_ENV = "DARTREE_DRAFTER"
CLASS_PATH = "dartree.integrations.vllm.DartreeProposer"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it in every process it starts, before
    the model loads; importing this module has registered dartree's ops there."""
    logger.info("dartree: proposer %s available (drafter: $%s, default %s)", CLASS_PATH,
                DRAFTER_ENV, SMOLLM2_DRAFTER_DIR)


class DartreeProposer:
    """vLLM's ``custom_class`` proposer: ``Class(vllm_config)``, ``load_model(target)``, then
    ``propose(...)`` after every verify pass -> one draft chain per batch row."""

    def __init__(self, vllm_config: Any):
        spec = vllm_config.speculative_config
        parallel = vllm_config.parallel_config
        sizes = (parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        if sizes != (1, 1):
            raise ValueError(f"dartree's vLLM proposer needs tensor_parallel_size 1 and "
                             f"pipeline_parallel_size 1, got {sizes[0]} and {sizes[1]}")
        if vllm_config.compilation_config.mode != CompilationMode.NONE:
            raise ValueError("dartree's vLLM proposer needs enforce_eager=True (--enforce-eager): "
                             "it reads the target's hidden states through forward hooks, which "
                             "a torch.compile'd model does not run")
        if vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("dartree's vLLM proposer needs enable_prefix_caching=False "
                             "(--no-enable-prefix-caching): the drafter reads the target's hidden "
                             "states of every position, and a cached prefix's are never computed")
        self.num_tokens = spec.num_speculative_tokens
        self.model_config = vllm_config.model_config
        self.drafter_path = Path(os.environ.get(DRAFTER_ENV) or SMOLLM2_DRAFTER_DIR)
        self.chains: ChainDrafter | None = None
        self._capture: _PassCapture | None = None

    def load_model(self, target_model: nn.Module) -> None:
        """Load the drafter onto the target's embedding and LM head; hook the feature layers."""
        io = EngineTargetIO(target_model, self.model_config.hf_config)
        drafter = load_drafter(self.drafter_path, io)
        self._capture = _PassCapture(target_model, drafter.target_layer_ids)
        self.chains = ChainDrafter(drafter, self.num_tokens, self.model_config.max_model_len)
        logger.info("dartree: %s drafter from %s, %d tokens a step", drafter.config.projector_type,
                    self.drafter_path, self.num_tokens)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """Draft tokens for every row of the batch that the last pass computed.

        sampled_token_ids: per row, the tokens this step committed (empty for a prefill chunk
        that sampled nothing); num_tokens_no_spec [rows]: committed tokens per row;
        token_ids_cpu [max_rows, max_model_len]: the rows' tokens. slot_mappings: unused (the
        drafter keeps its own context cache per request).
        """
        if self.chains is None:
            raise RuntimeError("DartreeProposer.propose called before load_model")
        rows = self._capture.rows(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        return self.chains.step(rows)


class _PassCapture:
    """Forward hooks on a vLLM decoder model that keep, of its last pass, the feature layers'
    outputs (vLLM's layers return (hidden, residual): the output is their sum; for the last
    layer after the final norm, as transformers' hidden_states), the positions, and each
    request's range of rows (``query_start_loc`` of the pass's attention metadata)."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        stack = getattr(model, "model", None)
        layers = getattr(stack, "layers", None)
        if layers is None:
            raise ValueError(f"the target {type(model).__name__} has no decoder layers at "
                             "model.model.layers")
        self.layer_ids = list(layer_ids)
        self._last = len(layers) - 1
        self._norm = stack.norm
        self._outputs: dict[int, torch.Tensor] = {}
        self._positions: torch.Tensor | None = None
        self._query_start: list[int] | None = None
        # on the outer model: vLLM's compile decorator replaces the decoder stack's __call__, which
        # then runs no module hooks (the layers inside keep theirs)
        model.register_forward_pre_hook(self._on_pass, with_kwargs=True)
        for layer in sorted(set(self.layer_ids)):
            layers[layer].register_forward_hook(self._on_layer(layer))

    def _on_pass(self, module, args, kwargs) -> None:
        positions = args[1] if len(args) > 1 else kwargs["positions"]
        metadata = get_forward_context().attn_metadata
        if metadata is None:  # a dummy pass (profiling, warm-up): no requests
            self._query_start = None
            return
        if not isinstance(metadata, dict):
            raise RuntimeError(f"dartree: unsupported attention metadata {type(metadata).__name__} "
                               "(micro-batching?)")
        first = next(iter(metadata.values()))
        self._query_start = first.query_start_loc.tolist()
        self._positions = positions[:self._query_start[-1]].to("cpu", copy=True)

    def _on_layer(self, layer: int):
        def save(module, args, output):
            hidden = output[0] + output[1] if isinstance(output, tuple) else output
            self._outputs[layer] = self._norm(hidden) if layer == self._last else hidden
        return save

    def rows(self, sampled: list[list[int]], num_tokens: np.ndarray, token_ids: np.ndarray
             ) -> list[RowStep]:
        """A `RowStep` per batch row of the last pass."""
        starts = self._query_start
        if starts is None or len(starts) != len(sampled) + 1:
            raise RuntimeError(f"dartree: the last pass had "
                               f"{'no requests' if starts is None else len(starts) - 1} rows, "
                               f"the proposer was given {len(sampled)}")
        features = torch.cat([self._outputs[l][:starts[-1]] for l in self.layer_ids], dim=-1)
        return [RowStep(tokens=token_ids[i, :int(num_tokens[i])],
                        start=int(self._positions[starts[i]]),
                        features=features[starts[i]:starts[i + 1]],
                        sampled=len(sampled[i]) > 0)
                for i in range(len(sampled))]
