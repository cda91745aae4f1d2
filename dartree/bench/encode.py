"""Prompt token ids for a benchmark run."""

from __future__ import annotations

from ..prompts import PromptSet

def encode_prompts(prompt_set: PromptSet, tokenizer, vocab_size: int, max_tokens: int) -> list[list[int]]:
    """Token ids of each prompt (its last `max_tokens`). Without a tokenizer, each UTF-8 byte b
    becomes id b % vocab_size (a tokenizer-free path for random test models). Prompts that are
    already lists of ints pass through."""
    encoded = []
    for index, prompt in enumerate(prompt_set.prompts):
        if isinstance(prompt, str):
            if tokenizer is not None:
                ids = list(tokenizer(prompt).input_ids)
            else:
                ids = [b % vocab_size for b in prompt.encode("utf-8")]
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {prompt_set.name}[{index}] is empty after tokenization")
        encoded.append(ids[-max_tokens:])
    return encoded
