"""Runs dartree's CUDA kernel headers on the CPU: the drivers in tests/cuda_emu, built once per
test session with g++ (-fsanitize=thread instrumentation feeds the emulator's race detector; no
libtsan is linked), called with torch tensors through a file (tests/cuda_emu/tensor_io.h)."""

import atexit
import functools
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMU = os.path.join(ROOT, "tests", "cuda_emu")
# -O2: the race detector runs ~3x faster than at -O1 for ~1.5x the compile time
FLAGS = ["-std=c++17", "-O2", "-g1", "-fsanitize=thread", "-fno-extern-tls-init",
         "-Wno-unknown-pragmas",
         "-DDARTREE_CUDA_EMULATION", "-I" + os.path.join(ROOT, "csrc", "include"), "-I" + EMU]

DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
          torch.bfloat16: "bfloat16", torch.int64: "int64", torch.int32: "int32", torch.uint8: "uint8",
          torch.bool: "bool"}
BY_NAME = {name: dtype for dtype, name in DTYPES.items()}

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the CUDA emulation")


@functools.lru_cache(maxsize=None)
def _build_dir():
    path = tempfile.mkdtemp(prefix="dartree-cuda-emu-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.lru_cache(maxsize=None)
def driver(name):
    """Path of the built driver tests/cuda_emu/<name>.cpp (compiled on first use)."""
    obj = os.path.join(_build_dir(), name + ".o")
    binary = os.path.join(_build_dir(), name)
    for command in (["g++", *FLAGS, "-c", os.path.join(EMU, name + ".cpp"), "-o", obj],
                    ["g++", obj, "-o", binary]):
        build = subprocess.run(command, capture_output=True, text=True)
        assert build.returncode == 0, build.stderr[-4000:]
    return binary


class EmulatorError(AssertionError):
    """The driver failed: a data race, a deadlock, a bad launch (stderr in the message)."""


def _write(path, op, tensors):
    with open(path, "wb") as f:
        f.write(f"op {op}\n".encode())
        for name, t in tensors.items():
            t = t.detach().cpu().contiguous()
            raw = t.view(torch.uint8) if t.dtype == torch.bool else t
            data = raw.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            dims = " ".join(str(d) for d in t.shape)
            f.write(f"tensor {name} {DTYPES[t.dtype]} {t.dim()} {dims} {len(data)}\n".replace("  ", " ").encode())
            f.write(data)
        f.write(b"end\n")


def _read(path):
    out = {}
    with open(path, "rb") as f:
        assert f.readline().startswith(b"op ")
        while True:
            words = f.readline().split()
            if words == [b"end"]:
                return out
            _, name, dtype, ndim = words[:4]
            shape = [int(d) for d in words[4:4 + int(ndim)]]
            data = bytearray(f.read(int(words[-1])))
            dtype = BY_NAME[dtype.decode()]
            storage = torch.uint8 if dtype == torch.bool else dtype
            flat = torch.frombuffer(data, dtype=storage) if data else torch.empty(0, dtype=storage)
            out[name.decode()] = flat.view(dtype).reshape(shape) if dtype == torch.bool else flat.reshape(shape)


def run(name, op, tensors, timeout=600):
    """Runs `op` of driver `name` on the tensors (None values are left out: an absent optional;
    ints and floats become 0-d int64 / float64 tensors); returns every tensor after the run."""
    packed = {}
    for key, value in tensors.items():
        if value is None:
            continue
        if isinstance(value, bool) or isinstance(value, int):
            value = torch.tensor(int(value), dtype=torch.int64)
        elif isinstance(value, float):
            value = torch.tensor(value, dtype=torch.float64)
        elif isinstance(value, (list, tuple)):
            value = torch.tensor(value, dtype=torch.int64)
        packed[key] = value
    with tempfile.TemporaryDirectory(dir=_build_dir()) as work:
        request, response = os.path.join(work, "request"), os.path.join(work, "response")
        _write(request, op, packed)
        result = subprocess.run([driver(name), request, response], capture_output=True, text=True,
                                timeout=timeout)
        if result.returncode != 0:
            raise EmulatorError(f"{name} {op} exited with {result.returncode}:\n{result.stderr[-6000:]}")
        return _read(response)
