"""dartree.load_gguf: a GGUF file as a transformers model with packed weights. Small files of
other architectures are written here with the gguf package (Q4_K_M's mix of block types)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from dartree import gguf_blocks

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from dartree.gguf import PackedEmbedding, PackedLinear, load_gguf  # noqa: E402
from dartree.testing import random_packed  # noqa: E402

# llama.cpp's Q4_K_M: Q4_K, with Q6_K for attn_v, ffn_down and the output; widths that are not a
# multiple of 256 fall back to a 32-value type (here ffn_down, K = 96: Q5_0, and Q8_0 for the
# Qwen2 file)
SHAPE = dict(hidden=256, ffn=96, heads=4, kv_heads=2, vocab=320, layers=2)


def _head_dim(arch: str) -> int:
    # transformers reads no head size from a Qwen3 file: its config default, 128, applies
    return 128 if arch == "qwen3" else SHAPE["hidden"] // SHAPE["heads"]


def _types(arch: str) -> dict[str, str]:
    return {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
            "ffn_gate": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q8_0" if arch == "qwen2" else "Q5_0",
            "token_embd": "Q4_K", "output": "Q6_K"}


def write_gguf(path, arch: str, seed: int = 0, tied: bool = False, uniform: bool = False) -> None:
    """uniform: every projection Q4_K (q/k/v and gate/up then share one packed call)."""
    s = SHAPE
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(s["vocab"])
    D = _head_dim(arch)
    w.add_key_length(D)
    w.add_value_length(D)
    if arch == "llama":
        w.add_rope_dimension_count(D)
    types = _types(arch)
    if uniform:
        types.update(attn_v="Q4_K", ffn_up="Q4_K")
    rng = np.random.default_rng(seed)
    counter = [seed]

    def quant(name, kind, N, K):
        counter[0] += 1
        rows = random_packed(types[kind], N, K, seed=counter[0]).numpy()
        w.add_tensor(name, rows, raw_dtype=gguf.GGMLQuantizationType[types[kind]])

    def f32(name, *shape, center=0.0):
        w.add_tensor(name, (center + 0.1 * rng.standard_normal(shape)).astype(np.float32))

    H, F = s["hidden"], s["ffn"]
    quant("token_embd.weight", "token_embd", s["vocab"], H)
    for i in range(s["layers"]):
        b = f"blk.{i}."
        quant(b + "attn_q.weight", "attn_q", s["heads"] * D, H)
        quant(b + "attn_k.weight", "attn_k", s["kv_heads"] * D, H)
        quant(b + "attn_v.weight", "attn_v", s["kv_heads"] * D, H)
        quant(b + "attn_output.weight", "attn_output", H, s["heads"] * D)
        quant(b + "ffn_gate.weight", "ffn_gate", F, H)
        quant(b + "ffn_up.weight", "ffn_up", F, H)
        quant(b + "ffn_down.weight", "ffn_down", H, F)
        f32(b + "attn_norm.weight", H, center=1.0)
        f32(b + "ffn_norm.weight", H, center=1.0)
        if arch == "qwen3":
            f32(b + "attn_q_norm.weight", D, center=1.0)
            f32(b + "attn_k_norm.weight", D, center=1.0)
        if arch == "qwen2":
            f32(b + "attn_q.bias", s["heads"] * D)
            f32(b + "attn_k.bias", s["kv_heads"] * D)
            f32(b + "attn_v.bias", s["kv_heads"] * D)
    f32("output_norm.weight", H, center=1.0)
    if not tied:
        quant("output.weight", "output", s["vocab"], H)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.mark.parametrize("arch,tied", [("qwen3", False), ("llama", True), ("qwen2", False)])
def test_packed_model_holds_the_dequantised_weights_of_transformers_loader(tmp_path, arch, tied):
    path = tmp_path / f"tiny-{arch}.Q4_K_M.gguf"
    write_gguf(path, arch, tied=tied)
    model, ref = load_gguf(path), _hf_model(path)
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert len(packed) == 7 * SHAPE["layers"] + 1  # every linear layer and the LM head
    for name, module in packed.items():
        assert torch.equal(module.dequantized(), ref.get_submodule(name).weight), name
        if module.bias is not None:
            assert torch.equal(module.bias, ref.get_submodule(name).bias), name
    assert isinstance(model.get_input_embeddings(), PackedEmbedding)
    ids = torch.arange(SHAPE["vocab"])
    assert torch.equal(model.get_input_embeddings()(ids), ref.get_input_embeddings()(ids))
    floats = {n: p for n, p in model.named_parameters()}
    for name, param in floats.items():
        assert torch.equal(param, ref.get_parameter(name)), name
    # no float copy of a packed weight is kept
    assert not any(p.dim() > 1 for p in floats.values())


def test_packed_model_generates_the_tokens_of_the_dequantised_model(tmp_path):
    import dartree

    path = tmp_path / "tiny-qwen3.gguf"
    write_gguf(path, "qwen3", seed=3)
    model, ref = load_gguf(path), _hf_model(path)
    ids = torch.tensor([[5, 17, 240, 3, 99]])
    with dartree.exact():
        ours = model.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
        theirs = ref.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
    assert ours.tolist() == theirs.tolist()


def test_unsupported_architecture_and_block_type_are_refused(tmp_path, monkeypatch):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_vocab_size(64)
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'phi3' model"):
        load_gguf(path)
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        load_gguf(tmp_path / "missing.gguf")


@pytest.mark.parametrize("arch,uniform", [("qwen3", False), ("llama", False), ("qwen2", True), ("llama", True)])
def test_every_method_with_exact_equals_exact_decoding_of_the_packed_model(tmp_path, arch, uniform):
    """The packed model through dartree's own layer loop and every method (exact=True): the
    tokens of `dartree.exact()` generate of the same packed model. uniform: q/k/v and gate/up
    of one block type, computed by one packed call each in the loop."""
    import dartree
    from dartree import decoder_stack
    from dartree.testing import random_drafter

    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, arch, seed=5, uniform=uniform)
    model = load_gguf(path)
    assert decoder_stack.unsupported(model) is None  # packed projections run in the layer loop
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        fused = [decoder_stack.adjacent([attn.q_proj.packed, attn.k_proj.packed, attn.v_proj.packed]),
                 decoder_stack.adjacent([mlp.gate_proj.packed, mlp.up_proj.packed])]
        assert all((f is not None) == uniform for f in fused)
        if uniform:
            assert torch.equal(fused[0], torch.cat([attn.q_proj.packed, attn.k_proj.packed, attn.v_proj.packed]))
            if attn.q_proj.bias is not None:  # Qwen2: the biases lie back to back too
                assert decoder_stack.adjacent([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]) is not None
    drafter = random_drafter(model, num_layers=1, block_size=8, seed=0)
    ids = torch.tensor([[7, 3, 250, 11, 42, 9]])
    with dartree.exact():
        ref = model.generate(ids, do_sample=False, max_new_tokens=20, pad_token_id=0)[0, 6:].tolist()
    for method in dartree.METHODS:
        dec = dartree.SpeculativeDecoder(model, drafter, method=method, exact=True,
                                         **({} if method in ("ar", "dflash", "domino") else {"budget": 6}))
        assert dec.generate(ids, max_new_tokens=20).tokens == ref, method


def test_memory_script_reports_the_resident_size_of_a_packed_load(tmp_path):
    import dartree
    import importlib.util

    assert dartree.load_gguf is load_gguf
    path = tmp_path / "tiny-llama.gguf"
    write_gguf(path, "llama")
    spec = importlib.util.spec_from_file_location(
        "gguf_memory", Path(__file__).resolve().parents[1] / "bench" / "gguf_memory.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "memory.md"
    assert script.main(["--gguf", str(path), "--out", str(out)]) == 0
    row = out.read_text().strip().splitlines()[-1].split("|")
    file_mb, tensor_mb = float(row[1]), float(row[2])
    assert file_mb == pytest.approx(path.stat().st_size / 1e6, abs=0.05)
    packed = load_gguf(path)
    assert tensor_mb == pytest.approx(sum(t.numel() * t.element_size() for t in
                                          [*packed.parameters(), *packed.buffers()]) / 1e6, abs=0.05)
    assert row[4].strip().endswith("×**")
