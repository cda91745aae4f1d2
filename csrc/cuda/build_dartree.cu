// CUDA launcher of build_dartree (launch: dartree/build_dartree.cuh, the same code the CUDA
// emulator test runs): checks from shapes only, the dtype dispatch, the stream. No value is read
// on the host: bad ids and a pruned parent come back through `status`, so the engine's draft
// step never synchronises.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../tree_args.h"
#include "../tree_checks.h"
#include "dartree/build_dartree.cuh"
#include "launcher.h"
#include "level_limits.h"

namespace dartree {

void build_dartree_cuda(const at::Tensor& cand_values, const at::Tensor& cand_ids, const at::Tensor& root,
                        const std::optional<at::Tensor>& root_state, const std::optional<at::Tensor>& z,
                        const std::optional<at::Tensor>& w_s, const std::optional<at::Tensor>& w_2,
                        const std::optional<at::Tensor>& b_2,
                        const std::optional<at::Tensor>& input_table,
                        const std::optional<at::Tensor>& w_hh, const std::optional<at::Tensor>& b_hh,
                        int64_t num_expand, at::IntArrayRef plan, int64_t prefix_len,
                        double depth_bonus, at::Tensor tokens, at::Tensor parents, at::Tensor depths,
                        at::Tensor scores, at::Tensor status) {
  const BuildShape s = check_build_dartree(cand_values, cand_ids, root, root_state, z, w_s, w_2,
                                           b_2, input_table, w_hh, b_hh, num_expand, plan,
                                           prefix_len, tokens, parents, depths, scores, status);
  check_level_limits(s.max_width, s.C, s.E, s.max_width, s.r, s.G, "build_dartree");
  check_int_range(1 + s.total, "build_dartree", "tree size");
  TORCH_CHECK_VALUE(s.N - 1 <= kMaxSelect, "build_dartree: the CUDA kernel keeps at most ", kMaxSelect,
                    " nodes besides the root, got ", s.N - 1);
  const c10::cuda::CUDAGuard guard(cand_values.device());
  StreamLauncher launcher(cand_values.device());
  AT_DISPATCH_FLOATING_TYPES(cand_values.scalar_type(), "build_dartree_cuda", [&] {
    const BuildOutputs<scalar_t> out{tokens.data_ptr<int64_t>(), parents.data_ptr<int64_t>(),
                                     depths.data_ptr<int64_t>(), scores.data_ptr<scalar_t>(),
                                     status.data_ptr<int32_t>()};
    launch_build_dartree(launcher, s,
                         build_inputs<scalar_t>(cand_values, cand_ids, root, root_state, z, w_s,
                                                w_2, b_2, input_table, w_hh, b_hh, plan,
                                                prefix_len, depth_bonus),
                         out);
  });
}

TORCH_LIBRARY_IMPL(dartree, CUDA, m) { m.impl("build_dartree", &build_dartree_cuda); }

}  // namespace dartree
