"""The frozen target's side of training: its features at the drafter's layers
(target_features), its greedy continuations (greedy_continue, for self-distillation) and
features computed once for a whole data set (FeatureCache)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
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


def _backbone(target: Any, ids: torch.Tensor, layer_ids: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [N, L, n*H] of layers ``layer_ids``, the final hidden state [N, L, H] after the
    norm, which the LM head reads)."""
    layers = decoder_layers(target)
    captured: dict[int, torch.Tensor] = {}

    def hook(index: int):
        def save(module, args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output
        return save

    handles = [layers[i].register_forward_hook(hook(i)) for i in set(layer_ids)]
    try:
        backbone = getattr(target, "model", target)  # skip the LM head
        last = backbone(input_ids=ids, use_cache=False).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat([layer_feature(target, i, captured[i]) for i in layer_ids], dim=-1), last


@torch.no_grad()
def target_features(target: Any, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """ids [N, L] -> features [N, L, n*H]: the features of decoder layers ``layer_ids``,
    concatenated: transformers' ``hidden_states[l + 1]`` (for the last layer, after the final
    norm), captured by ``target.layer_feature`` as inference captures them."""
    return _backbone(target, ids, layer_ids)[0]


@torch.no_grad()
def soft_labels(target: Any, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [L, H] (final, after the norm) -> (ids int32 [L, k], log-probs float16 [L, k]):
    the target's k most likely next tokens at each position and their log-probabilities (of
    the whole vocabulary, in float32 before the float16 store)."""
    logits = target_io(target)[1](hidden).float()
    top = logits.log_softmax(-1).topk(k, dim=-1)
    return top.indices.to(torch.int32), top.values.to(torch.float16)


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
    soft_ids, soft_logprobs  int32 / float16 [total, K] or None: at each position the target's K
             most likely next tokens and their log-probabilities (``soft_labels``: the soft
             labels of the KL term, TrainOptions.soft_weight)

    A cache built into a folder keeps its large arrays there as .npy memory maps (read as
    needed: a million-token cache of 5 SmolLM2 layers is 8 GB), and ``build`` resumes there.
    """

    tokens: torch.Tensor
    features: torch.Tensor
    offsets: torch.Tensor
    starts: torch.Tensor
    layer_ids: list[int]
    soft_ids: torch.Tensor | None = None
    soft_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def width(self) -> int:
        """Features per token (n*H)."""
        return self.features.shape[1]

    @property
    def topk(self) -> int:
        return 0 if self.soft_ids is None else self.soft_ids.shape[1]

    @classmethod
    @torch.no_grad()
    def build(cls, target: Any, sequences: list[tuple[list[int], int]], layer_ids: list[int],
              progress: bool = True, batch_size: int = 8, topk: int = 0,
              folder: str | Path | None = None) -> FeatureCache:
        """Features of ``sequences`` [(token ids, answer start)] (and the target's top-``topk``
        soft labels when topk > 0): target forwards over batches of similar lengths,
        right-padded (causal attention: padding after a row's end cannot change its features).

        ``folder``: store the cache there as memory maps, batch by batch; a build interrupted
        there resumes at its last saved batch (when the sequences and settings are the same)."""
        if topk < 0:
            raise ValueError(f"topk must be >= 0, got {topk}")
        embed, _, config = target_io(target)
        device = embed.weight.device
        lengths = [len(ids) for ids, _ in sequences]
        if not sequences or min(lengths) < 1:
            raise ValueError("every sequence needs at least one token")
        offsets = torch.tensor([0] + lengths).cumsum(0)
        index = {"tokens": torch.tensor([t for ids, _ in sequences for t in ids], dtype=torch.long),
                 "offsets": offsets, "starts": torch.tensor([s for _, s in sequences]),
                 "layer_ids": list(layer_ids), "topk": topk}
        total, width = int(offsets[-1]), len(layer_ids) * config.hidden_size
        store = _Store(folder, index, total, width) if folder is not None \
            else _Store.memory(total, width, topk)
        order = sorted(range(len(sequences)), key=lambda i: lengths[i])
        batches = range(0, len(order), batch_size)
        bar = Progress(len(batches), progress, every=1, start=store.done)
        for b, lo in enumerate(batches):
            if b < store.done:
                continue
            picks = order[lo:lo + batch_size]
            width_t = max(lengths[i] for i in picks)
            rows = torch.zeros(len(picks), width_t, dtype=torch.long)
            for r, i in enumerate(picks):
                rows[r, :lengths[i]] = torch.tensor(sequences[i][0])
            feats, last = _backbone(target, rows.to(device), list(layer_ids))
            for r, i in enumerate(picks):
                lo_i, n = int(offsets[i]), lengths[i]
                store.features[lo_i:lo_i + n] = feats[r, :n].to("cpu", torch.bfloat16)
                if topk:
                    ids, logprobs = soft_labels(target, last[r, :n], topk)
                    store.soft_ids[lo_i:lo_i + n] = ids.cpu()
                    store.soft_logprobs[lo_i:lo_i + n] = logprobs.cpu()
            store.finished(b + 1)
            bar.update(b + 1, f"batches (width {width_t})")
        store.finished(len(batches), final=True)
        bar.close()
        if folder is not None:
            return cls.load(folder)
        return cls(index["tokens"], store.features, offsets, index["starts"], list(layer_ids),
                   store.soft_ids, store.soft_logprobs)

    def save(self, file: str | Path) -> None:
        """One file holding everything (an in-memory cache; a folder cache is saved as built)."""
        torch.save(dataclasses.asdict(self), str(file) + ".tmp")
        os.replace(str(file) + ".tmp", file)

    @classmethod
    def load(cls, path: str | Path) -> FeatureCache:
        """A cache saved by ``save`` (a file) or built into a folder (memory-mapped)."""
        path = Path(path)
        if not path.is_dir():
            return cls(**torch.load(path, weights_only=False))
        progress = _Store.progress(path)
        if not progress.get("complete"):
            raise ValueError(f"feature cache {path} is incomplete ({progress.get('batches', 0)} "
                             f"batches): run its build again to finish it")
        index = torch.load(path / _Store.INDEX, weights_only=False)
        arrays = {name: _Store.open(path, name, "c") for name in _Store.arrays(index["topk"])}
        return cls(index["tokens"], arrays["features"], index["offsets"], index["starts"],
                   index["layer_ids"], arrays.get("soft_ids"), arrays.get("soft_logprobs"))

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[lo:hi], self.features[lo:hi], int(self.starts[i])

    def soft(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Soft labels (ids, log-probs) [n, K] of sequence i (ValueError without them)."""
        if self.soft_ids is None:
            raise ValueError("this feature cache has no soft labels (build it with topk > 0)")
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.soft_ids[lo:hi], self.soft_logprobs[lo:hi]


class _Store:
    """Where FeatureCache.build writes: tensors in memory, or .npy memory maps in a folder with
    index.pt (tokens, offsets, starts, layer_ids, topk) and progress.json (batches done)."""

    INDEX, PROGRESS = "index.pt", "progress.json"
    SAVE_SECONDS = 60.0  # how often progress is saved (an interrupted build redoes at most this)
    DTYPES = {"features": (np.uint16, torch.bfloat16), "soft_ids": (np.int32, torch.int32),
              "soft_logprobs": (np.float16, torch.float16)}

    def __init__(self, folder: str | Path, index: dict, total: int, width: int):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        shapes = {"features": (total, width), "soft_ids": (total, index["topk"]),
                  "soft_logprobs": (total, index["topk"])}
        names = self.arrays(index["topk"])
        self.done = self.progress(self.folder).get("batches", 0) if self._same(index) else 0
        if self.done:
            self.maps = {n: np.load(self.folder / f"{n}.npy", mmap_mode="r+") for n in names}
        else:
            torch.save(index, self.folder / self.INDEX)
            self._write_progress(0, False)
            self.maps = {n: np.lib.format.open_memmap(self.folder / f"{n}.npy", mode="w+",
                                                      dtype=self.DTYPES[n][0], shape=shapes[n])
                         for n in names}
        views = {n: torch.from_numpy(m).view(self.DTYPES[n][1]) for n, m in self.maps.items()}
        self.features = views["features"]
        self.soft_ids, self.soft_logprobs = views.get("soft_ids"), views.get("soft_logprobs")
        self.last_save = time.perf_counter()

    @classmethod
    def memory(cls, total: int, width: int, topk: int) -> _Store:
        store = cls.__new__(cls)
        store.folder, store.done, store.maps = None, 0, {}
        store.features = torch.zeros(total, width, dtype=torch.bfloat16)
        store.soft_ids = torch.zeros(total, topk, dtype=torch.int32) if topk else None
        store.soft_logprobs = torch.zeros(total, topk, dtype=torch.float16) if topk else None
        return store

    @staticmethod
    def arrays(topk: int) -> list[str]:
        return ["features"] + (["soft_ids", "soft_logprobs"] if topk else [])

    @classmethod
    def open(cls, folder: Path, name: str, mode: str) -> torch.Tensor:
        # "c": copy on write, so torch gets a writable array; nothing goes back to the file
        array = np.load(folder / f"{name}.npy", mmap_mode=mode)
        return torch.from_numpy(array).view(cls.DTYPES[name][1])

    @classmethod
    def progress(cls, folder: Path) -> dict:
        file = folder / cls.PROGRESS
        return json.loads(file.read_text()) if file.is_file() else {}

    def _same(self, index: dict) -> bool:
        """Whether the folder holds a build of these very sequences and settings."""
        file = self.folder / self.INDEX
        if not file.is_file():
            return False
        old = torch.load(file, weights_only=False)
        return all(torch.equal(old[k], v) if isinstance(v, torch.Tensor) else old.get(k) == v
                   for k, v in index.items())

    def _write_progress(self, batches: int, complete: bool) -> None:
        tmp = self.folder / (self.PROGRESS + ".tmp")
        tmp.write_text(json.dumps({"batches": batches, "complete": complete}))
        os.replace(tmp, self.folder / self.PROGRESS)

    def finished(self, batches: int, final: bool = False) -> None:
        """Batches 0 .. batches-1 are written: saved (arrays first) every SAVE_SECONDS and at
        the end."""
        if self.folder is None or not (final or
                                       time.perf_counter() - self.last_save >= self.SAVE_SECONDS):
            return
        for array in self.maps.values():
            array.flush()
        self._write_progress(batches, final)
        self.last_save = time.perf_counter()
