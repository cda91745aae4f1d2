"""Two-turn prompt sets: the target answers each first turn before the run, and the conversation
(first turn, its answer, second turn) becomes the prompt.

MT-Bench's second turns ask about the first answer ("now rewrite it as ..."), so the context a
decoder sees holds text the target itself wrote: where n-gram lookups find most of their hits.
Each answer is the target's own greedy decoding (`SpeculativeDecoder(method="ar")`, the bench's
dtype and `exact`, up to `max_new_tokens`, stopping at the bench's EOS), so it is what the same
target would have said in the first turn of that chat.

Answers are kept in `cache` (a folder: one JSON file per target and settings, keyed by the first
turn's token ids), so a rerun does not decode them again; the key covers what changes an answer:
the target's class, config, dtype and a sample of every weight tensor, exact, max_new_tokens,
max_prompt_tokens and the EOS ids.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from ..decoding import SpeculativeDecoder
from ..prompts import PromptSet, TwoTurn
from ..target import TargetModel
from .encode import encode_prompts, has_chat_template

log = logging.getLogger(__name__)


def answer_first_turns(prompt_set: PromptSet, target, tokenizer, settings, eos_token_id,
                       cache: str | Path | None = None) -> PromptSet:
    """The set with every `TwoTurn` replaced by its conversation (other prompts pass through).

    With a chat template: messages [user: first, assistant: the answer's text, user: second];
    without one: token ids, the first turn's + the answer's + the second turn's (as
    `encode_prompts` encodes plain text). settings: the BenchSettings (exact, max_new_tokens,
    max_prompt_tokens)."""
    turns = [p for p in prompt_set.prompts if isinstance(p, TwoTurn)]
    if not turns:
        return prompt_set
    model = target.model if isinstance(target, TargetModel) else target
    vocab = model.get_output_embeddings().out_features
    firsts = encode_prompts(PromptSet(prompt_set.name, [t.first for t in turns]), tokenizer, vocab,
                            settings.max_prompt_tokens)
    path = None if cache is None else Path(cache) / f"{_key(model, settings, eos_token_id)}.json"
    stored = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    decoder, decoded, answers = None, 0, []
    for ids in firsts:
        key = ",".join(map(str, ids))
        if key not in stored:
            if decoder is None:
                decoder = SpeculativeDecoder(target, None, method="ar", exact=settings.exact)
            stored[key] = decoder.generate(ids, max_new_tokens=settings.max_new_tokens,
                                           eos_token_id=eos_token_id).tokens
            decoded += 1
        answers.append(stored[key])
    log.info("%s: %d first answers decoded, %d read from %s", prompt_set.name, decoded,
             len(turns) - decoded, path)
    if path is not None and decoder is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored))
        tmp.replace(path)
    chat = has_chat_template(tokenizer)
    done = iter(zip(turns, firsts, answers))
    prompts = []
    for prompt in prompt_set.prompts:
        if not isinstance(prompt, TwoTurn):
            prompts.append(prompt)
            continue
        turn, first_ids, answer = next(done)
        if chat:
            text = tokenizer.decode(answer, skip_special_tokens=True)
            prompts.append([{"role": "user", "content": turn.first},
                            {"role": "assistant", "content": text},
                            {"role": "user", "content": turn.second}])
        else:
            second = encode_prompts(PromptSet(prompt_set.name, ["\n\n" + turn.second]), tokenizer,
                                    vocab, settings.max_prompt_tokens)[0]
            prompts.append(first_ids + answer + second)
    return PromptSet(prompt_set.name, prompts, prompt_set.source)


def _key(model, settings, eos_token_id) -> str:
    """What an answer depends on, hashed: the model (class, config, dtype, device type, and the
    first 64 values of every parameter and buffer with its name and shape) and the settings."""
    h = hashlib.sha256()
    param = next(model.parameters())
    h.update(json.dumps([type(model).__name__, model.config.to_json_string(), str(param.dtype),
                         param.device.type, settings.exact, settings.max_new_tokens,
                         settings.max_prompt_tokens, eos_token_id], default=str).encode())
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        h.update(f"{name}{tuple(tensor.shape)}".encode())
        sample = tensor.detach().reshape(-1)[:64].cpu().contiguous()
        h.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return h.hexdigest()[:24]
