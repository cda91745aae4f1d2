"""Which implementation an op call takes: the compiled extension or the plain-PyTorch reference.

Shared by every op family of `dartree.ops`: loading `dartree._C`, which ops have CUDA kernels, the
reference switch, and the registration of fake kernels.
"""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)

try:
    from .. import _C  # noqa: F401  (registers torch.ops.dartree.*)

    HAS_EXTENSION = True
except ImportError as exc:  # a source tree without `pip install`
    HAS_EXTENSION = False
    log.info("dartree._C not built (%s): using the PyTorch reference ops", exc)


def _has_cuda_kernel(op: str) -> bool:
    return HAS_EXTENSION and torch._C._dispatch_has_kernel_for_dispatch_key(f"dartree::{op}", "CUDA")


# The CUDA kernels are compiled in when torch is a CUDA build and nvcc was found at build time.
HAS_CUDA_KERNELS = _has_cuda_kernel("kv_commit")
HAS_CUDA_TREE_ATTENTION = _has_cuda_kernel("tree_attention")
HAS_CUDA_EXACT_LINEAR = _has_cuda_kernel("exact_linear")
HAS_CUDA_EXACT_TREE_ATTENTION = _has_cuda_kernel("exact_tree_attention")
HAS_CUDA_PACKED_LINEAR = _has_cuda_kernel("packed_linear")

_force_reference = False


def use_reference(enabled: bool = True) -> None:
    """Route every op to its plain-PyTorch reference (True) or to the compiled kernels (False)."""
    global _force_reference
    _force_reference = bool(enabled)


@contextlib.contextmanager
def reference_ops(enabled: bool = True):
    """Context manager form of `use_reference`."""
    previous = _force_reference
    use_reference(enabled)
    try:
        yield
    finally:
        use_reference(previous)


def _native(*tensors: torch.Tensor) -> bool:
    """True when the compiled kernels should run for these inputs."""
    if _force_reference or not HAS_EXTENSION:
        return False
    return all(t.device.type in ("cpu", "cuda") for t in tensors)


def _fake(op: str):
    """`torch.library.register_fake` for `dartree::op`; without the extension there is no schema to
    register against, and the wrappers never call the op."""
    def register(fn):
        if HAS_EXTENSION:
            torch.library.register_fake(f"dartree::{op}")(fn)
        return fn
    return register
