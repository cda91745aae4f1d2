"""dartree.decoder_stack: the target's own layer loop has the bits of transformers' forward.

Oracle: the same TargetModel calls through transformers' forward (the path every other model
takes), compared with torch.equal: logits, features and the KV cache after prefill, verify,
commit and a second verify, for each supported architecture, dtype and linear path. Then when
the loop must step aside (hooks, replaced forwards, foreign layers) and that it does."""

import pytest
import torch
from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config,
                          Qwen3Config)

from dartree import decoder_stack, ops
from dartree.target import TargetModel
from dartree.tree import DraftTree

VOCAB = 131
COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
              initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None)
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "llama-bias": lambda: LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=False),
    "qwen3": lambda: Qwen3Config(**COMMON),
}


def _model(kind, dtype, seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(CONFIGS[kind]()).to(dtype).eval()


def _tree(gen, size, root):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size)]
    depths = [0] * size
    for i in range(1, size):
        depths[i] = depths[parents[i]] + 1
    tokens = [root] + torch.randint(0, VOCAB, (size - 1,), generator=gen).tolist()
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents),
                     depths=torch.tensor(depths), scores=torch.zeros(size))


def _session(target, seed):
    """prefill 9 tokens, verify 12 nodes, commit a path, verify 20 nodes:
    every output and the cache after each step."""
    gen = torch.Generator().manual_seed(seed)
    target.allocate(64)
    target.kv.fill_(float("nan"))  # rows written by neither path stay NaN in both
    out = [*target.prefill(torch.randint(0, VOCAB, (9,), generator=gen)), target.kv.clone()]
    tree = _tree(gen, 12, root=4)
    out += [*target.verify(tree), target.kv.clone()]
    target.commit(torch.tensor([0, 1]) if int(tree.parents[1]) == 0 else torch.tensor([0]))
    for size in (1, 20):
        out += [*target.verify(_tree(gen, size, root=7)), target.kv.clone()]
    return out


def _transformers_path(monkeypatch, target):
    monkeypatch.setattr(target, "_stack_unsupported", "forced for the test")


def _assert_same_bits(ours, theirs):
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), i


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_same_bits_as_transformers_forward(monkeypatch, one_thread, kind, dtype, exact):
    if exact and not ops.exact_kernels_available(torch.device("cpu")):
        pytest.skip("the batch-invariant kernels are not built")
    model = _model(kind, dtype)
    target = TargetModel(model, feature_layers=[0, 2], exact=exact)
    assert target._stack_unsupported is None
    calls = []
    for name in ("forward", "op_forward"):  # the loop, or its layers in one op call
        real = getattr(decoder_stack, name)
        monkeypatch.setattr(decoder_stack, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    ours = _session(target, seed=3)
    assert len(calls) == 4  # dartree's own forward ran every call
    _transformers_path(monkeypatch, target)
    theirs = _session(target, seed=3)
    assert len(calls) == 4
    _assert_same_bits(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_small_rows_gemv_path_same_bits(monkeypatch, one_thread, native, dtype):
    """Calls of <= 16 rows (the GEMV routing forced to 16 on any CPU) take exact_linear in both
    paths, larger ones the GEMM: the same bits either way."""
    model = _model("llama", dtype, seed=1)
    target = TargetModel(model, feature_layers=[1])
    target._gemv_rows = 16  # _session verifies 12 nodes, then 20: it crosses the threshold
    ours = _session(target, seed=5)
    _transformers_path(monkeypatch, target)
    _assert_same_bits(ours, _session(target, seed=5))


def test_foreign_architectures_and_layers_are_named():
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    assert "GPT2LMHeadModel is not one of" in decoder_stack.unsupported(gpt2)

    class Adapter(torch.nn.Linear):  # a LoRA / quantised layer: its forward is not F.linear
        pass

    model = _model("qwen3", torch.float32)
    old = model.model.layers[1].mlp.up_proj
    model.model.layers[1].mlp.up_proj = Adapter(old.in_features, old.out_features, bias=False)
    assert decoder_stack.unsupported(model) == "layer 1 mlp.up_proj is a Adapter, not nn.Linear"

    model = _model("llama", torch.float32)
    model.config.num_hidden_layers = 2
    assert "num_hidden_layers 2 != 3" in decoder_stack.unsupported(model)


def test_hooks_and_replaced_forwards_take_transformers_forward(monkeypatch, one_thread):
    model = _model("llama", torch.float32)
    target = TargetModel(model, feature_layers=[1])
    seen = []
    handle = model.model.layers[2].mlp.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    try:
        target.allocate(16)
        target.prefill(torch.arange(5))
    finally:
        handle.remove()
    assert seen == [(1, 5, 48)]  # the user's hook ran

    with torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: seen.append(type(m))):
        target.allocate(16)
        target.prefill(torch.arange(5))
    assert len(seen) > 1  # a global hook too

    norm = model.model.layers[0].input_layernorm
    monkeypatch.setattr(norm, "forward", lambda x: torch.zeros_like(x))  # as accelerate wraps it
    assert target._hooked()
    target.allocate(16)
    logits, features = target.prefill(torch.arange(5))
    monkeypatch.undo()
    _transformers_path(monkeypatch, target)
    target.allocate(16)
    expected, _ = target.prefill(torch.arange(5))
    assert not torch.equal(logits, expected)  # the replaced forward ran (and changed the result)

