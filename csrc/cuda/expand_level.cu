// CUDA launcher of expand_level, one DARTree level (kernels and launch: dartree/expand_level.cuh):
// checks, the dtype dispatch, the stream. Unlike every other tree op it reads device memory: the
// candidate ids the GRU reads are checked on the host, as on the CPU (the same error instead of NaN
// states) -- one sync, in this standalone op only; the engine's fused build_dartree reads none.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../tree_args.h"
#include "../tree_checks.h"
#include "dartree/expand_level.cuh"
#include "launcher.h"
#include "level_limits.h"

namespace dartree {

void expand_level_cuda(const at::Tensor& parent_scores, const std::optional<at::Tensor>& parent_states,
                       const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& w_s,
                       const std::optional<at::Tensor>& cand_w2,
                       const std::optional<at::Tensor>& cand_b2, const at::Tensor& cand_base,
                       const at::Tensor& cand_ids, int64_t num_expand,
                       const std::optional<at::Tensor>& input_table,
                       const std::optional<at::Tensor>& w_hh, const std::optional<at::Tensor>& b_hh,
                       at::Tensor parent_pos, at::Tensor tokens, at::Tensor scores, at::Tensor states) {
  const LevelShape s = check_expand_level(parent_scores, parent_states, z, w_s, cand_w2, cand_b2,
                                          cand_base, cand_ids, num_expand, input_table, w_hh, b_hh,
                                          parent_pos, tokens, scores, states);
  check_level_limits(s.f, s.C, s.E, s.Q, s.r, s.G, "expand_level");
  const c10::cuda::CUDAGuard guard(parent_scores.device());
  if (s.gru) {
    const at::Tensor ids = cand_ids.slice(0, 0, s.E).cpu();
    check_ids_in_vocab(ids.data_ptr<int64_t>(), s.E, s.vocab, "expand_level", "input_table");
  }
  StreamLauncher launcher(parent_scores.device());
  AT_DISPATCH_FLOATING_TYPES(parent_scores.scalar_type(), "expand_level_cuda", [&] {
    launch_expand_level(launcher, expand_level_args<scalar_t>(
                                      s, parent_scores, parent_states, z, w_s, cand_w2, cand_b2,
                                      cand_base, cand_ids, input_table, w_hh, b_hh, parent_pos,
                                      tokens, scores, states));
  });
}

TORCH_LIBRARY_IMPL(dartree, CUDA, m) { m.impl("expand_level", &expand_level_cuda); }

}  // namespace dartree
