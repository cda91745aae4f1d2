"""dartree's custom ops: thin wrappers over torch.ops.dartree.* with fake kernels.

Each public function here has a plain-PyTorch twin in `dartree.reference` (the oracle for tests).
When the compiled extension `dartree._C` is missing, or `use_reference(True)` is in force, the
wrappers run the reference instead, so the package works from a source tree without a build.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from . import reference

log = logging.getLogger(__name__)

try:
    from . import _C  # noqa: F401  (registers torch.ops.dartree.*)

    HAS_EXTENSION = True
except ImportError as exc:  # a source tree without `pip install`
    HAS_EXTENSION = False
    log.info("dartree._C not built (%s): using the PyTorch reference ops", exc)

# The CUDA kernels are compiled in when torch is a CUDA build and nvcc was found at build time.
HAS_CUDA_KERNELS = HAS_EXTENSION and torch._C._dispatch_has_kernel_for_dispatch_key(
    "dartree::kv_commit", "CUDA")

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


# ---------------------------------------------------------------------------------------------
# kv_commit


def kv_commit(kv: torch.Tensor, prefix_len: int, accepted: torch.Tensor, check: bool = True) -> None:
    """Keep only the accepted branch of a verified tree in a static KV cache, in place.

    kv:        [..., S, D] contiguous (e.g. the whole cache [L, 2, B, Hkv, S, D]): one launch moves
               the rows of every layer, K and V.
    accepted:  int64 [A] tree indices of the accepted path, strictly increasing, accepted[0] == 0.
    Effect:    kv[..., prefix_len + j, :] = kv[..., prefix_len + accepted[j], :] for j < A.
    check:     validate the index values too (reads them on the host: one sync on a GPU). The
               engine passes False for indices produced by `verify_tree`.

    >>> kv = torch.arange(8.).reshape(1, 4, 2)
    >>> kv_commit(kv, 1, torch.tensor([0, 2]))
    >>> kv[0, :3].tolist()
    [[0.0, 1.0], [2.0, 3.0], [6.0, 7.0]]
    """
    native = _native(kv, accepted)
    if not native or (check and kv.device.type != "cpu"):  # the CPU kernel checks values itself
        _check_kv_commit(kv, prefix_len, accepted, values=check)
    if native:
        torch.ops.dartree.kv_commit.default(kv, prefix_len, accepted)
    else:
        reference.kv_commit(kv, prefix_len, accepted)


def _check_kv_commit(kv, prefix_len, accepted, values):
    if kv.dim() < 2 or not kv.is_contiguous():
        raise ValueError(f"kv_commit: kv must be a contiguous [..., S, D] tensor, got {tuple(kv.shape)}")
    if accepted.dim() != 1 or accepted.dtype != torch.int64 or accepted.numel() == 0:
        raise ValueError("kv_commit: accepted must be a non-empty 1-D int64 tensor, got "
                         f"{accepted.dtype} {tuple(accepted.shape)}")
    if accepted.device != kv.device:
        raise ValueError(f"kv_commit: accepted is on {accepted.device} but kv is on {kv.device}")
    seq = kv.shape[-2]
    if prefix_len < 0 or prefix_len + accepted.numel() > seq:
        raise ValueError(f"kv_commit: prefix_len {prefix_len} + {accepted.numel()} accepted rows "
                         f"exceeds the cache length {seq}")
    if not values:
        return
    idx = accepted.tolist()
    if idx[0] != 0:
        raise ValueError(f"kv_commit: accepted[0] must be 0 (the root), got {idx[0]}")
    if any(b <= a for a, b in zip(idx, idx[1:])):
        raise ValueError(f"kv_commit: accepted must be strictly increasing, got {idx}")
    if prefix_len + idx[-1] >= seq:
        raise ValueError(f"kv_commit: accepted index {idx[-1]} at prefix_len {prefix_len} is "
                         f"outside the cache length {seq}")


# ---------------------------------------------------------------------------------------------
# ops with only a reference so far (kernels land with the kernels issue)


def tree_attention(q, k, v, tree_mask, prefix_len, scale=None):
    """Attention of T tree queries over a static KV cache; see `dartree.reference.tree_attention`."""
    return reference.tree_attention(q, k, v, tree_mask, prefix_len, scale)


def candidate_topk(logits, num_candidates):
    """Top-C tokens per draft slot and the full-vocabulary logsumexp; see `dartree.reference`."""
    return reference.candidate_topk(logits, num_candidates)


def expand_level(parent_scores, parent_states, z, w_s, cand_w2, cand_b2, cand_base, cand_ids,
                 num_expand, num_select, input_table=None, w_hh=None, b_hh=None):
    """One DARTree level (score, select, GRU step); see `dartree.reference.expand_level`."""
    return reference.expand_level(parent_scores, parent_states, z, w_s, cand_w2, cand_b2, cand_base,
                                  cand_ids, num_expand, num_select, input_table, w_hh, b_hh)


def prune_tree(parents, depths, scores, budget, depth_bonus):
    """Keep the root and the best `budget` nodes; see `dartree.reference.prune_tree`."""
    return reference.prune_tree(parents, depths, scores, budget, depth_bonus)


def verify_tree(parents, tokens, target_tokens):
    """The accepted root path of a verified tree and the bonus; see `dartree.reference.verify_tree`."""
    return reference.verify_tree(parents, tokens, target_tokens)


if HAS_EXTENSION:

    @torch.library.register_fake("dartree::kv_commit")
    def _kv_commit_fake(kv, prefix_len, accepted):
        torch._check(accepted.dim() == 1, lambda: "accepted must be 1-D")
        return None


def candidate_topk(logits, num_candidates):
    """Top-C tokens of every draft slot; see `dartree.reference.candidate_topk`."""
    return reference.candidate_topk(logits, num_candidates)


def expand_level(*args, **kwargs):
    """One DARTree level; see `dartree.reference.expand_level`."""
    return reference.expand_level(*args, **kwargs)


def prune_tree(parents, depths, scores, budget, depth_bonus):
    """Keep the best `budget` nodes; see `dartree.reference.prune_tree`."""
    return reference.prune_tree(parents, depths, scores, budget, depth_bonus)


def verify_tree(parents, tokens, target_tokens):
    """The accepted root-to-node walk; see `dartree.reference.verify_tree`."""
    return reference.verify_tree(parents, tokens, target_tokens)
