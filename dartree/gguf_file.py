"""A GGUF file's layout: its header (metadata, tensor table) and each tensor's bytes.

`read_gguf(path)` walks the header through a memory map (`mmap`) and keeps what loading needs: the
scalar and string metadata (arrays are skipped: a 150k-token vocabulary is walked, not parsed),
and for every tensor its name, shape, GGML type and byte range. Tensor bytes are views of the map,
read only when copied. gguf-py's `GGUFReader` parses every array element into numpy objects
instead: about 18 s for Qwen2.5-Coder-1.5B's header on a 2-core Xeon, against 0.25 s here.

Every read is bounds-checked, so a damaged file is refused with a ValueError that names the
problem: not a GGUF file, a version this reader does not know, a header or tensor data cut short
(how many bytes the file has and how many it needs), a tensor of a GGML type gguf-py does not
know.

Layout (little-endian): b"GGUF" | u32 version | u64 tensor count | u64 metadata count |
metadata: (string key, u32 type, value)* | tensor table: (string name, u32 n_dims, u64 dims
innermost first, u32 GGML type, u64 offset in the data section)* | padding to `general.alignment`
(default 32) | data section. A string is u64 length + UTF-8 bytes; an array u32 element type +
u64 count + elements.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# metadata value types: fixed-size scalars by their struct format; 8 string, 9 array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file.

    shape:  logical shape in torch order (outermost first), e.g. [N, K] for a weight
    type:   its GGML type's name ("F32", "Q4_K", ...)
    start:  absolute byte offset in the file; nbytes: its size in bytes
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    type: str
    start: int
    nbytes: int


class GGUFFile:
    """A GGUF file opened by `read_gguf`: `architecture`, `metadata` (scalars and strings),
    `tensors` (TensorEntry, in file order) and `data(entry)` (its bytes)."""

    def __init__(self, path: Path, blob: mmap.mmap, metadata: dict[str, Any],
                 tensors: list[TensorEntry]):
        self.path, self._blob = path, blob
        self.metadata, self.tensors = metadata, tensors
        self.architecture = str(metadata.get("general.architecture", ""))

    def data(self, entry: TensorEntry) -> np.ndarray:
        """uint8 [..., bytes of one innermost row]: the tensor's bytes, a read-only view of the
        map (gguf-py's byte layout: what `gguf.dequantize` takes)."""
        row = entry.nbytes // max(1, int(np.prod(entry.shape[:-1], dtype=np.int64)))
        data = np.frombuffer(self._blob, dtype=np.uint8, count=entry.nbytes, offset=entry.start)
        return data.reshape(*entry.shape[:-1], row)


class _Cursor:
    """Reads the header from the map, refusing to read past the file's end."""

    def __init__(self, blob: mmap.mmap, path: Path):
        self.blob, self.path, self.pos, self.size = blob, path, 0, len(blob)

    def _need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise ValueError(f"{self.path} is truncated: its GGUF header needs at least "
                             f"{self.pos + n:,} bytes, the file has {self.size:,}")

    def unpack(self, fmt: str) -> tuple:
        n = struct.calcsize(fmt)
        self._need(n)
        out = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += n
        return out

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        self._need(length)
        raw = self.blob[self.pos:self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self.path} is damaged: a header string at byte "
                             f"{self.pos - length:,} is not UTF-8") from None

    def skip(self, n: int) -> None:
        self._need(n)
        self.pos += n

    def _skip_strings(self, count: int) -> None:
        # the hot loop of a header (300k strings for a 150k vocabulary): locals only
        blob, pos, size, length = self.blob, self.pos, self.size, _U64.unpack_from
        for _ in range(count):
            if pos + 8 > size:
                break
            pos += 8 + length(blob, pos)[0]
        self._need(pos - self.pos)  # past the end: the truncation error
        self.pos = pos

    def value(self, kind: int, key: str) -> Any:
        """A metadata value: scalars and strings read, arrays skipped (None)."""
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            element, count = self.unpack("<IQ")
            if element in _SCALARS:
                self.skip(count * struct.calcsize(_SCALARS[element]))
            elif element == _STRING:  # a vocabulary, merges: walked by their lengths
                self._skip_strings(count)
            else:
                for _ in range(count):
                    self.value(element, key)
            return None
        raise ValueError(f"{self.path} is damaged: metadata key {key!r} has value type {kind}, "
                         "which GGUF does not define")


def read_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file and read its header; ValueError naming the problem when it is not a
    GGUF file, of an unknown version, cut short (header or tensor data) or holds a tensor of a
    GGML type gguf-py does not know."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    size = path.stat().st_size
    if size < len(MAGIC):
        raise ValueError(f"{path} is not a GGUF file: it has {size} bytes")
    with open(path, "rb") as handle:
        blob = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(blob, path)
    magic = blob[:4]
    cursor.pos = 4
    if magic != MAGIC:
        raise ValueError(f"{path} is not a GGUF file: it starts with {magic!r}, not {MAGIC!r}")
    (version,) = cursor.unpack("<I")
    if version not in VERSIONS:
        raise ValueError(f"{path} is GGUF version {version}; supported: "
                         f"{', '.join(map(str, VERSIONS))}")
    tensor_count, metadata_count = cursor.unpack("<QQ")
    metadata: dict[str, Any] = {}
    for _ in range(metadata_count):
        key = cursor.string()
        (kind,) = cursor.unpack("<I")
        metadata[key] = cursor.value(kind, key)
    table = []
    for _ in range(tensor_count):
        name = cursor.string()
        (dims,) = cursor.unpack("<I")
        shape = tuple(reversed(cursor.unpack(f"<{dims}Q")))
        ggml_type, offset = cursor.unpack("<IQ")
        table.append((name, shape, ggml_type, offset))
    alignment = int(metadata.get("general.alignment") or DEFAULT_ALIGNMENT)
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, shape, ggml_type, offset in table:
        try:
            kind = GGMLQuantizationType(ggml_type)
        except ValueError:
            raise ValueError(f"{path}: tensor {name} has GGML type {ggml_type}, which gguf-py "
                             "does not know") from None
        block, type_size = GGML_QUANT_SIZES[kind]
        elements = int(np.prod(shape, dtype=np.int64))
        if shape and shape[-1] % block:
            raise ValueError(f"{path} is damaged: tensor {name} ({kind.name}) has rows of "
                             f"{shape[-1]} values, not a multiple of its block of {block}")
        entry = TensorEntry(name, shape, ggml_type, kind.name, data_start + offset,
                            elements // block * type_size)
        if entry.start + entry.nbytes > size:
            raise ValueError(f"{path} is truncated: tensor {name} ends at byte "
                             f"{entry.start + entry.nbytes:,}, the file has {size:,} bytes")
        tensors.append(entry)
    return GGUFFile(path, blob, metadata, tensors)
