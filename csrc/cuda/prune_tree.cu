// CUDA launcher of prune_tree (kernel and launch: dartree/prune_tree.cuh): checks, the dtype
// dispatch, the stream. Parent values are not read on the host: the kernel bounds them and
// reports a bad tree or a pruned parent through `status` (no host sync).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../tree_checks.h"
#include "dartree/prune_tree.cuh"
#include "launcher.h"

namespace dartree {

void prune_tree_cuda(const at::Tensor& parents, const at::Tensor& depths, const at::Tensor& scores,
                     double depth_bonus, at::Tensor kept, at::Tensor new_parents,
                     at::Tensor new_depths, at::Tensor ancestors, at::Tensor first_child,
                     at::Tensor next_sibling, at::Tensor status) {
  const auto [M, N] = check_prune_tree(parents, depths, scores, kept, new_parents, new_depths,
                                       ancestors, first_child, next_sibling, status);
  TORCH_CHECK_VALUE(N - 1 <= kMaxSelect, "prune_tree: the CUDA kernel keeps at most ", kMaxSelect,
                    " nodes besides the root, got ", N - 1);
  check_int_range(M, "prune_tree", "M");
  const c10::cuda::CUDAGuard guard(parents.device());
  StreamLauncher launcher(parents.device());
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "prune_tree_cuda", [&] {
    PruneArgs<scalar_t> a{};
    a.M = static_cast<int>(M), a.N = static_cast<int>(N);
    a.parents = parents.data_ptr<int64_t>();
    a.depths = depths.data_ptr<int64_t>();
    a.scores = scores.data_ptr<scalar_t>();
    a.bonus = static_cast<scalar_t>(depth_bonus);
    a.kept = kept.data_ptr<int64_t>();
    a.new_parents = new_parents.data_ptr<int64_t>();
    a.new_depths = new_depths.data_ptr<int64_t>();
    a.ancestors = ancestors.data_ptr<int32_t>();
    a.first_child = first_child.data_ptr<int64_t>();
    a.next_sibling = next_sibling.data_ptr<int64_t>();
    a.status = status.data_ptr<int32_t>();
    launch_prune_tree(launcher, a);
  });
}

TORCH_LIBRARY_IMPL(dartree, CUDA, m) { m.impl("prune_tree", &prune_tree_cuda); }

}  // namespace dartree
