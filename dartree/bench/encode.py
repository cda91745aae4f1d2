"""Which prompt sets a run uses by default, and their token ids (through the chat template of a
chat model)."""

from __future__ import annotations

from ..prompts import PromptSet

# Code continuations for the bundled stdlib code model: plain text even for a chat model.
PLAIN_SETS = frozenset({"stdlib"})


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def default_prompt_sets(tokenizer) -> str:
    """humaneval,mtbench for a chat model (a tokenizer with a chat template); stdlib as well
    otherwise (the bundled code model continues code)."""
    return "humaneval,mtbench" if has_chat_template(tokenizer) else "humaneval,mtbench,stdlib"


def uses_chat_template(prompt_set: PromptSet, tokenizer) -> bool:
    """Whether the set's prompts go in as user messages of the tokenizer's chat template."""
    return has_chat_template(tokenizer) and prompt_set.name not in PLAIN_SETS


def encode_prompts(prompt_set: PromptSet, tokenizer, vocab_size: int, max_tokens: int) -> list[list[int]]:
    """Token ids of each prompt (its last `max_tokens`).

    With a chat template (`uses_chat_template`) a string prompt is one user message followed by the
    assistant's generation prompt, and a conversation (a list of {"role", "content"} messages) its
    messages followed by the generation prompt; else a string is tokenized as plain text. Without
    a tokenizer, each UTF-8 byte b becomes id b % vocab_size (a tokenizer-free path for random
    test models). Prompts that are already lists of ints pass through."""
    chat = uses_chat_template(prompt_set, tokenizer)
    encoded = []
    for index, prompt in enumerate(prompt_set.prompts):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if not chat:
                raise ValueError(f"prompt {prompt_set.name}[{index}] is a conversation: it needs a "
                                 "tokenizer with a chat template")
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        elif isinstance(prompt, str):
            if chat:
                text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                     tokenize=False, add_generation_prompt=True)
                ids = list(tokenizer(text, add_special_tokens=False).input_ids)
            elif tokenizer is not None:
                ids = list(tokenizer(prompt).input_ids)
            else:
                ids = [b % vocab_size for b in prompt.encode("utf-8")]
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {prompt_set.name}[{index}] is empty after tokenization")
        encoded.append(ids[-max_tokens:])
    return encoded
