"""Each bad input named in DESIGN.md raises a ValueError that names the problem."""

import pytest
import torch

from dartree import SpeculativeDecoder, load_drafter, save_drafter

from helpers import make_drafter, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def drafter(target):
    return make_drafter(target, block_size=4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget=0), "budget must be an int >= 1 or 'auto', got 0"),
    (dict(budget="best"), "budget must be an int >= 1 or 'auto', got 'best'"),
    (dict(lookup_store_mb=0), "lookup store size must be a number of megabytes > 0, got 0"),
    (dict(lookup_store_mb=-1.5), "lookup store size must be a number of megabytes > 0"),
    (dict(ngram="yes"), "ngram must be True or False, got 'yes'"),
    (dict(method="ngram", ngram=False), "ngram=False leaves it nothing to verify"),
    (dict(width=0), "width must be an int >= 1"),
    (dict(candidates=-3), "candidates must be an int >= 1"),
    (dict(depth_bonus=0.5), "depth_bonus must be a finite number <= 0"),
    (dict(method="medusa"), "method must be one of"),
])
def test_bad_decoder_options(target, drafter, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(target, drafter, **kwargs)


def test_tree_method_without_drafter(target):
    with pytest.raises(ValueError, match="needs a drafter"):
        SpeculativeDecoder(target, None, method="dartree")


@pytest.mark.parametrize("method", ["domino", "dartree-fixed", "dartree"])
def test_domino_methods_need_a_head(target, method):
    match = f"method '{method}' needs a drafter with a Domino head.*use 'dflash' or 'ddtree'"
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(target, make_drafter(target, domino=False), method=method)


@pytest.mark.parametrize("input_ids, match", [
    ([], "non-empty"),
    ([[1, 2], [3, 4]], "batch size 1"),
    ([1, 2, 256], "token id 256, outside the vocabulary"),
    ([1, -1], "token id -1, outside the vocabulary"),
    (torch.tensor([1.0, 2.0]), "integer token ids"),
    (["def", "f"], "input_ids must be a list of ints.*got list"),
    ({"attention_mask": [1, 1]}, "input_ids must be a list of ints.*got dict"),
])
def test_bad_input_ids(target, drafter, input_ids, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(target, drafter).generate(input_ids, max_new_tokens=4)


def test_a_tokenizer_output_is_taken_as_its_input_ids(target, drafter):
    """What `tokenizer(text)` / `apply_chat_template(..., return_dict=True)` return: its input_ids."""
    from transformers import BatchEncoding

    dec = SpeculativeDecoder(target, drafter)
    expected = dec.generate([5, 17, 99], max_new_tokens=6).tokens
    encoded = BatchEncoding({"input_ids": [[5, 17, 99]], "attention_mask": [[1, 1, 1]]})
    assert dec.generate(encoded, max_new_tokens=6).tokens == expected


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(eos_token_id=1000), "eos_token_id 1000 is outside the vocabulary"),
])
def test_bad_generate_arguments(target, drafter, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(target, drafter).generate([1, 2, 3], **{"max_new_tokens": 4, **kwargs})


def test_context_longer_than_the_cache(target, drafter):
    dec = SpeculativeDecoder(target, drafter, max_length=40)
    with pytest.raises(ValueError, match="exceeds max_length 40"):
        dec.generate(list(range(30)), max_new_tokens=20)


def test_drafter_for_another_target(tmp_path, target):
    other = tiny_target("qwen3", vocab=300, seed=1)
    save_drafter(make_drafter(other), tmp_path)
    with pytest.raises(ValueError, match="vocab"):
        load_drafter(tmp_path, target)
