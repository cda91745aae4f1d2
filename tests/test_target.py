"""TargetModel against transformers' own forward and generate, and the reference ops it uses.

Oracles: HF forward of the full sequence (each tree node = prefix + its root path) with the model's
default attention; `model.generate(do_sample=False)` for the greedy loop; literal loops for the
reference tree_attention and kv_commit.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3Config

from dartree import reference
from dartree.target import TargetModel
from dartree.tree import DraftTree

VOCAB = 256
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float64: dict(rtol=1e-10, atol=1e-10)}
FEATURE_LAYERS = [0, 2, 3]  # hidden_states[1], [3] and [4]: the last layer's is after the final norm


def _config(kind, **extra):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    classes = {"qwen3": Qwen3Config, "llama": LlamaConfig, "mistral": MistralConfig}
    return classes[kind](**{**common, **extra})


@functools.cache
def _model(kind, dtype):
    torch.manual_seed({"qwen3": 1, "llama": 2}[kind])
    return AutoModelForCausalLM.from_config(_config(kind), dtype=dtype).eval()


MODELS = [("qwen3", torch.float32), ("qwen3", torch.float64), ("llama", torch.float32), ("llama", torch.float64)]


@pytest.fixture(params=MODELS, ids=lambda p: f"{p[0]}-{str(p[1])[6:]}")
def model(request):
    return _model(*request.param)


class _Tree:
    """Minimal DraftTree stand-in: tokens/parents/depths [T] int64, literal ancestor mask."""

    def __init__(self, tokens, parents):
        self.tokens = torch.tensor(tokens)
        self.parents = torch.tensor(parents)
        depths = []
        for p in parents:
            depths.append(0 if p < 0 else depths[p] + 1)
        self.depths = torch.tensor(depths)

    def path(self, i):
        """Tree indices from the root to node i."""
        nodes = []
        while i >= 0:
            nodes.append(i)
            i = int(self.parents[i])
        return nodes[::-1]

    def ancestor_mask(self):
        size = len(self.tokens)
        mask = torch.zeros(size, size, dtype=torch.bool)
        for i in range(size):
            mask[i, self.path(i)] = True
        return mask


def _random_tree(gen, size, root):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size)]
    tokens = [root] + torch.randint(0, VOCAB, (size - 1,), generator=gen).tolist()
    return _Tree(tokens, parents)


def _hf(model, ids):
    """HF forward of one sequence: (logits [n, V], hidden_states tuple of [n, H])."""
    with torch.no_grad():
        out = model(torch.tensor(ids)[None], output_hidden_states=True)
    return out.logits[0], [h[0] for h in out.hidden_states]


def _check_tree(model, target, prefix, tree, logits, features):
    """Every node's logits and features == HF forward on prefix + the node's root path."""
    tol = TOL[model.dtype]
    hidden = model.config.hidden_size
    for i in range(len(tree.tokens)):
        ref_logits, ref_hidden = _hf(model, prefix + tree.tokens[tree.path(i)].tolist())
        torch.testing.assert_close(logits[i], ref_logits[-1], **tol)
        for j, layer in enumerate(target.feature_layers):
            torch.testing.assert_close(features[i, j * hidden:(j + 1) * hidden], ref_hidden[layer + 1][-1], **tol)


def test_prefill_matches_hf(model):
    target = TargetModel(model, FEATURE_LAYERS)
    target.allocate(32)
    ids = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(0))
    logits, features = target.prefill(ids)
    ref_logits, ref_hidden = _hf(model, ids.tolist())
    assert logits.shape == (11, VOCAB) and features.shape == (11, len(FEATURE_LAYERS) * 64)
    torch.testing.assert_close(logits, ref_logits, **TOL[model.dtype])
    torch.testing.assert_close(features, torch.cat([ref_hidden[l + 1] for l in FEATURE_LAYERS], -1),
                               **TOL[model.dtype])
    assert target.seq_len == 11
    assert torch.equal(target.kv[:, :, :, :, 11:], torch.zeros_like(target.kv[:, :, :, :, 11:]))


def test_verify_commit_verify_matches_hf(model):
    gen = torch.Generator().manual_seed(1)
    target = TargetModel(model, FEATURE_LAYERS)
    target.allocate(48)
    kv = target.kv
    prefix = torch.randint(0, VOCAB, (9,), generator=gen).tolist()
    target.prefill(torch.tensor(prefix))

    tree = _random_tree(gen, 12, root=7)
    logits, features = target.verify(tree)
    assert target.seq_len == 9
    _check_tree(model, target, prefix, tree, logits, features)

    deepest = int(tree.depths.argmax())
    accepted = tree.path(deepest)
    target.commit(torch.tensor(accepted))
    prefix += tree.tokens[accepted].tolist()
    assert target.seq_len == len(prefix)

    tree = _random_tree(gen, 10, root=3)
    logits, features = target.verify(tree)
    _check_tree(model, target, prefix, tree, logits, features)
    assert target.kv is kv  # one static cache, never reallocated


def test_greedy_loop_matches_generate(model):
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    attn = model.config._attn_implementation
    hooks = [dict(layer._forward_hooks) for layer in model.model.layers]
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, 6:].tolist()

    target = TargetModel(model, [1])
    target.allocate(prompt.shape[1] + 12)
    logits, _ = target.prefill(prompt[0])
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < 12:
        logits, _ = target.verify(DraftTree.chain(torch.tensor([tokens[-1]])))
        target.commit(torch.zeros(1, dtype=torch.long))
        tokens.append(int(logits[0].argmax()))
    assert tokens == expected
    # the user's model is left as it was: same attention implementation, no hooks, generate works
    assert model.config._attn_implementation == attn
    assert [dict(layer._forward_hooks) for layer in model.model.layers] == hooks
    assert model.generate(prompt, max_new_tokens=12, do_sample=False)[0, 6:].tolist() == expected


def test_allocate_reuses_and_resets():
    target = TargetModel(_model("qwen3", torch.float32), [1])
    target.allocate(16)
    kv = target.kv
    assert kv.shape == (4, 2, 1, 2, 16, 16) and kv.dtype == torch.float32
    target.prefill(torch.arange(5))
    target.allocate(16)
    assert target.kv is kv and target.seq_len == 0
    target.allocate(20)
    assert target.kv.shape[4] == 20 and target.max_len == 20


def test_refusals():
    model = _model("qwen3", torch.float32)
    target = TargetModel(model, [0])
    with pytest.raises(RuntimeError, match="allocate"):
        target.prefill(torch.arange(3))
    target.allocate(8)
    with pytest.raises(ValueError, match=r"context of 9 tokens exceeds the cache \(max_len 8\)"):
        target.prefill(torch.arange(9))
    with pytest.raises(ValueError, match=r"token ids in \[0, 256\)"):
        target.prefill(torch.tensor([1, 256]))
    with pytest.raises(ValueError, match="int64"):
        target.prefill(torch.arange(3, dtype=torch.int32))
    target.prefill(torch.arange(5))
    with pytest.raises(RuntimeError, match="empty cache"):
        target.prefill(torch.arange(2))
    with pytest.raises(RuntimeError, match="verify"):
        target.commit(torch.tensor([0]))
    with pytest.raises(ValueError, match=r"context of 9 tokens exceeds the cache \(max_len 8\)"):
        target.verify(_Tree([1, 2, 3, 4], [-1, 0, 1, 2]))
    target.verify(_Tree([1, 2, 3], [-1, 0, 0]))
    for bad in ([1, 2], [0, 2, 1], [0, 3], [0, 1, 2, 3]):
        with pytest.raises(ValueError, match="accepted"):
            target.commit(torch.tensor(bad))
    with pytest.raises(ValueError, match="feature_layers"):
        TargetModel(model, [4])


def test_refuses_unsupported_models(monkeypatch):
    with pytest.raises(ValueError, match="sliding"):
        TargetModel(AutoModelForCausalLM.from_config(_config("mistral", sliding_window=16)), [0])
    qwen_window = _config("qwen3", use_sliding_window=True, sliding_window=16, max_window_layers=2)
    with pytest.raises(ValueError, match="sliding_attention"):
        TargetModel(AutoModelForCausalLM.from_config(qwen_window), [0])
    TargetModel(AutoModelForCausalLM.from_config(_config("mistral", sliding_window=None)), [0])

    model = AutoModelForCausalLM.from_config(_config("llama"))
    monkeypatch.setattr(model, "_supports_attention_backend", False)
    with pytest.raises(ValueError, match="AttentionInterface"):
        TargetModel(model, [0])
    monkeypatch.undo()

    target = TargetModel(model, [0])
    target.allocate(8)
    attn = model.model.layers[1].self_attn
    monkeypatch.setattr(attn, "forward", lambda hidden_states, **kw: (torch.zeros_like(hidden_states), None))
    with pytest.raises(RuntimeError, match="3 of 4 layers"):
        target.prefill(torch.arange(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hq,hkv,size,prefix", [(4, 2, 5, 7), (3, 3, 1, 0), (8, 1, 9, 3)])
def test_reference_tree_attention(dtype, hq, hkv, size, prefix):
    gen = torch.Generator().manual_seed(size * 10 + prefix)
    seq, dim = prefix + size + 3, 8
    q = torch.randn(1, hq, size, dim, generator=gen, dtype=dtype)
    k = torch.randn(1, hkv, seq, dim, generator=gen, dtype=dtype)
    v = torch.randn(1, hkv, seq, dim, generator=gen, dtype=dtype)
    k[:, :, prefix + size:] = float("nan")  # rows past the tree are never read
    v[:, :, prefix + size:] = float("nan")
    tree = _random_tree(gen, size, root=0)
    mask = tree.ancestor_mask()
    out = reference.tree_attention(q, k, v, mask[None], prefix, scale=0.3)
    expected = torch.empty_like(q)
    for h in range(hq):
        g = h // (hq // hkv)
        for i in range(size):
            keys = list(range(prefix)) + [prefix + j for j in range(size) if mask[i, j]]
            weights = torch.softmax(k[0, g, keys] @ q[0, h, i] * 0.3, dim=0)
            expected[0, h, i] = weights @ v[0, g, keys]
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_reference_kv_commit():
    kv = torch.randn(3, 2, 1, 2, 12, 4)
    expected = kv.clone()
    accepted = [0, 2, 3, 6]
    for j, a in enumerate(accepted):
        expected[..., 4 + j, :] = kv[..., 4 + a, :]
    assert reference.kv_commit(kv, 4, torch.tensor(accepted)) is None
    assert torch.equal(kv, expected)


class _CountExactLinear(TorchDispatchMode):
    """Counts ops.exact_linear kernel calls inside the context."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.dartree.exact_linear.default
        return func(*args, **(kwargs or {}))


