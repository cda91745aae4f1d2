"""ops.decoder_stack: every decoder layer of a Llama-family model in one CPU call, with the bits of
dartree's Python layer loop (decoder_stack.forward, itself transformers' bits:
test_decoder_stack.py).

Oracle: the loop with the linear layers and attention the op runs (exact_linear or the packed
kernel; exact_tree_attention or tree_attention), compared with torch.equal: logits, kept layer
outputs and the whole KV cache (NaN-poisoned before), over a causal prefill and a random tree
after it. Shapes are awkward on purpose: widths that are not multiples of ATen's vector width
(RMSNorm's mean and SiLU have vector and scalar paths), head sizes under 16, a hidden size whose
mean carries through the summation cascade, Hq * D != H (Qwen3)."""

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from dartree import decoder_stack, linear_routing, ops
from dartree.target import TargetModel, _attend, _Pass
from dartree.testing import rerun_capped
from test_decoder_stack import CONFIGS, VOCAB, _assert_same_bits, _tree

pytestmark = pytest.mark.skipif(not ops.decoder_stack_available(torch.device("cpu")),
                                reason="the extension is not built")

ODD = dict(vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.2, eos_token_id=None,
           bos_token_id=None, pad_token_id=None)
SHAPES = {
    **CONFIGS,
    # hidden 100: 6 vectors and 4 scalars a row; head size 10 < 16: the scalar sum
    "qwen3-odd": lambda: Qwen3Config(**ODD, hidden_size=100, intermediate_size=72, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=10),
    # hidden 1040: 65 vectors, 16 rows of 4, one carry up the cascade
    "llama-wide": lambda: LlamaConfig(**ODD, hidden_size=1040, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=16),
    # the elementwise steps' SIMD lanes and their leftovers: half a head of 20 = 16 + 4 (AVX-512)
    # or 8 + 8 + 4 (AVX2), hidden 120 = 7 x 16 + 8, intermediate 88 = 5 x 16 + 8
    "llama-lanes": lambda: LlamaConfig(**ODD, hidden_size=120, intermediate_size=88, num_hidden_layers=2,
                                       num_attention_heads=3, num_key_value_heads=1, head_dim=40),
}


def _model(kind, dtype, seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(SHAPES[kind]()).to(dtype).eval()


def _cache(model, dtype, rows=48):
    cfg = model.config
    head_dim = model.model.layers[0].self_attn.head_dim
    kv = torch.empty(cfg.num_hidden_layers, 2, 1, cfg.num_key_value_heads, rows, head_dim, dtype=dtype)
    return kv.fill_(float("nan"))


def _call(model, path, kv, ids, positions, start, mask, exact, keep):
    """(logits, {layer: output}) of one call, by the op or by the loop."""
    linear = linear_routing.stack_linear(True, True, kv.dtype, kv.device)  # exact_linear's kernel
    with torch.no_grad():
        if path == "op":
            return decoder_stack.op_forward(model, ids, positions, kv, start, mask, exact, keep, linear)
        state = _Pass(kv=kv, start=start, tree_mask=mask, exact=exact)
        return decoder_stack.forward(model, ids, positions, linear, functools.partial(_attend, state), keep)


def _session(model, path, dtype, exact, seed):
    """A causal prefill of 9 tokens, then a random 12-node tree: outputs and the cache after each."""
    gen = torch.Generator().manual_seed(seed)
    kv = _cache(model, dtype)
    last = model.config.num_hidden_layers - 1
    keep = {0, last}
    ids = torch.randint(0, VOCAB, (9,), generator=gen)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None]
    out = []
    logits, kept = _call(model, path, kv, ids, torch.arange(9), 0, causal, True, keep)
    out += [logits, *[kept[l] for l in sorted(keep)], kv.clone()]
    tree = _tree(gen, 12, root=5)
    logits, kept = _call(model, path, kv, tree.tokens, 9 + tree.depths, 9, tree.ancestor_mask()[None], exact, keep)
    out += [logits, *[kept[l] for l in sorted(keep)], kv.clone()]
    return out


