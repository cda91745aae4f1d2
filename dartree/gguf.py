"""GGUF files as transformers models whose weights stay packed.

`load_gguf(path)` builds the transformers model of a Llama, Qwen2 or Qwen3 GGUF file the way
transformers' own GGUF loader does (config, tensor names, the Llama Q/K row order), except that
every weight stored in a supported block type (`dartree.gguf_blocks`) stays as its packed rows:
linear layers become `PackedLinear`, the token embedding `PackedEmbedding` (a tied LM head shares
its rows). Norms and other float tensors are loaded as usual, in `dtype`. The packed rows are copied
once from the file into their final place; on a CPU an untied token embedding's rows are not copied
but mapped (`_map_rows`): a lookup touches the pages of its rows only.

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
from .gguf_file import read_gguf

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

    @property
    def weight_count(self) -> int:
        """Values of the weight the packed rows hold: N * K (the bias is a parameter)."""
        return self.out_features * self.in_features

    def _apply(self, fn, recurse=True):
        # .to(dtype) / .half() / .bfloat16() convert the float tensors; the activation dtype
        # follows, so a converted layer computes in the new dtype (packed rows stay uint8)
        dtype = _converted_dtype(fn, self.dtype, self.packed.device, type(self).__name__)
        out = super()._apply(fn, recurse)
        self.dtype = dtype
        return out

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

    @property
    def weight_count(self) -> int:
        """Values of the table the packed rows hold: V * H."""
        return self.num_embeddings * self.embedding_dim

    def _apply(self, fn, recurse=True):
        dtype = _converted_dtype(fn, self.dtype, self.packed.device, type(self).__name__)
        out = super()._apply(fn, recurse)
        self.dtype = dtype
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.packed[ids.reshape(-1)]
        out = gguf_blocks.dequantize(rows, self.qtype, self.embedding_dim)  # on the rows' device
        return out.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"


ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the packed kernels take


def _converted_dtype(fn, dtype: torch.dtype, device: torch.device, what: str) -> torch.dtype:
    """The dtype a module conversion `fn` (what nn.Module._apply applies to each tensor: .to,
    .half, .cuda, ...) gives a float tensor of `dtype`; ValueError naming it when the packed
    kernels cannot compute in it."""
    new = fn(torch.empty(0, dtype=dtype, device=device)).dtype
    if new not in ACTIVATION_DTYPES:
        raise ValueError(f"a packed model ({what}) computes in float32, float16 or bfloat16; "
                         f"converting it to {new} is refused")
    return new


class PackedModel:
    """Mixed into the class of every model `load_gguf` returns (the class keeps its name).

    num_parameters(): transformers counts parameters only; a packed model's weights are uint8
    buffers, so it also counts each packed tensor once as the values it holds (`weight_count`).
    .to(dtype) (and .half(), .bfloat16(), .float()): every float tensor converts as in any
    transformers model and the packed layers compute in the new dtype, so the model is whole;
    a dtype the packed kernels do not take (float64) is refused by name before anything moves.
    """

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        count = super().num_parameters(only_trainable=only_trainable,
                                       exclude_embeddings=exclude_embeddings)
        if only_trainable:  # packed weights are frozen
            return count
        seen = set()
        if exclude_embeddings:  # a tied head's rows are the embedding's: excluded with it
            seen = {_key(m.packed) for m in self.modules() if isinstance(m, PackedEmbedding)}
        for module in self.modules():
            if isinstance(module, (PackedLinear, PackedEmbedding)) and _key(module.packed) not in seen:
                seen.add(_key(module.packed))
                count += module.weight_count
        return count

    def _apply(self, fn, recurse=True):
        packed = [m for m in self.modules() if isinstance(m, (PackedLinear, PackedEmbedding))]
        if packed:  # refuse before any tensor moves (the layers would, one by one, midway)
            _converted_dtype(fn, packed[0].dtype, torch.device("cpu"), type(self).__name__)
        return super()._apply(fn, recurse)


def _key(t: torch.Tensor) -> tuple:
    """One packed tensor (a tied head and its embedding share theirs; fused views differ)."""
    return t.data_ptr(), tuple(t.shape)


_PACKED_CLASSES: dict[type, type] = {}


def _packed_class(cls: type) -> type:
    """`cls` with PackedModel mixed in, under cls's own name (one class per model class)."""
    if cls not in _PACKED_CLASSES:
        _PACKED_CLASSES[cls] = type(cls.__name__, (PackedModel, cls),
                                    {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                     "__doc__": cls.__doc__})
    return _PACKED_CLASSES[cls]


