"""The frozen target's side of training: its features at the drafter's layers
(target_features), its greedy continuations (greedy_continue, for self-distillation) and
features computed once for a whole data set (FeatureCache)."""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path
from typing import Any

import torch

from ..drafter import target_io
from ..target import layer_feature
from .progress import Progress


def decoder_layers(target: Any) -> Any:
    """``target.model.layers``, the decoder layers of a transformers causal LM (ValueError if
    there are none there)."""
    layers = getattr(getattr(target, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"target {type(target).__name__} has no decoder layers at "
                         f"model.model.layers")
    return layers


@torch.no_grad()
def target_features(target: Any, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """ids [N, L] -> features [N, L, n*H]: the features of decoder layers ``layer_ids``,
    concatenated: transformers' ``hidden_states[l + 1]`` (for the last layer, after the final
    norm), captured by ``target.layer_feature`` as inference captures them."""
    layers = decoder_layers(target)
    captured: dict[int, torch.Tensor] = {}

    def hook(index: int):
        def save(module, args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output
        return save

    handles = [layers[i].register_forward_hook(hook(i)) for i in set(layer_ids)]
    try:
        backbone = getattr(target, "model", target)  # skip the LM head
        backbone(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat([layer_feature(target, i, captured[i]) for i in layer_ids], dim=-1)


@torch.no_grad()
def greedy_continue(target: Any, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """prompts [N, P] -> [N, P + new_tokens]: the target's greedy continuations (EOS ignored)."""
    # transformers 5 names the cache `cache`; older versions `past_key_values`
    name = "cache" if "cache" in inspect.signature(target.forward).parameters \
        else "past_key_values"
    out = target(input_ids=prompts, use_cache=True)
    past, tokens = getattr(out, name), [out.logits[:, -1].argmax(-1)]
    for _ in range(new_tokens - 1):
        out = target(input_ids=tokens[-1][:, None], use_cache=True, **{name: past})
        past = getattr(out, name)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.cat([prompts, torch.stack(tokens, dim=1)], dim=1)


@dataclasses.dataclass
class FeatureCache:
    """Sequences with their target features, computed once (training never runs the target).

    tokens   int64 [total]: every sequence's tokens, concatenated
    features bfloat16 [total, n*H]: the target features of those tokens (``target_features``)
    offsets  int64 [n + 1]: sequence i is rows offsets[i] .. offsets[i+1]
    starts   int64 [n]: first position of sequence i whose token is a label (its answer)
    layer_ids: the target layers the features come from
    """

    tokens: torch.Tensor
    features: torch.Tensor
    offsets: torch.Tensor
    starts: torch.Tensor
    layer_ids: list[int]

    def __len__(self) -> int:
        return len(self.starts)

    @classmethod
    @torch.no_grad()
    def build(cls, target: Any, sequences: list[tuple[list[int], int]], layer_ids: list[int],
              progress: bool = True, batch_size: int = 8) -> FeatureCache:
        """Features of ``sequences`` [(token ids, answer start)]: target forwards over batches of
        similar lengths, right-padded (causal attention: padding after a row's end cannot change
        its features)."""
        device = target_io(target)[0].weight.device
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))
        feats: list[torch.Tensor | None] = [None] * len(sequences)
        bar = Progress(len(sequences), progress, every=max(1, batch_size))
        for lo in range(0, len(order), batch_size):
            picks = order[lo:lo + batch_size]
            width = max(len(sequences[i][0]) for i in picks)
            rows = torch.zeros(len(picks), width, dtype=torch.long)
            for r, i in enumerate(picks):
                rows[r, :len(sequences[i][0])] = torch.tensor(sequences[i][0])
            out = target_features(target, rows.to(device), layer_ids).to("cpu", torch.bfloat16)
            for r, i in enumerate(picks):
                feats[i] = out[r, :len(sequences[i][0])]
            bar.update(min(lo + batch_size, len(order)), f"batch width {width}")
        bar.close()
        lengths = [len(ids) for ids, _ in sequences]
        offsets = torch.tensor([0] + lengths).cumsum(0)
        return cls(torch.tensor([t for ids, _ in sequences for t in ids], dtype=torch.long),
                   torch.cat(feats), offsets, torch.tensor([s for _, s in sequences]),
                   list(layer_ids))

    def save(self, file: str | Path) -> None:
        torch.save(dataclasses.asdict(self), str(file) + ".tmp")
        os.replace(str(file) + ".tmp", file)

    @classmethod
    def load(cls, file: str | Path) -> FeatureCache:
        return cls(**torch.load(file, weights_only=False))

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[lo:hi], self.features[lo:hi], int(self.starts[i])
