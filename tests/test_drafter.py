"""Tests for dartree.drafter: config parsing, checkpoint I/O, the KV-injection forward, the
static context cache and the Domino head."""

import functools
import json
import math
import types

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dartree.drafter import (
    DominoHead,
    Drafter,
    DrafterConfig,
    default_target_layer_ids,
    load_drafter,
    save_drafter,
)
from dartree.testing import random_drafter

HIDDEN, VOCAB, LAYERS = 64, 256, 4


@functools.lru_cache(maxsize=None)
def make_target(kind="qwen3", dtype=torch.float32, hidden=HIDDEN, vocab=VOCAB):
    """A tiny random transformers causal LM (cached: tests must not modify it)."""
    common = dict(hidden_size=hidden, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=vocab)
    if kind == "qwen3":
        config = Qwen3Config(rope_theta=5000.0, **common)
    else:
        config = LlamaConfig(rope_theta=2000.0, **common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


@torch.no_grad()
def perturb(drafter: Drafter, seed: int = 1) -> Drafter:
    """Give every weight O(1)-effect random values (norms around 1), then rebuild the table."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in drafter.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * noise)
        elif p.dim() == 2:
            p.copy_(noise / math.sqrt(p.shape[1]))
        else:
            p.copy_(0.1 * noise)
    drafter.refresh_input_table()
    return drafter


def features_for(drafter: Drafter, n: int, seed: int = 2) -> torch.Tensor:
    width = len(drafter.target_layer_ids) * drafter.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=gen, dtype=torch.float64).to(drafter.dtype)


def tiny_domino(target, **cfg):
    cfg = {"num_layers": 2, "block_size": 8, "emb_dim": 24, "gru_hidden_dim": 40,
           "target_layer_ids": [0, 2], **cfg}
    return perturb(random_drafter(target, **cfg))


# ------------------------------------------------------------------------------------------
# A literal re-implementation of one DFlash block (all context at once), for comparison.
# ------------------------------------------------------------------------------------------


def literal_block(drafter: Drafter, features: torch.Tensor, bonus: int, s: int) -> torch.Tensor:
    cfg = drafter.config
    sd = {k: v.double() for k, v in drafter.checkpoint_state_dict().items()}
    emb = drafter._target_io[0].weight.double()
    B, D, hq, hkv = cfg.block_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    def rms(x, w):
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)

    def rope(t, positions):  # t [n, heads, D]
        ang = positions.double()[:, None] * inv_freq[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        rotated = torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1)
        return t * cos + rotated * sin

    c = rms(features.double() @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    x = emb[torch.tensor([bonus] + [cfg.mask_token_id] * (B - 1))]
    block_pos, ctx_pos = torch.arange(s, s + B), torch.arange(0, s)
    for i in range(cfg.num_layers):
        w = {k[len(f"layers.{i}."):]: v for k, v in sd.items() if k.startswith(f"layers.{i}.")}
        xn = rms(x, w["input_layernorm.weight"])
        q = rms((xn @ w["self_attn.q_proj.weight"].T).view(B, hq, D), w["self_attn.q_norm.weight"])
        both = torch.cat([c, xn])  # keys/values over [context ; block], same projections
        k = rms((both @ w["self_attn.k_proj.weight"].T).view(s + B, hkv, D),
                w["self_attn.k_norm.weight"])
        v = (both @ w["self_attn.v_proj.weight"].T).view(s + B, hkv, D)
        q, k = rope(q, block_pos), rope(k, torch.cat([ctx_pos, block_pos]))
        out = torch.empty(B, hq, D, dtype=torch.float64)
        for h in range(hq):
            kv_head = h // (hq // hkv)
            probs = torch.softmax(q[:, h] @ k[:, kv_head].T / math.sqrt(D), dim=-1)  # no mask
            out[:, h] = probs @ v[:, kv_head]
        x = x + out.reshape(B, -1) @ w["self_attn.o_proj.weight"].T
        xn = rms(x, w["post_attention_layernorm.weight"])
        gate, up = xn @ w["mlp.gate_proj.weight"].T, xn @ w["mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    h = rms(x, sd["norm.weight"])
    return h if cfg.shift_label else h[1:]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
@pytest.mark.parametrize("domino", [True, False])
def test_forward_matches_literal(kind, dtype, tol, domino):
    target = make_target(kind, dtype)
    drafter = tiny_domino(target) if domino else perturb(
        random_drafter(target, num_layers=2, block_size=8, domino=False))
    assert drafter.config.rope_theta == target.config.rope_parameters["rope_theta"]
    s = 11
    feats = features_for(drafter, s)
    drafter.reset(32)
    h = drafter.draft(feats, 7, s)
    assert h.shape == (drafter.num_slots, HIDDEN) and h.dtype == dtype
    assert drafter.ctx_len == s
    expected = literal_block(drafter, feats, 7, s)
    torch.testing.assert_close(h.double(), expected, rtol=tol, atol=tol)


def test_round_by_round_equals_full_context():
    drafter = tiny_domino(make_target("qwen3", torch.float64))
    feats = features_for(drafter, 30)
    rounds = [(6, 3), (13, 50), (13, 9), (21, 200)]  # (s, bonus); 13 twice: no new context
    drafter.reset(40)
    for s, bonus in rounds:
        h = drafter.draft(feats[drafter.ctx_len:s], bonus, s)
        assert drafter.ctx_len == s
        torch.testing.assert_close(h, literal_block(drafter, feats[:s], bonus, s),
                                   rtol=1e-10, atol=1e-10)
    drafter.reset(40)
    torch.testing.assert_close(drafter.draft(feats[:21], 200, 21), h, rtol=1e-12, atol=1e-12)


def test_shift_label_slots_and_prefix():
    target = make_target()
    domino = random_drafter(target, block_size=8)
    dflash = random_drafter(target, block_size=8, domino=False)
    assert (domino.num_slots, domino.shift_label, domino.prefix_len) == (8, True, 1)
    assert (dflash.num_slots, dflash.shift_label, dflash.prefix_len, dflash.head) == (
        7, False, 0, None)
    for d in (domino, dflash):
        d.reset(16)
        h = d.draft(features_for(d, 4), 5, 4)
        assert h.shape == (d.num_slots, HIDDEN)
        logits = d.base_logits(h)
        torch.testing.assert_close(logits, target.lm_head(h))
        assert logits.shape == (d.num_slots, VOCAB)


def test_bonus_as_tensor_equals_int():
    drafter = tiny_domino(make_target("qwen3", torch.float64))
    feats = features_for(drafter, 5)
    drafter.reset(16)
    a = drafter.draft(feats, 42, 5)
    drafter.reset(16)
    b = drafter.draft(feats, torch.tensor(42), 5)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_draft_argument_errors():
    drafter = tiny_domino(make_target())
    feats = features_for(drafter, 6)
    with pytest.raises(RuntimeError, match="reset"):
        drafter.draft(feats, 1, 6)
    drafter.reset(13)
    with pytest.raises(ValueError, match=r"features must be \[5, 128\]"):
        drafter.draft(feats[:4], 1, 5)
    with pytest.raises(ValueError, match="exceeds the drafter cache"):
        drafter.draft(feats, 1, 6)
    with pytest.raises(ValueError, match="bonus must be a token id"):
        drafter.draft(feats[:4], VOCAB, 4)
    with pytest.raises(ValueError, match="bonus must be"):
        drafter.draft(feats[:4], torch.tensor([1, 2]), 4)
    drafter.draft(feats[:4], 1, 4)
    with pytest.raises(ValueError, match="s must be >= ctx_len"):
        drafter.draft(feats[:0], 1, 3)
    with pytest.raises(ValueError, match="max_len must be an int >= block_size"):
        drafter.reset(4)


def test_forward_argument_errors():
    drafter = tiny_domino(make_target())
    feats = features_for(drafter, 12)[None]
    anchors = torch.tensor([[2, 5]])
    for bad in [(feats[0], anchors, anchors), (feats[..., :64], anchors, anchors),
                (feats, anchors[:, :1], anchors), (feats.expand(2, -1, -1), anchors, anchors)]:
        with pytest.raises(ValueError, match=r"forward needs features \[N, L, 128\]"):
            drafter(*bad)
    assert drafter(feats, anchors, anchors).shape == (1, 2, drafter.num_slots, HIDDEN)


# ------------------------------------------------------------------------------------------
# Domino head
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_gru_step_equals_grucell(bias):
    target = make_target("qwen3", torch.float64)
    drafter = perturb(Drafter(random_drafter(target, emb_dim=16, gru_hidden_dim=24).config,
                              target, gru_bias=bias).double())
    head = drafter.head
    cell = torch.nn.GRUCell(HIDDEN, 24, bias=bias).double()
    with torch.no_grad():
        cell.weight_ih.copy_(head.W_ih)
        cell.weight_hh.copy_(head.W_hh)
        if bias:
            cell.bias_ih.copy_(head.b_ih)
            cell.bias_hh.copy_(head.b_hh)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (9,), generator=gen)
    g = torch.randn(9, 24, generator=gen, dtype=torch.float64)
    emb = target.get_input_embeddings().weight
    with torch.no_grad():
        torch.testing.assert_close(head.gru_step(tokens, g), cell(emb[tokens], g))
        torch.testing.assert_close(head.root_state(5), cell(emb[5:6], torch.zeros(1, 24).double()))
        # the table is E·W_ihᵀ (+ b_ih), one gathered row per token
        table_rows = emb[tokens] @ head.W_ih.T + (head.b_ih if bias else 0)
        torch.testing.assert_close(head.input_table[tokens], table_rows)
    assert "head.input_table" not in drafter.state_dict()


@pytest.mark.parametrize("bias", [False, True])
def test_correction_equals_embed_proj(bias):
    target = make_target("qwen3", torch.float64)
    config = random_drafter(target, emb_dim=16, gru_hidden_dim=24).config
    drafter = perturb(Drafter(config, target, w1_bias=bias, w2_bias=bias).double())
    head = drafter.head
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(5, HIDDEN, generator=gen, dtype=torch.float64)
    g = torch.randn(5, 24, generator=gen, dtype=torch.float64)
    cand = torch.tensor([7, 0, 255, 31])
    with torch.no_grad():
        full = head.embed_proj(torch.cat([h, g], dim=-1))  # W_2 SiLU(W_1 [h; g] + b1) + b2
        z = head.project(h)
        torch.testing.assert_close(head.correction(z, g), full)
        torch.testing.assert_close(head.correction(z, g, cand), full[:, cand])
        one = head.correction(z[2], g, cand)  # one slot's z broadcast over several paths
        torch.testing.assert_close(one[2], full[2, cand])
    assert head.W_z.shape == (16, HIDDEN) and head.W_s.shape == (16, 24)
    assert head.W_2.shape == (VOCAB, 16)


def test_gru_step_needs_table():
    head = DominoHead(8, 10, 4, 6)
    with pytest.raises(RuntimeError, match="build_input_table"):
        head.gru_step(torch.tensor([1]), torch.zeros(1, 6))
    with pytest.raises(ValueError, match=r"embedding must be \[10, 8\]"):
        head.build_input_table(torch.zeros(10, 9))


# ------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------


def zlab_keys(num_layers, domino, biases=()):
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        p = f"layers.{i}."
        keys |= {p + f"self_attn.{n}.weight" for n in
                 ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        keys |= {p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
        keys |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    if domino:
        keys |= {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight",
                 "embed_proj.2.weight", *biases}
    return keys


@pytest.mark.parametrize("domino", [True, False])
def test_save_load_round_trip(tmp_path, domino):
    target = make_target("qwen3", torch.float64)
    if domino:
        config = tiny_domino(target).config
        drafter = perturb(Drafter(config, target, gru_bias=True, w2_bias=True).double())
        biases = ("prefix_gru.bias_ih_l0", "prefix_gru.bias_hh_l0", "embed_proj.2.bias")
    else:
        drafter = perturb(random_drafter(target, num_layers=2, block_size=8, domino=False))
        biases = ()
    save_drafter(drafter, tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert set(weights) == zlab_keys(2, domino, biases)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["architectures"] == ["DFlashDraftModel"]
    assert data["block_size"] == data["dflash_config"]["block_size"] == 8

    loaded = load_drafter(tmp_path, target)
    assert loaded.config == drafter.config and loaded.path == tmp_path
    assert (loaded.head is None) == (not domino)
    feats = features_for(drafter, 9)
    drafter.reset(24)
    loaded.reset(24)
    torch.testing.assert_close(loaded.draft(feats, 3, 9), drafter.draft(feats, 3, 9),
                               rtol=0, atol=0)
    if domino:
        torch.testing.assert_close(loaded.head.input_table, drafter.head.input_table)
        assert loaded.head.b_2 is not None and loaded.head.b_1 is None


def test_load_casts_to_target_dtype_and_accepts_target_wrapper(tmp_path):
    save_drafter(tiny_domino(make_target("qwen3", torch.float32)), tmp_path)
    target64 = make_target("qwen3", torch.float64)
    wrapper = types.SimpleNamespace(model=target64)  # like TargetModel: the HF model in .model
    drafter = load_drafter(str(tmp_path), wrapper)
    assert drafter.dtype == torch.float64
    assert all(p.dtype == torch.float64 for p in drafter.parameters())
    assert drafter.head.input_table.dtype == torch.float64
    drafter.reset(16)
    assert drafter.draft(features_for(drafter, 3), 1, 3).dtype == torch.float64


def _edit_config(folder, **changes):
    path = folder / "config.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if key.startswith("dflash_"):
            data["dflash_config"][key[len("dflash_"):]] = value
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _edit_weights(folder, edit):
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    edit(weights)
    save_file(weights, str(path))


@pytest.fixture
def saved(tmp_path):
    save_drafter(tiny_domino(make_target()), tmp_path)
    return tmp_path


def test_refuse_hidden_size(saved):
    with pytest.raises(ValueError, match="hidden_size 64 does not match .* hidden size 32"):
        load_drafter(saved, make_target(hidden=32))


def test_refuse_vocab(saved):
    with pytest.raises(ValueError, match=r"vocab_size 256 does not match .* \(300 embedding"):
        load_drafter(saved, make_target(vocab=300))


def test_refuse_layer_ids_out_of_range(saved):
    _edit_config(saved, dflash_target_layer_ids=[0, 4])
    with pytest.raises(ValueError, match=r"target_layer_ids \[4\] are out of range"):
        load_drafter(saved, make_target())


def test_refuse_missing_weight(saved):
    _edit_weights(saved, lambda w: w.pop("layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="missing weights: layers.1.mlp.up_proj.weight"):
        load_drafter(saved, make_target())


def test_refuse_unexpected_weight(saved):
    _edit_weights(saved, lambda w: w.update({"lm_head.weight": torch.zeros(VOCAB, HIDDEN)}))
    with pytest.raises(ValueError, match="unexpected weights: lm_head.weight"):
        load_drafter(saved, make_target())


def test_refuse_head_weights_on_dflash_config(saved):
    _edit_config(saved, dflash_projector_type=None)
    with pytest.raises(ValueError, match="'dflash'.*unexpected weights: embed_proj"):
        load_drafter(saved, make_target())


def test_refuse_misshapen_weight(saved):
    _edit_weights(saved, lambda w: w.update({"fc.weight": torch.zeros(HIDDEN, 3 * HIDDEN)}))
    with pytest.raises(ValueError, match=r"fc.weight has shape \[64, 192\], .* \[64, 128\]"):
        load_drafter(saved, make_target())


def test_refuse_architecture(saved):
    _edit_config(saved, architectures=["DFlash2DraftModel"])
    with pytest.raises(ValueError, match="unsupported drafter architecture"):
        load_drafter(saved, make_target())


def test_refuse_non_safetensors(saved):
    (saved / "model.safetensors").rename(saved / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no \*.safetensors .*pytorch_model.bin"):
        load_drafter(saved, make_target())


def test_refuse_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_drafter(tmp_path, make_target())


def test_refuse_non_model_target(saved):
    with pytest.raises(TypeError, match="transformers causal LM or a TargetModel"):
        load_drafter(saved, object())


# ------------------------------------------------------------------------------------------
# Config parsing
# ------------------------------------------------------------------------------------------


def zlab_qwen3_8b_dflash():
    """The shape of z-lab's Qwen3-8B-DFlash-b16 config.json (block_size at the top level)."""
    return {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 5,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 12288, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "rope_scaling": None, "max_position_embeddings": 40960,
        "vocab_size": 151936, "num_target_layers": 36, "block_size": 16,
        "layer_types": ["full_attention"] * 5, "sliding_window": None,
        "use_sliding_window": False,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    }


def test_parse_zlab_dflash():
    config = DrafterConfig.from_json(zlab_qwen3_8b_dflash())
    assert (config.projector_type, config.block_size, config.num_slots) == ("dflash", 16, 15)
    assert config.target_layer_ids == [1, 9, 17, 25, 33]
    assert (config.num_kv_heads, config.head_dim, config.rope_theta) == (8, 128, 1e6)
    assert (config.mask_token_id, config.shift_label, config.pure_draft_prefix_len) == (
        151669, False, 0)
    assert DrafterConfig.from_json(config.to_json()) == config


def test_parse_block_size_in_dflash_config():
    data = zlab_qwen3_8b_dflash()
    data["dflash_config"]["block_size"] = data.pop("block_size")
    assert DrafterConfig.from_json(data).block_size == 16
    del data["dflash_config"]["block_size"]
    with pytest.raises(ValueError, match="lacks 'block_size'"):
        DrafterConfig.from_json(data)


def test_parse_domino_specforge():
    data = zlab_qwen3_8b_dflash()
    data["emb_dim"] = 256
    data["dflash_config"].update(projector_type="domino", emb_dim=256, gru_hidden_dim=1024,
                                 pure_draft_prefix_len=1, shift_label=True)
    config = DrafterConfig.from_json(data)
    assert (config.projector_type, config.emb_dim, config.gru_hidden_dim) == ("domino", 256, 1024)
    assert (config.num_slots, config.pure_draft_prefix_len) == (16, 1)
    assert DrafterConfig.from_json(config.to_json()) == config


def test_parse_causal_v5_and_dim_fallbacks():
    data = zlab_qwen3_8b_dflash()
    data["emb_dim"] = 128  # top level only, no gru_hidden_dim anywhere
    data["dflash_config"]["projector_type"] = "causal_v5"
    config = DrafterConfig.from_json(data)
    assert (config.projector_type, config.emb_dim, config.gru_hidden_dim) == ("domino", 128, 128)
    data["gru_hidden_dim"] = 512
    assert DrafterConfig.from_json(data).gru_hidden_dim == 512
    del data["emb_dim"], data["gru_hidden_dim"]
    with pytest.raises(ValueError, match="emb_dim"):
        DrafterConfig.from_json(data)


def test_parse_default_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 1) == [14]
    data = zlab_qwen3_8b_dflash()
    del data["dflash_config"]["target_layer_ids"]
    assert DrafterConfig.from_json(data).target_layer_ids == [1, 9, 17, 25, 33]
    del data["num_target_layers"]
    with pytest.raises(ValueError, match="target_layer_ids"):
        DrafterConfig.from_json(data)


