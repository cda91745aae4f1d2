"""A drafter's draft vocabulary: the tokens its LM head scores while drafting.

The draft stage's largest product is the LM head over every slot (k rows x V x H). Most of the
vocabulary is never the target's next token: the target's own answers to its training prompts
use a few thousand tokens almost always (SmolLM2's: the 16,384 most frequent cover 99.3% of its
3.47M answer tokens). Drafting over those rows only (FR-Spec's frequency-ranked subset) cuts the
product by V / |vocab|; a token outside it is never proposed, which can cost acceptance but never
correctness: the target checks every proposal and commits its own tokens, whatever was drafted.

Stored as ``draft_vocab.json`` in the drafter's folder (``load_drafter`` reads it, ``save_drafter``
writes it): ``{"ids": [...], ...}``, the ids ascending, plus how they were chosen. Training over
a vocabulary (``dartree.train.train_drafter(draft_vocab=...)``) scores its loss on those tokens
only (``Drafter.vocab_logits``), as drafting ranks them.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

VOCAB_FILE = "draft_vocab.json"


def frequent_tokens(sequences: Iterable[Sequence[int]], size: int, vocab_size: int,
                    always: Iterable[int] = ()) -> tuple[list[int], float]:
    """The `size` most frequent ids of `sequences` (ties: the lower id), `always` included, as an
    ascending list, and the share of the sequences' tokens they cover."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(int(t) for t in seq)
    bad = [t for t in list(counts) + list(always) if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {sorted(set(bad))[:5]}")
    keep = set(int(t) for t in always)
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) >= size:
            break
        keep.add(token)
    total = sum(counts.values())
    covered = sum(counts[t] for t in keep) / total if total else 0.0
    return sorted(keep), covered


def check_ids(ids: Sequence[int] | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids as an ascending int64 CPU tensor, refused unless 1-D, non-empty, distinct and in range."""
    t = torch.as_tensor(ids).cpu()
    if t.dim() != 1 or t.numel() == 0 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"a draft vocabulary must be a non-empty 1-D list of token ids, got "
                         f"{t.dtype} {list(t.shape)}")
    t = torch.sort(t.to(torch.int64)).values
    if int(t[0]) < 0 or int(t[-1]) >= vocab_size:
        raise ValueError(f"draft vocabulary ids must be in [0, {vocab_size}), got "
                         f"{int(t[0])} .. {int(t[-1])}")
    if bool((t[1:] == t[:-1]).any()):
        raise ValueError("draft vocabulary ids must be distinct")
    return t


def save_draft_vocab(folder: str | Path, ids: Sequence[int] | torch.Tensor, vocab_size: int,
                     **record) -> Path:
    """Write ``draft_vocab.json`` (ids ascending, with `record`: how they were chosen)."""
    t = check_ids(ids, vocab_size)
    path = Path(folder) / VOCAB_FILE
    body = {**record, "size": t.numel(), "vocab_size": vocab_size, "ids": t.tolist()}
    # one field a line, the ids on one line (json's indent would give each id its own)
    path.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in body.items()) + "\n}\n")
    return path


def read_draft_vocab(folder: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The ids of ``folder/draft_vocab.json`` (checked), or None when there is no such file."""
    path = Path(folder) / VOCAB_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        ids = data["ids"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a draft vocabulary file ({err})") from None
    if data.get("vocab_size", vocab_size) != vocab_size:
        raise ValueError(f"{path} was made for a vocabulary of {data['vocab_size']} tokens, the "
                         f"target has {vocab_size}")
    return check_ids(ids, vocab_size)


def restrict_lm_head(lm_head: nn.Module, ids: torch.Tensor) -> nn.Module:
    """An LM head computing `lm_head`'s logits of `ids` only: [..., H] -> [..., len(ids)] (its rows
    copied, packed ones as they are: a packed head's logits keep their bits, as packed_linear
    sums every output on its own; a dense one's round as the vendor GEMM rounds)."""
    from ..gguf import PackedLinear

    if isinstance(lm_head, PackedLinear):
        ids = ids.to(lm_head.packed.device)
        bias = None if lm_head.bias is None else lm_head.bias.detach()[ids]
        return PackedLinear(lm_head.packed.index_select(0, ids), lm_head.qtype, lm_head.in_features,
                            bias=bias, dtype=lm_head.dtype)
    if isinstance(lm_head, nn.Linear):
        ids = ids.to(lm_head.weight.device)
        head = nn.Linear(lm_head.in_features, ids.numel(), bias=lm_head.bias is not None,
                         device=lm_head.weight.device, dtype=lm_head.weight.dtype)
        with torch.no_grad():
            head.weight.copy_(lm_head.weight[ids])
            if lm_head.bias is not None:
                head.bias.copy_(lm_head.bias[ids])
        return head.requires_grad_(False)
    raise ValueError(f"a draft vocabulary needs the target's LM head to be an nn.Linear or a packed "
                     f"GGUF layer, got {type(lm_head).__name__}")
