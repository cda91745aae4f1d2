"""Training text: files, folders and JSONL rows tokenized into one stream (load_corpus), and
random windows of it (TokenStream)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch

from ..prompts import jsonl_rows


TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".cpp", ".js", ".ts", ".java", ".go",
                 ".rs", ".sh", ".json", ".toml", ".yaml", ".yml", ".html", ".css")


def _jsonl_texts(path: Path) -> Iterable[str]:
    """Texts of a JSONL file: ``text``, or ``prompt`` + ``completion``/``response``, or
    ``messages`` (contents joined)."""
    for number, _, row in jsonl_rows(path):
        if isinstance(row, str):
            yield row
        elif isinstance(row, dict) and isinstance(row.get("text"), str):
            yield row["text"]
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            yield row["prompt"] + str(row.get("completion", row.get("response", "")))
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            yield "\n".join(str(m.get("content", "")) for m in row["messages"]
                            if isinstance(m, dict))
        else:
            raise ValueError(f"{path}:{number}: a JSONL row needs a 'text', 'prompt' or "
                             f"'messages' field")


def corpus_texts(paths: Iterable[str | Path], suffixes: tuple[str, ...] = TEXT_SUFFIXES
                 ) -> Iterable[str]:
    """Documents of files, folders (walked recursively, files ending in ``suffixes``, sorted)
    and ``.jsonl`` files (one document per row)."""
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and
                           (p.suffix in suffixes or p.suffix == ".jsonl"))
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"corpus path {path} does not exist")
        for file in files:
            if file.suffix == ".jsonl":
                yield from _jsonl_texts(file)
            else:
                yield file.read_text(encoding="utf-8", errors="replace")


def load_corpus(paths: Iterable[str | Path], tokenizer: Any) -> torch.Tensor:
    """Tokenize a corpus into one LongTensor stream, each document followed by EOS (if any)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    docs = 0
    for text in corpus_texts(paths):
        ids.extend(tokenizer(text, add_special_tokens=False).input_ids)
        if eos is not None:
            ids.append(eos)
        docs += 1
    if not docs:
        raise ValueError("the corpus has no documents (no matching files)")
    return torch.tensor(ids, dtype=torch.long)


class TokenStream:
    """Random windows of one token stream (a 1-D integer tensor)."""

    def __init__(self, ids: torch.Tensor):
        ids = torch.as_tensor(ids)
        if ids.dim() != 1 or ids.is_floating_point():
            raise ValueError(f"token stream must be a 1-D integer tensor, got {ids.dtype} "
                             f"{list(ids.shape)}")
        self.ids = ids.long()

    def __len__(self) -> int:
        return len(self.ids)

    def sample(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """[batch, length] windows at uniform random offsets."""
        if len(self.ids) < length:
            raise ValueError(f"the corpus has {len(self.ids)} tokens, fewer than one window "
                             f"(seq_len {length})")
        starts = torch.randint(0, len(self.ids) - length + 1, (batch,), generator=generator)
        return torch.stack([self.ids[s:s + length] for s in starts.tolist()])
