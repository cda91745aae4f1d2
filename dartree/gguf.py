"""GGUF files as transformers models whose weights stay packed.

`load_gguf(path)` builds the transformers model of a Llama, Qwen2 or Qwen3 GGUF file the way
transformers' own GGUF loader does (config, tensor names, the Llama Q/K row order), except that
every weight stored in a supported block type (`dartree.gguf_blocks`) stays as its packed rows:
linear layers become `PackedLinear`, the token embedding `PackedEmbedding` (a tied LM head shares
its rows). Norms and other float tensors are loaded as usual, in `dtype`.

A packed layer computes what the dequantised model computes: `PackedLinear(x)` equals
`ops.exact_linear(x, W.to(x.dtype))` bit for bit, where W is the float32 weight transformers'
loader produces (`gguf_blocks.dequantize`), at every number of rows. HF `generate`, every dartree
method and `dartree.exact()` all run these layers, so `exact=True` holds on a packed model as on
any other.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from . import gguf_blocks, ops

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


class PackedLinear(nn.Module):
    """y [..., N] = x [..., K] W^T (+ bias) with W [N, K] kept as GGUF blocks.

    packed: uint8 [N, gguf_blocks.row_bytes(qtype, K)]; bias: [N] or None (a float parameter)."""

    def __init__(self, packed: torch.Tensor, qtype: str, in_features: int,
                 bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        block = gguf_blocks.block_type(qtype)
        self.qtype, self.ggml_type = block.name, block.ggml_type
        self.dtype = dtype  # of the activations it takes (the model's)
        self.in_features = in_features
        self.out_features = packed.shape[0]
        if packed.shape[1] != gguf_blocks.row_bytes(self.qtype, in_features):
            raise ValueError(f"packed rows of {self.qtype} with K={in_features} have "
                             f"{gguf_blocks.row_bytes(self.qtype, in_features)} bytes, got "
                             f"{packed.shape[1]}")
        self.register_buffer("packed", packed)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.packed_kernel_available(x.device) and x.dim() >= 2:
            # straight to the kernel: its own checks run; the wrapper's would cost a tenth of a
            # small call, paid by every layer of a step
            flat = x.reshape(-1, x.shape[-1])
            out = torch.ops.dartree.packed_linear.default(flat, self.packed, self.ggml_type,
                                                          self.in_features, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        return ops.packed_linear(x, self.packed, self.qtype, self.in_features, self.bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] (a copy: for tests and conversions, not for decoding)."""
        return gguf_blocks.dequantize(self.packed, self.qtype, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype}, bias={self.bias is not None}")


class PackedEmbedding(nn.Module):
    """Token embedding rows kept as GGUF blocks: only the rows looked up are dequantised."""

    def __init__(self, packed: torch.Tensor, qtype: str, embedding_dim: int,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.qtype = gguf_blocks.block_type(qtype).name
        self.embedding_dim = embedding_dim
        self.num_embeddings = packed.shape[0]
        self.dtype = dtype
        self.register_buffer("packed", packed)

    def dequantized(self) -> torch.Tensor:
        """The float32 table [V, H] (a copy: for tests and one-off tables, not for decoding)."""
        return gguf_blocks.dequantize(self.packed, self.qtype, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.packed[ids.reshape(-1)]
        out = gguf_blocks.dequantize(rows, self.qtype, self.embedding_dim)  # on the rows' device
        return out.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"


def _require_packages() -> None:
    import importlib.util

    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"load_gguf needs the {module!r} package: "
                                      f"pip install {module}")


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> nn.Module:
    """The causal LM of a GGUF file with its block-typed weights packed (see the module doc).

    dtype: of the activations and of the float tensors (norms, unquantised weights). Refuses an
    architecture other than Llama, Qwen2 or Qwen3, and a block type `gguf_blocks` does not
    support, naming it."""
    _require_packages()
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map,
                                                          load_gguf_checkpoint)

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"load_gguf supports {', '.join(SUPPORTED_ARCHITECTURES)}; {path.name} "
                         f"is a {config.model_type!r} model")
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    architecture = parsed["config"].get("model_type", config.model_type)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(model, processor)

    reader = GGUFReader(path)
    state: dict[str, torch.Tensor] = {}
    packed: dict[str, tuple[torch.Tensor, str, int]] = {}
    for tensor in reader.tensors:
        qtype = tensor.tensor_type.name
        if qtype in ("F32", "F16", "BF16"):
            weights = processor.process(weights=dequantize(tensor.data, tensor.tensor_type),
                                        name=tensor.name).weights
            if tensor.name in names:
                state[names[tensor.name]] = torch.from_numpy(np.copy(weights)).to(dtype)
            continue
        block = gguf_blocks.block_type(qtype)  # refuses an unsupported type by name
        rows = np.ascontiguousarray(tensor.data).reshape(-1, tensor.data.shape[-1])
        # the processor reorders rows only (the Llama Q/K permutation): valid on packed rows
        rows = processor.process(weights=rows, name=tensor.name).weights
        if tensor.name in names:
            K = int(tensor.shape[0])  # GGUF shapes run innermost first
            packed[names[tensor.name]] = (torch.from_numpy(np.copy(rows)), block.name, K)
    _install(model, state, packed, dtype)
    del reader, parsed, names
    _return_freed_memory()
    model = model.to(device).eval()
    _share_rows(model)
    return model