def test_gemv_rows_by_dtype_and_vendor(monkeypatch, native):
    """The routing follows GEMV_ROWS: bfloat16 on every AVX-512 CPU, float32 on AMD's only (its
    MKL kernels are the slow ones), float64 never, and nothing without AVX-512."""
    from dartree import hardware, linear_routing

    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    for vendor, bf16, f32 in (("GenuineIntel", 16, 0), ("AuthenticAMD", 16, 32), ("", 16, 0)):
        monkeypatch.setattr(hardware, "vendor", lambda: vendor)
        assert [linear_routing.gemv_rows(d, cpu) for d in (torch.bfloat16, torch.float32, torch.float64)] \
            == [bf16, f32, 0], vendor
        assert TargetModel(_tiny_llama(torch.float32), feature_layers=[0])._gemv_rows == f32
        assert TargetModel(_tiny_llama(torch.float32), feature_layers=[0], exact=True)._gemv_rows == 0
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert linear_routing.gemv_rows(torch.bfloat16, cpu) == 0
    assert linear_routing.gemv_rows(torch.float32, torch.device("meta")) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_gemv_linears_takes_small_calls_only(native, dtype):
    """The drafter's context: calls of <= max_rows rows on the kernel where `gemv_rows` routes the
    dtype, within rounding of F.linear; larger calls and unrouted dtypes untouched."""
    from dartree.linear_routing import gemv_linears, gemv_rows

    routed = gemv_rows(dtype, torch.device("cpu")) > 0
    w = torch.randn(40, 24)
    for rows, expected in [(4, int(routed)), (5, 0)]:
        x = torch.randn(rows, 24)
        with _CountExactLinear() as count, gemv_linears(dtype, torch.device("cpu"), max_rows=4):
            out = F.linear(x.to(dtype)[None], w.to(dtype))
        assert count.calls == expected and out.shape == (1, rows, 40) and out.dtype == dtype
        torch.testing.assert_close(out[0].float(), F.linear(x, w), atol=0.2, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_small_calls_take_the_gemv_path(native, dtype):
    """A call of <= _gemv_rows rows (forced to 16 here, on any CPU) runs every linear layer
    (lm_head included) on ops.exact_linear's kernel, a larger one on the vendor GEMM, through
    dartree's decoder loop and through transformers' forward alike; both give the same tokens a
    plain HF forward gives to within rounding."""
    model = _tiny_llama(dtype)
    tm = TargetModel(model, feature_layers=[0])
    tm._gemv_rows = 16
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    for stack in (None, "transformers' forward"):
        tm._stack_unsupported = stack
        for rows in (1, 16, 17):
            tm.allocate(128)
            ids = torch.randint(0, 97, (rows,))
            with _CountExactLinear() as count:
                logits, _ = tm.prefill(ids)
            assert count.calls == (linears if rows <= 16 else 0), (stack, rows)
            with torch.no_grad():
                hf = model(ids[None]).logits[0]
            torch.testing.assert_close(logits.float(), hf.float(), atol=0.1, rtol=0.05)


def _tiny_llama(dtype):
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