def _require_packages() -> None:
    import importlib.util

    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"load_gguf needs the {module!r} package: "
                                      f"pip install {module}")


FLOAT_TYPES = ("F32", "F16", "BF16")


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> nn.Module:
    """The causal LM of a GGUF file with its block-typed weights packed (see the module doc).

    dtype: of the activations and of the float tensors (norms, unquantised weights). A ValueError
    names what it refuses: a file that is not GGUF or is cut short (`dartree.gguf_file`), an
    architecture other than Llama, Qwen2 or Qwen3, a tensor of a block type `gguf_blocks` does not
    support. The model's `num_parameters()` counts the packed weights as the values they hold, and
    `.to(dtype)` converts it whole (`PackedModel`)."""
    _require_packages()
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map,
                                                          load_gguf_checkpoint)

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    file = read_gguf(path)  # the cheap header walk: refuses a damaged file before any parse
    if file.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"load_gguf supports {', '.join(SUPPORTED_ARCHITECTURES)}; {path.name} "
                         f"is a {file.architecture!r} model")
    for entry in file.tensors:
        if entry.type not in FLOAT_TYPES and entry.type not in gguf_blocks.BLOCK_TYPES:
            raise ValueError(f"{path.name}: tensor {entry.name} is stored as {entry.type}; "
                             f"load_gguf reads {', '.join(FLOAT_TYPES)} and the block types "
                             f"{', '.join(gguf_blocks.BLOCK_TYPES)}")
    # transformers' own reading of the metadata (one parse: AutoConfig.from_pretrained(gguf_file=)
    # would run the same one again): the config, and the tensor processor's settings
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    config = CONFIG_MAPPING[parsed["model_type"]].from_dict(dict(parsed))
    config._name_or_path = str(path)  # what AutoConfig would add (there: the folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    processor = TENSOR_PROCESSORS.get(parsed["model_type"], TensorProcessor)(config=parsed)
    names = get_gguf_hf_weights_map(model, processor)
    device = torch.device(device)
    embed = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    # an untied token table stays in the file on a CPU: a lookup reads a few rows, so only their
    # pages become resident (12% of a Q4_K_M file never read whole); a tied head reads it all
    tensors = {names[e.name] for e in file.tensors if e.name in names}
    mapped = f"{embed}.weight" if device.type == "cpu" and f"{head}.weight" in tensors else None
    state, rows, packed = _read_tensors(file, names, processor, dtype, mapped)
    packed.update(_place_rows(rows, device))
    del file, rows  # the header's map goes with the last view of it
    _install(model, state, packed, dtype)
    _return_freed_memory()
    model = model.to(device).eval()
    _fuse_biases(model)
    model.__class__ = _packed_class(type(model))
    return model


def _read_tensors(file, names: dict[str, str], processor, dtype: torch.dtype, mapped: str | None):
    """(float tensors, packed rows to copy, packed rows mapped) by transformers name, read from
    `file` (`gguf_file.GGUFFile`) the way transformers' loader reads them. Float tensors are
    dequantised to float32 by gguf-py as there, processed, then cast to `dtype`; packed rows are
    views of the file (processed: the Llama Q/K row order), except the tensor named `mapped`,
    mapped privately (`_map_rows`) when the processor leaves it as it is."""
    from gguf import GGMLQuantizationType, dequantize

    state: dict[str, torch.Tensor] = {}
    rows: dict[str, tuple[np.ndarray, str, int]] = {}
    maps: dict[str, tuple[torch.Tensor, str, int]] = {}
    for entry in file.tensors:
        if entry.name not in names:
            continue
        key = names[entry.name]
        data = file.data(entry)  # a view of the map: read when copied
        if entry.type in FLOAT_TYPES:
            weights = dequantize(data, GGMLQuantizationType(entry.ggml_type))
            weights = processor.process(weights=weights, name=entry.name).weights
            state[key] = torch.from_numpy(np.copy(weights)).to(dtype)
            continue
        data = data.reshape(-1, data.shape[-1])
        # the processor reorders rows only (the Llama Q/K permutation): valid on packed rows
        processed = processor.process(weights=data, name=entry.name).weights
        if key == mapped and processed is data:
            maps[key] = (_map_rows(file.path, entry, data.shape), entry.type, int(entry.shape[-1]))
        else:
            rows[key] = (processed, entry.type, int(entry.shape[-1]))
    return state, rows, maps


