"""The target's answers as files that can live in the repository: token ids only, keyed by prompt.

A shard is one compressed NumPy archive (``.npz``) of rows; a row is

    key     sha1 hex of the conversation's human turns and its source (`prompt_key`): the prompts
            stage re-derives the text from the installed sources, and the key joins the two
    source  where the prompt came from ("sharegpt", "code", "magpie", ...)
    turns   how many human turns the conversation has (the answer is to the last one; the
            target's own answers to the earlier ones are in other rows)
    prompt_len, prompt_crc  length and CRC-32 of the prompt's token ids through the chat
            template, so a reader can check that it re-derived the same prompt
    answer  the answer's token ids (uint16), ending with EOS when the target stopped by itself
    prompt  the prompt's token ids, only for sources whose text may be committed (never ShareGPT's:
            its ids are its text)

`write_shard` writes atomically (a temporary file, then a rename); `read_shards` reads a folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zlib
from pathlib import Path

import numpy as np

# sources whose prompt text must never be in a shard (their licence is unknown)
TEXT_NOT_KEPT = ("sharegpt",)


def prompt_key(turns: list[str], source: str) -> str:
    """The stable key of a conversation: sha1 of its source and human turns (JSON, UTF-8)."""
    if not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"turns must be a non-empty list of strings, got {turns!r:.80}")
    return hashlib.sha1(json.dumps([source, *turns], ensure_ascii=False).encode()).hexdigest()


def prompt_crc(ids: list[int]) -> int:
    return zlib.crc32(np.asarray(ids, dtype=np.uint32).tobytes())


@dataclasses.dataclass
class AnswerRow:
    key: str
    source: str
    turns: int
    prompt_len: int
    prompt_crc: int
    answer: list[int]
    prompt: list[int] | None = None


def _ids(values: list[int], what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.uint16).max):
        raise ValueError(f"{what} must be token ids in [0, 65535] to be stored as uint16")
    return array.astype(np.uint16)


def write_shard(file: str | Path, rows: list[AnswerRow]) -> None:
    """Write `rows` to `file` (.npz), atomically."""
    file = Path(file)
    if file.suffix != ".npz":
        raise ValueError(f"file must end in .npz, got {file.name}")
    for row in rows:
        if row.source in TEXT_NOT_KEPT and row.prompt:
            raise ValueError(f"row {row.key}: prompts from {row.source!r} must not be stored")
        if len(row.key) != 40:
            raise ValueError(f"row key must be a sha1 hex digest, got {row.key!r}")
    sources = sorted({r.source for r in rows})
    kept = [r.prompt or [] for r in rows]
    arrays = dict(
        key=np.array([r.key for r in rows], dtype="S40"),
        sources=np.array(sources, dtype=str),
        source=np.array([sources.index(r.source) for r in rows], dtype=np.uint8),
        turns=np.array([r.turns for r in rows], dtype=np.uint8),
        prompt_len=np.array([r.prompt_len for r in rows], dtype=np.uint32),
        prompt_crc=np.array([r.prompt_crc for r in rows], dtype=np.uint32),
        answer_offsets=np.cumsum([0] + [len(r.answer) for r in rows], dtype=np.int64),
        answer_ids=_ids([t for r in rows for t in r.answer], "answers"),
        prompt_offsets=np.cumsum([0] + [len(p) for p in kept], dtype=np.int64),
        prompt_ids=_ids([t for p in kept for t in p], "prompts"))
    tmp = file.with_name(file.name + ".tmp")
    with open(tmp, "wb") as handle:
        np.savez_compressed(handle, **arrays)
    os.replace(tmp, file)


def read_shard(file: str | Path) -> list[AnswerRow]:
    with np.load(file) as data:
        sources = [str(s) for s in data["sources"]]
        answers, prompts = data["answer_ids"].astype(np.int64), data["prompt_ids"].astype(np.int64)
        a_off, p_off = data["answer_offsets"], data["prompt_offsets"]
        rows = []
        for i, key in enumerate(data["key"]):
            prompt = prompts[p_off[i]:p_off[i + 1]].tolist()
            rows.append(AnswerRow(key.decode(), sources[data["source"][i]], int(data["turns"][i]),
                                  int(data["prompt_len"][i]), int(data["prompt_crc"][i]),
                                  answers[a_off[i]:a_off[i + 1]].tolist(), prompt or None))
    return rows


def read_shards(folder: str | Path) -> dict[str, AnswerRow]:
    """Every row of every shard in `folder`, by key (a folder that does not exist: none)."""
    out: dict[str, AnswerRow] = {}
    for file in sorted(Path(folder).glob("*.npz")):
        for row in read_shard(file):
            out[row.key] = row
    return out