def test_parse_rope_parameters_and_scaling():
    data = zlab_qwen3_8b_dflash()
    del data["rope_theta"], data["rope_scaling"]
    data["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    config = DrafterConfig.from_json(data)
    assert (config.rope_theta, config.rope_scaling) == (500000.0, None)
    data["rope_parameters"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}
    config = DrafterConfig.from_json(data)
    assert config.rope_theta == 1e4
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert DrafterConfig.from_json(config.to_json()) == config
    data["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        DrafterConfig.from_json(data)


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 3.0}])
def test_rope_matches_transformers(rope_scaling):
    drafter = random_drafter(make_target(), rope_scaling=rope_scaling, rope_theta=777.0)
    drafter.reset(64)
    cos, sin = drafter._cos[5:50], drafter._sin[5:50]
    hf_params = {**(rope_scaling or {"rope_type": "default"}), "rope_theta": 777.0}
    hf = Qwen3RotaryEmbedding(Qwen3Config(hidden_size=HIDDEN, num_attention_heads=4, head_dim=16,
                                          rope_parameters=hf_params))
    hf_cos, hf_sin = hf(cos, torch.arange(5, 50)[None])
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=0)


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["DFlash2DraftModel"]}, "unsupported drafter architecture"),
    ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
    ({"layer_types": ["sliding_attention"] * 5}, "sliding-window"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"dflash_config": {"mask_token_id": 1, "projector_type": "eagle"}}, "projector_type"),
    ({"dflash_config": {"target_layer_ids": [1]}}, "lacks 'mask_token_id'"),
    ({"vocab_size": None}, "lacks 'vocab_size'"),
    ({"block_size": 1}, "block_size must be >= 2"),
    ({"num_key_value_heads": 5}, "multiple of num_kv_heads"),
])
def test_parse_refusals(change, message):
    data = {**zlab_qwen3_8b_dflash(), **change}
    with pytest.raises(ValueError, match=message):
        DrafterConfig.from_json(data)


