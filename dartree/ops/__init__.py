"""dartree's custom ops: thin wrappers over torch.ops.dartree.* with fake kernels.

One module per op family, each holding its wrappers, their argument checks and the ops' fake
kernels side by side:

    cache      kv_commit, write_rows
    attention  tree_attention, exact_tree_attention
    tree       candidate_topk, expand_level, build_dartree, prune_tree (+ prune_tree_layout,
               TreeLayout), verify_tree (+ verify_tree_padded)
    linear     exact_linear, packed_linear (weights as GGUF blocks), exact_kernels_available
    head       greedy_head (a packed output layer's argmax), greedy_head_bounds
    sampling   sample_keyed
    stack      decoder_stack (a Llama-family decoder stack in one CPU call)

Each public op has a plain-PyTorch twin in `dartree.reference` (the oracle for tests), laid out in
the same families. When the compiled extension `dartree._C` is missing, or `use_reference(True)`
is in force, the wrappers run the reference instead, so the package works from a source tree
without a build.
"""

from ._dispatch import (HAS_CUDA_EXACT_LINEAR, HAS_CUDA_EXACT_TREE_ATTENTION, HAS_CUDA_KERNELS,
                        HAS_CUDA_PACKED_LINEAR, HAS_CUDA_TREE_ATTENTION, HAS_EXTENSION, reference_ops,
                        use_reference)
from .attention import exact_tree_attention, tree_attention
from .cache import kv_commit, write_rows
from .head import greedy_head, greedy_head_bounds
from .linear import exact_kernels_available, exact_linear, packed_kernel_available, packed_linear
# dartree.sampling.PositionKeyedSampler validates its seed and temperature with the op's own check
from .sampling import _check_sample_keyed, sample_keyed
from .stack import decoder_stack, decoder_stack_available
from .tree import (TreeLayout, build_dartree, candidate_topk, expand_level, prune_tree,
                   prune_tree_layout, verify_tree, verify_tree_padded)
