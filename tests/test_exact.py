"""`dartree.exact()` and `SpeculativeDecoder(..., exact=True)`: bit-exact in every dtype.

The reference "target alone" is transformers' own greedy `generate` inside `dartree.exact()`; every
method with exact=True must return its tokens, in bfloat16 as in float32."""

import inspect
import random

import pytest
import torch
import torch.nn.functional as F

import dartree
from dartree import SpeculativeDecoder, ops
from dartree.decoding import METHODS

from helpers import greedy_reference, make_drafter, tiny_target

CONFIGS = [("llama", torch.bfloat16), ("qwen3", torch.bfloat16), ("llama", torch.float32),
           ("qwen3", torch.float32)]
PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 42, 7, 7, 7, 64, 128, 31, 2], [9] * 23 + [100, 3]]
NEW_TOKENS = 48


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}")
def target(request, one_thread):
    return tiny_target(*request.param)


@pytest.fixture(scope="module")
def exact_reference(target):
    """Greedy generate of every prompt inside dartree.exact()."""
    with torch.no_grad(), dartree.exact():
        return [greedy_reference(target, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_equals_exact_generate(native, target, exact_reference, method):
    for seed, (prompt, expected) in enumerate(zip(PROMPTS, exact_reference)):
        drafter = make_drafter(target, domino=True, block_size=6, seed=seed)
        dec = SpeculativeDecoder(target, drafter, method=method, budget=12, width=4, candidates=8,
                                 exact=True)
        assert dec.generate(prompt, max_new_tokens=NEW_TOKENS).tokens == expected, (method, prompt)


def test_prefill_rows_equal_one_token_decoding(native, target):
    """Every row of a prefill (T = n) has the logits of that token decoded alone with a KV cache:
    linears, attention, norms, RoPE, the MLP and the residual adds are all row-invariant."""
    from transformers import DynamicCache

    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad(), dartree.exact():
        block = target(ids).logits[0]
        cache = DynamicCache(config=target.config)
        # transformers >= 5.2x names the argument `cache`, 5.17 `past_key_values`
        name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        for i in range(ids.shape[1]):
            step = target(ids[:, i:i + 1], use_cache=True, **{name: cache}).logits[0, 0]
            assert torch.equal(step, block[i]), i


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_decoder_layer_pieces_are_row_invariant(kind, dtype):
    """The non-linear, non-attention work of a decoder layer as transformers runs it on the CPU:
    row i of a batch of T rows equals row i computed alone, for random T."""
    model = tiny_target(kind, dtype)
    layer = model.model.layers[0]
    norms = [layer.input_layernorm, model.model.norm] + (
        [layer.self_attn.q_norm, layer.self_attn.k_norm] if kind == "qwen3" else [])
    rotary = model.model.rotary_emb
    rng = random.Random(3)
    with torch.no_grad():
        for _ in range(6):
            size = rng.randint(2, 80)
            h = torch.randn(1, size, 64).to(dtype)
            for norm in norms:
                x = h.reshape(1, size, -1, norm.weight.shape[0])
                full = norm(x)
                for i in rng.sample(range(size), 3):
                    assert torch.equal(norm(x[:, i:i + 1]), full[:, i:i + 1])
            act = layer.mlp.act_fn
            gate, up = torch.randn(2, 1, size, 128).to(dtype)
            full = act(gate) * up
            positions = torch.arange(size)[None] + 5
            cos, sin = rotary(h, positions)
            for i in rng.sample(range(size), 3):
                assert torch.equal(act(gate[:, i:i + 1]) * up[:, i:i + 1], full[:, i:i + 1])
                cos_i, sin_i = rotary(h[:, i:i + 1], positions[:, i:i + 1])
                assert torch.equal(cos_i, cos[:, i:i + 1]) and torch.equal(sin_i, sin[:, i:i + 1])


def test_exact_routes_linear_and_attention(native):
    x, w, b = torch.randn(7, 33).bfloat16(), torch.randn(20, 33).bfloat16(), torch.randn(20).bfloat16()
    layer = torch.nn.Linear(33, 20, dtype=torch.bfloat16)
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    chain = torch.ones(3, 3, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        want_layer = ops.exact_linear(x, layer.weight, layer.bias)
        with dartree.exact():
            assert dartree.exact_mode.active()
            assert torch.equal(F.linear(x, w, b), ops.exact_linear(x, w, b))
            assert torch.equal(layer(x[None])[0], want_layer)
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            causal = F.scaled_dot_product_attention(q, k[:, :, :3], v[:, :, :3], is_causal=True,
                                                    enable_gqa=True)
        assert not dartree.exact_mode.active()
    every = torch.ones(1, 3, 3, dtype=torch.bool)
    assert torch.equal(out, ops.exact_tree_attention(q, k, v, every, 6))
    assert torch.equal(causal, ops.exact_tree_attention(q, k, v, chain, 0))


def test_exact_accepts_decode_masks_and_refuses_padding(native):
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    bottom_right = torch.ones(3, 10, dtype=torch.bool).tril(diagonal=7)[None, None]
    additive = torch.zeros(1, 1, 3, 10).masked_fill(~bottom_right, float("-inf"))
    chain = torch.ones(1, 3, 3, dtype=torch.bool).tril()
    want = ops.exact_tree_attention(q, k, v, chain, 7)
    padded = bottom_right.clone()
    padded[..., 0] = False
    with torch.no_grad(), dartree.exact():
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=bottom_right), want)
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=additive), want)
        with pytest.raises(ValueError, match="padding"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=padded)
        with pytest.raises(ValueError, match="top-left"):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with pytest.raises(ValueError, match="dropout"):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        with pytest.raises(ValueError, match="one dtype"):
            F.linear(torch.randn(2, 8), torch.randn(3, 8).double())


def test_exact_generate_refuses_left_padding(native):
    model = tiny_target("llama", torch.float32, layers=1)
    ids = torch.tensor([[0, 0, 5, 17, 99]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    with torch.no_grad(), dartree.exact(), pytest.raises(ValueError, match="padding"):
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2, pad_token_id=0)


def test_exact_needs_no_grad_and_kernels(native):
    layer = torch.nn.Linear(8, 4)
    with dartree.exact(), pytest.raises(RuntimeError, match="no backward"):
        layer(torch.randn(2, 8))
    model = tiny_target("qwen3", torch.float32, layers=1)
    with ops.reference_ops():
        with pytest.raises(ValueError, match="batch-invariant kernels"):
            SpeculativeDecoder(model, None, method="ar", exact=True)
        with torch.no_grad(), dartree.exact(), pytest.raises(RuntimeError, match="not be bit-exact"):
            layer(torch.randn(2, 8))