# ------------------------------------------------------------------------------------------
# Devices
# ------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    cpu_target = make_target("qwen3", torch.float32)
    drafter = tiny_domino(cpu_target)
    feats = features_for(drafter, 10)
    drafter.reset(32)
    expected = drafter.draft(feats, 4, 10)
    gpu_target = AutoModelForCausalLM.from_config(cpu_target.config).cuda().eval()
    gpu_target.load_state_dict(cpu_target.state_dict())
    gpu = Drafter(drafter.config, gpu_target).cuda()
    gpu.load_state_dict(drafter.state_dict())
    gpu.refresh_input_table()
    gpu.reset(32)
    h = gpu.draft(feats.cuda(), torch.tensor(4, device="cuda"), 10)
    torch.testing.assert_close(h.cpu(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gpu.head.input_table.cpu(), drafter.head.input_table,
                               rtol=1e-4, atol=1e-4)


def test_bfloat16_runs_close_to_literal():
    target = make_target("qwen3", torch.bfloat16)
    drafter = tiny_domino(target)
    assert drafter.dtype == torch.bfloat16 and drafter.head.input_table.dtype == torch.bfloat16
    feats = features_for(drafter, 7)
    drafter.reset(16)
    h = drafter.draft(feats, 11, 7)
    expected = literal_block(drafter, feats, 11, 7)
    assert (h.double() - expected).abs().max() < 0.1 * expected.abs().max()
    g = drafter.head.gru_step(torch.tensor([3, 4]), drafter.head.root_state(11).expand(2, -1))
    assert g.dtype == torch.bfloat16 and torch.isfinite(g).all()
