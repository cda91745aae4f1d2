// CPU launcher of verify_tree (kernel: dartree/cpu/verify_tree.h): checks, and the errors a
// malformed tree raises (the CUDA kernel reports them through num_accepted instead).
#include <torch/library.h>

#include <vector>

#include "../tree_checks.h"
#include "dartree/cpu/verify_tree.h"

namespace dartree {

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

TORCH_LIBRARY_IMPL(dartree, CPU, m) { m.impl("verify_tree", &verify_tree_cpu); }

}  // namespace dartree
