"""Prompts the target writes itself (Magpie: Xu et al. 2024, "Alignment Data Synthesis from
Scratch by Prompting Aligned LLMs with Nothing"): a chat model given its chat template up to
the opening of a user turn writes a user's request, drawn from the distribution it was tuned on.
Sampled to the token that ends the turn, filtered as ShareGPT's turns are (length, English,
duplicates); the caller still applies the evaluation-overlap filter."""

from __future__ import annotations

from typing import Any

import torch

from ..instructions import is_english, normalised
from .progress import Progress

_MARK = "\ue000MAGPIE\ue000"  # private-use characters: no chat template writes them itself


def user_turn_prefix(tokenizer: Any) -> tuple[list[int], int]:
    """(token ids of the chat template up to where a user's text begins, id of the token that
    ends a user's turn): the template rendered around a marker, cut at it."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    if text.count(_MARK) != 1:
        raise ValueError("the chat template does not write a user's text once: no Magpie prefix")
    before, after = text.split(_MARK)
    end = tokenizer(after, add_special_tokens=False).input_ids
    if not end:
        raise ValueError("the chat template writes nothing after a user's text: no token ends "
                         "the turn")
    return tokenizer(before, add_special_tokens=False).input_ids, end[0]


@torch.no_grad()
def magpie_prompts(target: Any, tokenizer: Any, count: int, *, max_new_tokens: int = 128,
                   temperature: float = 1.0, top_p: float = 1.0, batch: int = 32, seed: int = 0,
                   min_chars: int = 12, max_chars: int = 2000, max_batches: int | None = None,
                   seen: set[str] | None = None, progress: bool = True
                   ) -> tuple[list[str], dict]:
    """Up to ``count`` distinct user requests written by ``target`` (a transformers causal LM
    with ``generate``) through ``tokenizer``'s chat template, and the counts of the rows read
    (``sampled``: rows of the last batch past ``count`` are not read), kept and dropped (``unfinished``: no end of turn within ``max_new_tokens``; ``length``,
    ``not_english``, ``duplicate``). Batch b samples with torch seed ``seed + b`` (the same
    seed, model and settings give the same prompts); at most ``max_batches`` batches (default:
    four times what ``count`` needs), so a model that repeats itself cannot loop forever.
    ``seen``: normalised texts (``instructions.normalised``) that count as duplicates (prompts
    of other sources or earlier runs); the kept prompts are added to it."""
    if count < 1 or batch < 1 or max_new_tokens < 1:
        raise ValueError(f"count, batch and max_new_tokens must be >= 1, got {count}, {batch}, "
                         f"{max_new_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (Magpie samples), got {temperature}")
    prefix, stop = user_turn_prefix(tokenizer)
    device = next(target.parameters()).device
    ids = torch.tensor([prefix], device=device).repeat(batch, 1)
    limit = max_batches if max_batches is not None else 4 * -(-count // batch)
    counts = {"sampled": 0, "unfinished": 0, "length": 0, "not_english": 0, "duplicate": 0}
    kept: list[str] = []
    seen = set() if seen is None else seen
    bar = Progress(count, progress, every=1)
    for b in range(limit):
        if len(kept) >= count:
            break
        torch.manual_seed(seed + b)
        out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                              do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                              max_new_tokens=max_new_tokens, eos_token_id=stop,
                              pad_token_id=stop)
        for row in out[:, len(prefix):].tolist():
            if len(kept) == count:
                break
            counts["sampled"] += 1
            if stop not in row:
                counts["unfinished"] += 1
                continue
            text = tokenizer.decode(row[:row.index(stop)], skip_special_tokens=True).strip()
            reason = ("length" if not min_chars <= len(text) <= max_chars else
                      "not_english" if not is_english(text) else
                      "duplicate" if normalised(text) in seen else None)
            if reason:
                counts[reason] += 1
            else:
                seen.add(normalised(text))
                kept.append(text)
        bar.update(len(kept), "prompts")
    bar.close()
    counts["kept"] = len(kept)
    return kept, counts