# Projections that read the same input: their packed rows (and biases) are laid out back to back
# in one tensor, each module's buffer a view of its part, so one packed_linear call can compute all
# of them (decoder_stack.adjacent): every output row is its own dot product, so the bits are those
# of the separate calls, at no extra memory.
FUSABLE = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def _fusable_groups(keys) -> list[list[str]]:
    """The weight keys of each FUSABLE set of projections present among `keys`, in order."""
    groups = []
    for key in keys:
        parent, _, leaf = key.removesuffix(".weight").rpartition(".")
        block = parent.rpartition(".")[2]
        if block in FUSABLE and leaf == FUSABLE[block][0]:
            members = [f"{parent}.{name}.weight" for name in FUSABLE[block]]
            if all(m in keys for m in members):
                groups.append(members)
    return groups


def _place_rows(rows: dict[str, tuple[np.ndarray, str, int]], device: torch.device
                ) -> dict[str, tuple[torch.Tensor, str, int]]:
    """Each tensor's packed rows copied once from the file into its final place on `device`:
    a FUSABLE group of one block type and width into one tensor (each member a view of its
    part), every other tensor into its own."""
    placed: dict[str, tuple[torch.Tensor, str, int]] = {}
    for group in _fusable_groups(rows):
        if len({rows[k][1:] for k in group}) != 1:
            continue  # mixed block types or widths: separate calls
        whole = torch.empty(sum(rows[k][0].shape[0] for k in group), rows[group[0]][0].shape[1],
                            dtype=torch.uint8, device=device)
        parts = whole.split([rows[k][0].shape[0] for k in group])
        for key, part in zip(group, parts):
            _copy_rows(part, rows[key][0])
            placed[key] = (part, *rows[key][1:])
    for key, (data, qtype, K) in rows.items():
        if key not in placed:
            tensor = torch.empty(data.shape, dtype=torch.uint8, device=device)
            _copy_rows(tensor, data)
            placed[key] = (tensor, qtype, K)
    return placed


def _map_rows(path: Path, entry, shape: tuple[int, int]) -> torch.Tensor:
    """uint8 `shape`: a tensor's packed rows as a private (copy-on-write) memory map of the file:
    pages are read from the file when first touched and never written back."""
    return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", offset=entry.start,
                                      shape=shape))


def _copy_rows(dst: torch.Tensor, data: np.ndarray) -> None:
    """dst (uint8, any device) = data (a read-only view of the file: copied, never aliased)."""
    if dst.device.type == "cpu":
        np.copyto(dst.numpy(), data)
    else:
        staged = torch.empty(dst.shape, dtype=torch.uint8)
        np.copyto(staged.numpy(), data)
        dst.copy_(staged)


def _fuse_biases(model: nn.Module) -> None:
    """Lay the biases of each fused group of PackedLinear (rows already adjacent) back to back,
    each module's bias a view of its part, as the rows are."""
    from .decoder_stack import adjacent

    for layer in getattr(getattr(model, "model", None), "layers", []):
        for block, names in FUSABLE.items():
            parent = getattr(layer, block, None)
            mods = [getattr(parent, n, None) for n in names]
            if not all(type(m) is PackedLinear and m.bias is not None for m in mods):
                continue
            if adjacent([m.packed for m in mods]) is None:
                continue
            whole = torch.cat([m.bias for m in mods])
            for m, part in zip(mods, whole.split([m.out_features for m in mods])):
                m.bias = nn.Parameter(part, requires_grad=False)


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
