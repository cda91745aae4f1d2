"""ctest entry: load a CMake-built dartree library and compare its CPU ops with the references."""

import importlib.util
import pathlib
import sys

import torch

torch.ops.load_library(sys.argv[1])
# The reference module alone: importing the dartree package would load its own dartree._C too.
path = pathlib.Path(__file__).parents[1] / "dartree" / "reference.py"
spec = importlib.util.spec_from_file_location("dartree_reference", path)
reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference)

kv = torch.randn(3, 2, 1, 2, 20, 8)
expected = kv.clone()
accepted = torch.tensor([0, 2, 3, 7])
reference.kv_commit(expected, 5, accepted)
torch.ops.dartree.kv_commit(kv, 5, accepted)
assert torch.equal(kv, expected), "kv_commit differs from the reference"
print("cmake build: ops match the references")
