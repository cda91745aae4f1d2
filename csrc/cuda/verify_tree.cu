// CUDA launcher of verify_tree (kernel and launch: dartree/verify_tree.cuh): checks and the
// stream. A malformed tree is reported through num_accepted = 0, not raised: no host sync.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../tree_checks.h"
#include "dartree/verify_tree.cuh"
#include "launcher.h"

namespace dartree {

void verify_tree_cuda(const at::Tensor& parents, const at::Tensor& tokens, const at::Tensor& target_tokens,
                      const std::optional<at::Tensor>& first_child,
                      const std::optional<at::Tensor>& next_sibling, at::Tensor accepted,
                      at::Tensor num_accepted, at::Tensor bonus) {
  const int64_t T = check_verify_tree(parents, tokens, target_tokens, first_child, next_sibling,
                                      accepted, num_accepted, bonus);
  TORCH_CHECK_VALUE(T <= kMaxVerifyNodes, "verify_tree: the CUDA kernel walks trees of at most ",
                    kMaxVerifyNodes, " nodes, got ", T);
  const c10::cuda::CUDAGuard guard(parents.device());
  StreamLauncher launcher(parents.device());
  launch_verify_tree(launcher, static_cast<int>(T), parents.data_ptr<int64_t>(),
                     tokens.data_ptr<int64_t>(), target_tokens.data_ptr<int64_t>(),
                     first_child ? first_child->data_ptr<int64_t>() : nullptr,
                     next_sibling ? next_sibling->data_ptr<int64_t>() : nullptr,
                     accepted.data_ptr<int64_t>(), num_accepted.data_ptr<int64_t>(),
                     bonus.data_ptr<int64_t>());
}

TORCH_LIBRARY_IMPL(dartree, CUDA, m) { m.impl("verify_tree", &verify_tree_cuda); }

}  // namespace dartree
