// CPU launcher of expand_level, one DARTree level (kernel: dartree/cpu/expand_level.h): checks,
// including the candidate ids the GRU reads, and the dtype dispatch.
#include <torch/library.h>

#include "../tree_args.h"
#include "../tree_checks.h"
#include "dartree/cpu/expand_level.h"
#include "tree_parallel.h"

namespace dartree {

void expand_level_cpu(const at::Tensor& parent_scores, const std::optional<at::Tensor>& parent_states,
                      const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& w_s,
                      const std::optional<at::Tensor>& cand_w2,
                      const std::optional<at::Tensor>& cand_b2, const at::Tensor& cand_base,
                      const at::Tensor& cand_ids, int64_t num_expand,
                      const std::optional<at::Tensor>& input_table,
                      const std::optional<at::Tensor>& w_hh, const std::optional<at::Tensor>& b_hh,
                      at::Tensor parent_pos, at::Tensor tokens, at::Tensor scores, at::Tensor states) {
  const LevelShape shape = check_expand_level(parent_scores, parent_states, z, w_s, cand_w2, cand_b2,
                                              cand_base, cand_ids, num_expand, input_table, w_hh,
                                              b_hh, parent_pos, tokens, scores, states);
  if (shape.gru) {
    check_ids_in_vocab(cand_ids.data_ptr<int64_t>(), shape.E, shape.vocab, "expand_level",
                       "input_table");
  }
  AT_DISPATCH_FLOATING_TYPES(parent_scores.scalar_type(), "expand_level_cpu", [&] {
    const LevelArgs<scalar_t> a = expand_level_args<scalar_t>(
        shape, parent_scores, parent_states, z, w_s, cand_w2, cand_b2, cand_base, cand_ids,
        input_table, w_hh, b_hh, parent_pos, tokens, scores, states);
    cpu::LevelScratch<scalar_t> scratch;
    cpu::expand_level(a, scratch, cpu::Parallel());
  });
}

TORCH_LIBRARY_IMPL(dartree, CPU, m) { m.impl("expand_level", &expand_level_cpu); }

}  // namespace dartree
