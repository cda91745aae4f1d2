"""The continuous-batching answer generator (dartree.train.answers): every answer equals HF
`generate(do_sample=False)` of its prompt alone, whatever slot, refill order or packing it went
through; bad input is refused by name."""

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from dartree.train import answers as answers_module
from dartree.train.answers import greedy_answers

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 97
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=128, tie_word_embeddings=False,
             initializer_range=0.25)  # wide logits: greedy choices far from ties
MODELS = {
    "llama-gqa": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2)),
    "llama-mha": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4, mlp_bias=True)),
    "qwen2-bias": (Qwen2Config, Qwen2ForCausalLM, dict(num_key_value_heads=2)),
    "qwen3-qknorm": (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=1, head_dim=16)),
}
MAX_NEW = 12


def _model(name, dtype):
    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SHAPE, **extra)).to(dtype).eval()
    with torch.no_grad():  # norms and biases away from their 1 / 0 inits, so their use shows
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _prompts(n=11, seed=1):
    """Lengths 1..40 in a mixed order: long prompts are followed by short ones in a slot, so a
    refilled slot holds stale rows beyond its new length."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [40, 3, 1, 27, 9, 33, 2, 18, 5, 40, 12][:n]
    return [torch.randint(0, VOCAB, (k,), generator=gen).tolist() for k in lengths]


def _reference(model, prompt, max_new, eos):
    """HF greedy decoding of the prompt alone: (new tokens, smallest top-2 logit gap)."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new,
                         eos_token_id=eos, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = [float(v[0] - v[1]) for v in (l[0].topk(2).values for l in out.logits)]
    return tokens, min(gaps)


def _eos_for(model, prompts):
    """A token that ends some references early and not others: answers end at different steps."""
    runs = [_reference(model, p, MAX_NEW, None)[0] for p in prompts]
    counts = torch.bincount(torch.tensor([r[MAX_NEW // 3] for r in runs]), minlength=VOCAB)
    return int(counts.argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("slots,prefill_tokens", [(3, 4096), (4, 1), (64, 50)])
def test_answers_equal_greedy_of_each_prompt_alone(name, dtype, slots, prefill_tokens):
    model = _model(name, dtype)
    prompts = _prompts()
    eos = _eos_for(model, prompts)
    refs = [_reference(model, p, MAX_NEW, eos) for p in prompts]
    if dtype == torch.float32:  # rounding of a batched product (~1e-6) cannot flip these choices
        assert min(gap for _, gap in refs) > 1e-3, "fixture: a near-tied greedy choice"
    lengths = [len(tokens) for tokens, _ in refs]
    assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW, "fixture: answers end together"
    got = dict(greedy_answers(model, prompts, MAX_NEW, eos, slots=slots,
                              prefill_tokens=prefill_tokens))
    assert sorted(got) == list(range(len(prompts)))
    for index, (tokens, _) in enumerate(refs):
        assert got[index] == tokens, f"prompt {index} (length {len(prompts[index])})"


def test_answers_come_in_the_order_they_end():
    model = _model("llama-gqa", torch.float64)
    prompts = _prompts()
    eos = _eos_for(model, prompts)
    order = [index for index, _ in greedy_answers(model, prompts, MAX_NEW, eos, slots=len(prompts))]
    ends = [len(_reference(model, p, MAX_NEW, eos)[0]) for p in prompts]
    assert [ends[i] for i in order] == sorted(ends)


def test_the_tail_decodes_only_the_answers_still_running(monkeypatch):
    """Once the prompts run out, running answers move to the first slots (their cache rows with
    them) and a step decodes only those: the batch shrinks, every answer stays the reference."""
    model = _model("qwen3-qknorm", torch.float64)
    prompts = _prompts()
    eos = _eos_for(model, prompts)
    batches = []
    decode = answers_module._Stack.decode

    def recording(self, tokens, lengths):
        batches.append(tokens.shape[0])
        return decode(self, tokens, lengths)

    monkeypatch.setattr(answers_module._Stack, "decode", recording)
    got = dict(greedy_answers(model, prompts, MAX_NEW, eos, slots=8))
    for index, prompt in enumerate(prompts):
        assert got[index] == _reference(model, prompt, MAX_NEW, eos)[0], f"prompt {index}"
    assert batches[0] == 8 and min(batches) < 4, batches
    assert batches == sorted(batches, reverse=True), "the batch only shrinks once prompts run out"


def test_a_full_cache_row_ends_the_answer():
    model = _model("llama-gqa", torch.float64)
    prompts = _prompts()[:4]
    max_len = 44  # rows per slot: the 40-token prompts get 44 - 40 + 1 = 5 tokens
    got = dict(greedy_answers(model, prompts, MAX_NEW, None, slots=2, max_len=max_len))
    for index, prompt in enumerate(prompts):
        expected = _reference(model, prompt, MAX_NEW, None)[0][:max_len - len(prompt) + 1]
        assert got[index] == expected


def test_bad_input_is_refused_by_name():
    model = _model("llama-gqa", torch.float32)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        list(greedy_answers(model, [[1, 2], []], 4, None))
    with pytest.raises(ValueError, match="prompt 0 has token ids outside the vocabulary"):
        list(greedy_answers(model, [[1, VOCAB]], 4, None))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        list(greedy_answers(model, [[1]], 0, None))
    with pytest.raises(ValueError, match="slots must be >= 1, got 0"):
        list(greedy_answers(model, [[1]], 4, None, slots=0))
    with pytest.raises(ValueError, match="max_len must exceed the longest prompt"):
        list(greedy_answers(model, [[1, 2, 3]], 4, None, max_len=3))
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 128"):
        list(greedy_answers(model, [[1, 2, 3]], 200, None))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match="model must be one of transformers' LlamaForCausalLM"):
        list(greedy_answers(gpt2, [[1]], 4, None))
    assert list(greedy_answers(model, [], 4, None)) == []