# Projections that read the same input: their packed rows (and biases) are laid out back to back
# in one tensor, each module's buffer a view of its part, so one packed_linear call can compute all
# of them (decoder_stack.adjacent): every output row is its own dot product, so the bits are those
# of the separate calls, at no extra memory.
FUSABLE = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def _share_rows(model: nn.Module) -> None:
    for layer in getattr(getattr(model, "model", None), "layers", []):
        for block, names in FUSABLE.items():
            parent = getattr(layer, block, None)
            mods = [getattr(parent, n, None) for n in names]
            if not all(type(m) is PackedLinear for m in mods):
                continue
            if len({(m.ggml_type, m.in_features, m.packed.device) for m in mods}) != 1:
                continue
            for m, part in zip(mods, _parts(torch.cat([m.packed for m in mods]), mods)):
                m.packed = part
            if all(m.bias is not None for m in mods):
                for m, part in zip(mods, _parts(torch.cat([m.bias for m in mods]), mods)):
                    m.bias = nn.Parameter(part, requires_grad=False)


def _parts(whole: torch.Tensor, mods: list[PackedLinear]) -> list[torch.Tensor]:
    """Views of `whole` along dim 0, one per module, of its out_features rows each."""
    return list(whole.split([m.out_features for m in mods]))


def _return_freed_memory() -> None:
    """Give the heap freed by parsing the file back to the system (glibc keeps it otherwise):
    transformers parses the whole metadata, the tokenizer's vocabulary and merges included, and
    without this the loaded model's resident size was 1.32x the file's, 1.21x with it (SmolLM2 on
    the EPYC, `python bench/gguf_memory.py`)."""
    import ctypes
    import ctypes.util

    libc = ctypes.util.find_library("c")
    if libc is None:
        return
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)


def _install(model: nn.Module, state: dict[str, torch.Tensor],
             packed: dict[str, tuple[torch.Tensor, str, int]], dtype: torch.dtype) -> None:
    """Give the meta-device model real tensors: packed modules where the weight is packed, the
    float tensors from `state`, rotary tables computed as transformers' constructors do."""
    model.to_empty(device="cpu")
    for name, module in list(model.named_modules()):
        if hasattr(module, "inv_freq") and hasattr(module, "config"):  # rotary embedding
            _replace(model, name, type(module)(config=module.config))
    embed_name = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    head_name = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    head_key, embed_key = f"{head_name}.weight", f"{embed_name}.weight"
    if head_key not in packed and head_key not in state:  # a tied head: the same rows
        if embed_key in packed:
            packed[head_key] = packed[embed_key]
        elif embed_key in state:
            state[head_key] = state[embed_key]
    for key, (rows, qtype, K) in packed.items():
        name = key.removesuffix(".weight")
        old = model.get_submodule(name)
        if name == embed_name:
            new = PackedEmbedding(rows, qtype, K, dtype)
        elif isinstance(old, nn.Linear):
            new = PackedLinear(rows, qtype, K, state.get(f"{name}.bias"), dtype)
        else:
            raise ValueError(f"{key} is packed ({qtype}) but {name} is a {type(old).__name__}, "
                             "not a linear layer or the token embedding")
        _replace(model, name, new)
    missing = [k for k in model.load_state_dict(state, strict=False).missing_keys
               if not k.endswith(".packed")]
    if missing:
        raise ValueError(f"the GGUF file has no tensor for {', '.join(missing[:6])}")


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
