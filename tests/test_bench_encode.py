"""dartree.bench.encode: the default prompt sets and prompt ids, through a chat template or not."""

import string

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dartree.bench.encode import default_prompt_sets, encode_prompts, uses_chat_template
from dartree.prompts import PromptSet

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def char_tokenizer(template=None):
    """One id per printable character; with `template` as its chat template."""
    chars = ["<unk>", "<eos>"] + list(string.printable)
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = template
    return fast


def test_chat_model_gets_user_messages_except_stdlib():
    tok = char_tokenizer(TEMPLATE)
    chat = PromptSet("humaneval", ["def f(x):", "hi"])
    ids = encode_prompts(chat, tok, 100, max_tokens=512)
    assert ids[1] == tok("<user>hi\n<assistant>", add_special_tokens=False).input_ids
    assert uses_chat_template(chat, tok) and uses_chat_template(PromptSet("mine", ["a"]), tok)
    plain = PromptSet("stdlib", ["hi"])
    assert not uses_chat_template(plain, tok)
    assert encode_prompts(plain, tok, 100, 512) == [tok("hi").input_ids]
    assert default_prompt_sets(tok) == "humaneval,mtbench"


def test_plain_tokenizer_and_no_tokenizer():
    tok = char_tokenizer()
    ps = PromptSet("humaneval", ["hi there", [7, 8, 9]])
    assert not uses_chat_template(ps, tok)
    assert encode_prompts(ps, tok, 100, 512) == [tok("hi there").input_ids, [7, 8, 9]]
    assert encode_prompts(ps, None, 100, 3) == [[b % 100 for b in b"ere"], [7, 8, 9]]  # last 3 tokens
    assert default_prompt_sets(tok) == default_prompt_sets(None) == "humaneval,mtbench,stdlib"
    with pytest.raises(ValueError, match=r"prompt e\[0\] is empty"):
        encode_prompts(PromptSet("e", [""]), None, 100, 512)
