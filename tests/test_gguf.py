"""dartree.load_gguf: a GGUF file as a transformers model with packed weights, its named refusals,
its parameter count and dtype conversion. Small files are written here with the gguf package
(`dartree.testing.write_gguf`: Q4_K_M's mix of block types)."""

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from dartree.gguf import PackedEmbedding, PackedLinear, load_gguf  # noqa: E402
from dartree.testing import GGUF_SHAPE, write_gguf  # noqa: E402

SHAPE = GGUF_SHAPE


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


def test_a_block_type_without_a_kernel_is_refused_naming_the_tensor(tmp_path):
    """A Q2_K tensor (a type the packed kernels do not read) among the Q4_K_M ones: refused
    before anything is loaded, naming the tensor, its type and the types that are read."""
    path = tmp_path / "q2k.gguf"
    write_gguf(path, "llama")
    data = bytearray(path.read_bytes())
    reader = gguf.GGUFReader(path)
    field = next(t for t in reader.tensors if t.name == "blk.1.attn_output.weight").field
    type_offset = field.offset + sum(part.nbytes for part in field.parts[:4])  # name, dims: then type
    assert int.from_bytes(data[type_offset:type_offset + 4], "little") == gguf.GGMLQuantizationType.Q4_K
    # Q2_K: 256 values in 84 bytes, Q4_K in 144: the same tensor in fewer bytes (the file stays whole)
    data[type_offset:type_offset + 4] = int(gguf.GGMLQuantizationType.Q2_K).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"tensor blk\.1\.attn_output\.weight is stored as Q2_K; "
                                         r"load_gguf reads F32, F16, BF16 and the block types Q4_0"):
        load_gguf(path)


def test_a_truncated_or_foreign_file_is_refused_by_name(tmp_path):
    whole = tmp_path / "whole.gguf"
    write_gguf(whole, "qwen2")
    data = whole.read_bytes()
    tensors = gguf.GGUFReader(whole).tensors
    first_tensor = min(t.data_offset for t in tensors)
    cases = {3: "is not a GGUF file: it has 3 bytes",
             20: "is truncated: its GGUF header needs at least 24 bytes, the file has 20",
             first_tensor - 40: "is truncated: its GGUF header needs at least",  # in its tensor table
             first_tensor + 1000: "is truncated: tensor token_embd.weight ends at byte",
             len(data) - 1: f"is truncated: tensor output.weight ends at byte {len(data):,}, the "
                            f"file has {len(data) - 1:,} bytes"}
    for size, message in cases.items():
        cut = tmp_path / f"cut-{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError, match=message):
            load_gguf(cut)
    other = tmp_path / "model.safetensors.gguf"
    other.write_bytes(b"\x08\x00\x00\x00" + data[4:])
    with pytest.raises(ValueError, match=r"is not a GGUF file: it starts with b'\\x08"):
        load_gguf(other)


@pytest.mark.parametrize("tied", [False, True])
def test_num_parameters_counts_the_packed_weights_as_the_dequantised_model_does(tmp_path, tied):
    path = tmp_path / "tiny-qwen2.gguf"
    write_gguf(path, "qwen2", tied=tied)
    model, ref = load_gguf(path), _hf_model(path)
    for exclude in (False, True):
        assert model.num_parameters(exclude_embeddings=exclude) == ref.num_parameters(exclude_embeddings=exclude)
    H, V = SHAPE["hidden"], SHAPE["vocab"]
    assert model.num_parameters() - model.num_parameters(exclude_embeddings=True) == V * H
    # packed weights are frozen buffers: only the float parameters that train are trainable
    assert model.num_parameters(only_trainable=True) == sum(p.numel() for p in model.parameters()
                                                            if p.requires_grad) < 2 * V * H
    assert type(model).__name__ == "Qwen2ForCausalLM" and isinstance(model, type(ref))


def test_to_dtype_converts_a_packed_model_whole_or_refuses_by_name(tmp_path):
    """model.to(bfloat16) converts every float tensor and the packed layers' activations, as for
    the dequantised model: dartree's decoding then gives the tokens of the dequantised model
    converted the same way. A dtype the kernels do not take is refused before anything moves."""
    import dartree

    path = tmp_path / "tiny-qwen2.gguf"
    write_gguf(path, "qwen2", seed=4)
    model = load_gguf(path)
    with pytest.raises(ValueError, match="computes in float32, float16 or bfloat16; converting it "
                                         "to torch.float64 is refused"):
        model.to(torch.float64)
    floats = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    assert {t.dtype for t in floats} == {torch.float32}  # nothing moved
    assert model.to(torch.bfloat16) is model
    assert {t.dtype for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()} == {torch.bfloat16}
    packed = [m for m in model.modules() if isinstance(m, (PackedLinear, PackedEmbedding))]
    assert {m.dtype for m in packed} == {torch.bfloat16} and {m.packed.dtype for m in packed} == {torch.uint8}
    ref = _hf_model(path).to(torch.bfloat16)
    ids = torch.tensor([[5, 17, 240, 3, 99, 5, 17]])
    with dartree.exact():
        want = ref.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)[0, 7:].tolist()
    for method in ("ar", "ngram"):
        dec = dartree.SpeculativeDecoder(model, None, method=method, exact=True)
        assert dec.generate(ids, max_new_tokens=12).tokens == want, method
    assert model.half() is model and {m.dtype for m in packed} == {torch.float16}


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
