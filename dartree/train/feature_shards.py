"""Feature caches in shards: a data set featurised a few thousand sequences at a time, across
sessions, and read by training as one cache (FeatureShards).

A shard is a FeatureCache folder (``folder/000``, ``folder/001``, ...). ``build_shards`` adds
shards of sequences no complete shard holds yet, in a seeded order, until ``total`` sequences
are covered: growing a data set keeps the shards already built, and an interrupted shard
resumes (its sequences are the same while the complete shards are)."""

from __future__ import annotations

import bisect
import random
from pathlib import Path
from typing import Any

import torch

from .features import FeatureCache, _Store

Sequence = tuple[list[int], int]  # (token ids, answer start)


class FeatureShards:
    """Several FeatureCaches read as one: what CachedBatches and evaluate_cached read of a
    FeatureCache (len, tokens, offsets, starts, layer_ids, topk, width, sequence, soft), the
    large arrays staying in their shards' memory maps."""

    def __init__(self, shards: list[FeatureCache]):
        if not shards:
            raise ValueError("FeatureShards needs at least one shard")
        first = shards[0]
        for i, shard in enumerate(shards[1:], 1):
            if (shard.layer_ids, shard.topk, shard.width) != (first.layer_ids, first.topk,
                                                              first.width):
                raise ValueError(f"shard {i} (layers {shard.layer_ids}, top-{shard.topk}, width "
                                 f"{shard.width}) differs from shard 0 (layers {first.layer_ids}, "
                                 f"top-{first.topk}, width {first.width})")
        self.shards, self.layer_ids, self.topk = shards, list(first.layer_ids), first.topk
        self.width = first.width
        self.tokens = torch.cat([s.tokens for s in shards])
        self.starts = torch.cat([s.starts for s in shards])
        # sequence i of shard k is global sequence firsts[k] + i; its rows move by bases[k]
        self.firsts = [0]
        lengths = []
        for shard in shards:
            self.firsts.append(self.firsts[-1] + len(shard))
            lengths.append(shard.offsets[1:] - shard.offsets[:-1])
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cat(lengths).cumsum(0)])

    def __len__(self) -> int:
        return self.firsts[-1]

    def _locate(self, i: int) -> tuple[FeatureCache, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        k = bisect.bisect_right(self.firsts, i) - 1
        return self.shards[k], i - self.firsts[k]

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        shard, j = self._locate(i)
        return shard.sequence(j)

    def soft(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard, j = self._locate(i)
        return shard.soft(j)

    @classmethod
    def load(cls, folder: str | Path) -> FeatureShards:
        """The complete shards under ``folder`` (ValueError if any is incomplete or none is
        there)."""
        folders = shard_folders(folder)
        if not folders:
            raise ValueError(f"no feature shards under {folder}")
        return cls([FeatureCache.load(f) for f in folders])


def shard_folders(folder: str | Path) -> list[Path]:
    """The shard folders under ``folder`` (000, 001, ...), in order."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and p.name.isdigit())


def _keys(cache: FeatureCache) -> list[tuple]:
    """Each cached sequence as (start, *token ids): what identifies it across builds."""
    tokens, offsets = cache.tokens.tolist(), cache.offsets.tolist()
    return [(int(s), *tokens[lo:hi]) for s, lo, hi in zip(cache.starts.tolist(), offsets,
                                                          offsets[1:])]


def build_shards(target: Any, sequences: list[Sequence], layer_ids: list[int],
                 folder: str | Path, shard_sequences: int, total: int | None = None,
                 seed: int = 0, topk: int = 0, batch_size: int = 8,
                 progress: bool = True) -> FeatureShards:
    """Features of ``total`` of ``sequences`` (None: all) in shards of at most
    ``shard_sequences`` under ``folder``: the complete shards already there count; the rest is
    drawn from the sequences they lack, in an order of all ``sequences`` fixed by ``seed``. A complete shard holding
    a sequence not in ``sequences`` (built from other data or settings) is a ValueError.
    ``topk``, ``batch_size``: as FeatureCache.build."""
    if shard_sequences < 1:
        raise ValueError(f"shard_sequences must be >= 1, got {shard_sequences}")
    total = len(sequences) if total is None else min(total, len(sequences))
    if total < 1:
        raise ValueError("no sequences to featurise")
    folder = Path(folder)
    wanted = {(start, *ids): i for i, (ids, start) in enumerate(sequences)}
    complete = [f for f in shard_folders(folder) if _Store.progress(f).get("complete")]
    if [f.name for f in complete] != [f"{k:03d}" for k in range(len(complete))]:
        raise ValueError(f"the complete shards under {folder} are not numbered 000, 001, ...: "
                         f"{[f.name for f in complete]}")
    covered: set[int] = set()
    for f in complete:
        keys = _keys(FeatureCache.load(f))
        stray = sum(key not in wanted for key in keys)
        if stray:
            raise ValueError(f"shard {f} holds {stray} sequences that are not in this data set "
                             "(built from other answers or another max_len): remove it")
        covered.update(wanted[key] for key in keys)
    # one seeded order of all the sequences: a shard's sequences do not depend on whether the
    # shards before it were built in this run or an earlier one
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    rest = [i for i in order if i not in covered]
    k, done = len(complete), len(covered)
    while done < total and rest:
        n = min(shard_sequences, total - done)
        picks, rest = rest[:n], rest[n:]
        if progress:
            print(f"feature shard {k:03d}: {len(picks)} sequences ({done} of {total} done)",
                  flush=True)
        FeatureCache.build(target, [sequences[i] for i in picks], layer_ids, progress=progress,
                           batch_size=batch_size, topk=topk, folder=folder / f"{k:03d}")
        k, done = k + 1, done + len(picks)
    return FeatureShards.load(folder)
