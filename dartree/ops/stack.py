"""`decoder_stack`: a Llama-family decoder stack over T tokens of one sequence in one CPU call.

The op runs every decoder layer (RMSNorm, q/k/v, RoPE, the cache write, attention, o, RMSNorm,
gate/up, SiLU, down, the residual adds) with the bits of transformers' forward when the linear
layers run `exact_linear` (or are packed GGUF rows) and attention runs (exact_)tree_attention.
From Python the same layer is ~140 small ATen ops; on a small model their dispatch cost about
45% of a decoding step (torch.profiler, packed SmolLM2, float32). `dartree.decoder_stack.forward` calls it where it applies; its
reference is that module's Python loop (and transformers' forward): tests/test_decoder_stack_op.py.
"""

from __future__ import annotations

import torch

from ._dispatch import HAS_EXTENSION, _fake


def decoder_stack_available(device: torch.device) -> bool:
    """Whether the compiled op runs on `device` (the CPU, with the extension built)."""
    return HAS_EXTENSION and device.type == "cpu" and hasattr(torch.ops.dartree, "decoder_stack")


def decoder_stack(x: torch.Tensor, kv: torch.Tensor, start: int, tree_mask: torch.Tensor,
                  cos: torch.Tensor, sin_signed: torch.Tensor, weights: list[torch.Tensor],
                  qtypes: list[int], biases: list[torch.Tensor | None], norms: list[torch.Tensor],
                  heads: list[int], eps: float, scaling: float, exact: bool, keep: list[int]
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The op's arguments, in the schema's words (csrc/ops.cpp):

    x [T, H] embeddings; kv [L, 2, 1, Hkv, S, D] the static cache (rows [start, start + T) are
    written); tree_mask bool [1, T, T]; cos, sin_signed [T, D] RoPE's tables with sin's first half
    negated; weights / qtypes / biases: 7 per layer (q, k, v, o, gate, up, down; qtype -1 for a
    dense weight, else the GGML type of packed rows); norms: 2 per layer (4 with q_norm/k_norm);
    heads [Hq, Hkv, D, qk_norm]; exact: exact_tree_attention, else tree_attention.
    Returns (the last layer's output [T, H], [output of layer l for l in keep])."""
    if not decoder_stack_available(x.device):
        raise RuntimeError(f"decoder_stack: no compiled kernel on {x.device} (extension built: "
                           f"{HAS_EXTENSION}); run dartree.decoder_stack.forward's Python loop")
    return torch.ops.dartree.decoder_stack.default(x, kv, start, tree_mask, cos, sin_signed, weights,
                                                   qtypes, biases, norms, heads, eps, scaling, exact,
                                                   keep)


@_fake("decoder_stack")
def _decoder_stack_fake(x, kv, start, tree_mask, cos, sin_signed, weights, qtypes, biases, norms,
                        heads, eps, scaling, exact, keep):
    return x.new_empty(x.shape), [x.new_empty(x.shape) for _ in keep]
