// CPU launcher of prune_tree (kernel: dartree/cpu/prune_tree.h): checks, including the parent
// values, the dtype dispatch, and the error a pruned parent raises. A few hundred nodes at most,
// so one thread; what matters is that no torch op (and so no dispatch) is involved.
#include <torch/library.h>

#include <vector>

#include "../tree_checks.h"
#include "dartree/cpu/prune_tree.h"

namespace dartree {

void prune_tree_cpu(const at::Tensor& parents, const at::Tensor& depths, const at::Tensor& scores,
                    double depth_bonus, at::Tensor kept, at::Tensor new_parents, at::Tensor new_depths,
                    at::Tensor ancestors, at::Tensor first_child, at::Tensor next_sibling,
                    at::Tensor status) {
  const auto [M, N] = check_prune_tree(parents, depths, scores, kept, new_parents, new_depths,
                                       ancestors, first_child, next_sibling, status);
  check_parent_values(parents.data_ptr<int64_t>(), M, "prune_tree");
  int result = 0;
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "prune_tree_cpu", [&] {
    std::vector<int64_t> scratch;
    std::vector<scalar_t> heap;
    result = cpu::prune_tree<scalar_t>(
        M, parents.data_ptr<int64_t>(), depths.data_ptr<int64_t>(), scores.data_ptr<scalar_t>(),
        static_cast<scalar_t>(depth_bonus), N, kept.data_ptr<int64_t>(),
        new_parents.data_ptr<int64_t>(), new_depths.data_ptr<int64_t>(),
        ancestors.data_ptr<int32_t>(), first_child.data_ptr<int64_t>(),
        next_sibling.data_ptr<int64_t>(), scratch, heap);
  });
  status.data_ptr<int32_t>()[0] = result;
  TORCH_CHECK_VALUE(result == 0, "prune_tree: a kept node's parent was pruned; scores + depth_bonus * "
                    "depths must not increase from a parent to its child");
}

TORCH_LIBRARY_IMPL(dartree, CPU, m) { m.impl("prune_tree", &prune_tree_cpu); }

}  // namespace dartree