@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "default"])
def test_same_bits_as_the_layer_loop(one_thread, kind, dtype, exact):
    model = _model(kind, dtype)
    assert decoder_stack.op_unsupported(model) is None
    _assert_same_bits(_session(model, "op", dtype, exact, seed=1), _session(model, "loop", dtype, exact, seed=1))


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_same_bits_on_every_lane_width(isa):
    """The elementwise steps' narrower paths (AVX2's 8 lanes, the scalar loops), which this CPU
    would not pick: the test above in a process whose kernels are capped at `isa`."""
    rerun_capped(__file__, "test_same_bits_as_the_layer_loop", isa)


@pytest.mark.parametrize("threads", [1, 2])
def test_same_bits_on_threads_and_a_long_prefill(threads):
    """A 300-token prefill: the linear kernels and ATen's mean split work across threads."""
    model = _model("llama-wide", torch.float32, seed=2)
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(0))
    causal = torch.ones(300, 300, dtype=torch.bool).tril()[None]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = []
        for path in ("op", "loop"):
            kv = _cache(model, torch.float32, rows=300)
            logits, _ = _call(model, path, kv, ids, torch.arange(300), 0, causal, True, set())
            runs.append([logits, kv])
    finally:
        torch.set_num_threads(previous)
    _assert_same_bits(*runs)


