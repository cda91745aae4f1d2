// CPU pruning + verify layout and the verify walk: a few hundred nodes at most, so one thread and
// plain loops (tree_kernels.h); what matters is that no torch op (and so no dispatch) is involved.
#include <torch/library.h>

#include <vector>

#include "../tree_checks.h"
#include "tree_kernels.h"

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

void verify_tree_cpu(const at::Tensor& parents, const at::Tensor& tokens, const at::Tensor& target_tokens,
                     const std::optional<at::Tensor>& first_child,
                     const std::optional<at::Tensor>& next_sibling, at::Tensor accepted,
                     at::Tensor num_accepted, at::Tensor bonus) {
  const int64_t T = check_verify_tree(parents, tokens, target_tokens, first_child, next_sibling,
                                      accepted, num_accepted, bonus);
  std::vector<int64_t> scratch;
  const int result = cpu::verify_tree(
      T, parents.data_ptr<int64_t>(), tokens.data_ptr<int64_t>(), target_tokens.data_ptr<int64_t>(),
      first_child ? first_child->data_ptr<int64_t>() : nullptr,
      next_sibling ? next_sibling->data_ptr<int64_t>() : nullptr, accepted.data_ptr<int64_t>(),
      num_accepted.data_ptr<int64_t>(), bonus.data_ptr<int64_t>(), scratch);
  TORCH_CHECK_VALUE(result != 1, "verify_tree: parents must have parents[0] == -1 and "
                    "0 <= parents[i] < i (a parent index is out of range)");
  TORCH_CHECK_VALUE(result != 2, "verify_tree: first_child / next_sibling do not describe the "
                    "children of parents in index order");
}

TORCH_LIBRARY_IMPL(dartree, CPU, m) {
  m.impl("prune_tree", &prune_tree_cpu);
  m.impl("verify_tree", &verify_tree_cpu);
}

}  // namespace dartree