def test_packed_models_same_bits(tmp_path, one_thread):
    """GGUF files (Q4_K_M's mix of block types, and a uniform one whose q/k/v and gate/up run as
    one packed call each), float32 and bfloat16 activations."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from dartree.gguf import load_gguf
    from dartree.testing import write_gguf

    for arch, uniform in (("qwen3", False), ("qwen2", True), ("llama", True)):
        path = tmp_path / f"{arch}-{uniform}.gguf"
        write_gguf(path, arch, seed=3, uniform=uniform)
        for dtype in (torch.float32, torch.bfloat16):
            model = load_gguf(path, dtype=dtype)
            assert decoder_stack.op_unsupported(model) is None
            ours, theirs = (_session(model, path_, dtype, True, seed=4) for path_ in ("op", "loop"))
            _assert_same_bits(ours, theirs)


def test_target_takes_the_op_where_it_gives_the_loops_bits(monkeypatch, one_thread):
    """exact: every call; default: verify calls of few rows (exact_linear's GEMV routing), never a
    prefill (the loop takes SDPA there) nor a call whose linear layers take the vendor GEMM."""
    calls = []
    real = decoder_stack.op_forward
    monkeypatch.setattr(decoder_stack, "op_forward", lambda *a, **k: calls.append(a[1].numel()) or real(*a, **k))
    model = _model("llama", torch.float32)
    target = TargetModel(model, feature_layers=[1], exact=True)
    target.allocate(64)
    target.prefill(torch.arange(7))
    target.verify(_tree(torch.Generator().manual_seed(0), 5, root=3))
    assert calls == [7, 5]
    calls.clear()
    target = TargetModel(model, feature_layers=[1], exact=False)
    target._gemv_rows = 4
    target.allocate(64)
    target.prefill(torch.arange(3))
    target.verify(_tree(torch.Generator().manual_seed(0), 3, root=3))
    target.verify(_tree(torch.Generator().manual_seed(0), 9, root=3))
    assert calls == [3]


def test_target_reads_the_weights_once_per_allocate(one_thread):
    """The op's weight list is kept from allocate() to the next: a replaced module is seen after
    the next allocate, with the bits of a target built on the changed model."""
    model = _model("llama", torch.float32)
    target = TargetModel(model, feature_layers=[1], exact=True)
    ids = torch.arange(6)
    target.allocate(64)
    before, _ = target.prefill(ids)
    torch.manual_seed(1)
    old = model.model.layers[0].mlp.down_proj
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    target.allocate(64)
    after, _ = target.prefill(ids)
    fresh = TargetModel(model, feature_layers=[1], exact=True)
    fresh.allocate(64)
    expected, _ = fresh.prefill(ids)
    assert not torch.equal(before, after)
    assert torch.equal(after, expected)


def test_layers_the_op_does_not_run_are_named():
    model = _model("llama", torch.float64)
    assert "torch.float64" in decoder_stack.op_unsupported(model)
    torch.manual_seed(0)
    gelu = AutoModelForCausalLM.from_config(LlamaConfig(**{**ODD, "hidden_act": "gelu"}, hidden_size=32,
                                                        intermediate_size=48, num_hidden_layers=1,
                                                        num_attention_heads=2, num_key_value_heads=1))
    assert "not SiLU" in decoder_stack.op_unsupported(gelu)
    target = TargetModel(gelu, feature_layers=[0], exact=True)
    assert not target._one_call  # the loop runs it
    model = _model("llama", torch.float32)
    model.model.layers[1].post_attention_layernorm.variance_epsilon = 1e-3
    assert "eps" in decoder_stack.op_unsupported(model)


def _arguments(model, tokens=3):
    x = model.model.embed_tokens(torch.arange(tokens)).detach()
    kv = _cache(model, torch.float32)
    weights, qtypes, biases, norms = decoder_stack.stack_arguments(model)
    attn = model.model.layers[0].self_attn
    cos, sin = model.model.rotary_emb(x[None], torch.arange(tokens)[None])
    heads = [model.config.num_attention_heads, model.config.num_key_value_heads, attn.head_dim, 0]
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None]
    return dict(x=x, kv=kv, start=0, tree_mask=mask, cos=cos[0], sin_signed=sin[0], weights=weights,
                qtypes=qtypes, biases=biases, norms=norms, heads=heads, eps=1e-6, scaling=attn.scaling,
                exact=True, keep=[0])


@pytest.mark.parametrize("change,message", [
    (dict(heads=[6, 3, 8, 0]), "kv must be a contiguous"),
    (dict(heads=[6, 2, 8]), "heads must be"),
    (dict(start=47), "do not fit the cache"),
    (dict(tree_mask=torch.ones(1, 3, 2, dtype=torch.bool)), "tree_mask must be bool"),
    (dict(cos=torch.zeros(3, 7)), "cos and sin_signed must be"),
    (dict(keep=[3]), "keep holds layer 3"),
    (dict(x=torch.zeros(3, 48, dtype=torch.float64)), "float32, bfloat16 or float16"),
])
def test_bad_arguments_are_refused_by_name(change, message):
    model = _model("llama", torch.float32)
    args = {**_arguments(model), **change}
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        ops.decoder_stack(**args)


def test_bad_weights_are_refused_by_name():
    model = _model("llama", torch.float32)
    args = _arguments(model)
    with torch.no_grad():
        with pytest.raises(ValueError, match="7 entries per layer"):
            ops.decoder_stack(**{**args, "weights": args["weights"][:-1]})
        wrong = list(args["weights"])
        wrong[1] = wrong[0]  # k_proj given q_proj's 48 rows
        with pytest.raises(ValueError, match="layer 0 projection 1 must have 16 output rows"):
            ops.decoder_stack(**{**args, "weights": wrong})
        with pytest.raises(ValueError, match="norm 1 must be"):
            ops.decoder_stack(**{**args, "norms": [args["norms"][0], args["norms"][0][:5]] + args["norms"][2:]})


def test_opcheck():
    model = _model("qwen3", torch.float32)
    args = _arguments(model)
    args["heads"][3] = 1  # q_norm / k_norm: _arguments gave 4 norms a layer
    with torch.no_grad():
        torch.library.opcheck(torch.ops.dartree.decoder_stack.default, tuple(args.values()),
                              test_utils=("test_schema", "test_faketensor"))
