// CPU launcher of build_dartree (kernel: dartree/cpu/build_dartree.h): checks every id the build
// reads (W_2 rows, input_table rows, the root) and raises on a bad one, then builds.
#include <torch/library.h>

#include "../tree_args.h"
#include "../tree_checks.h"
#include "dartree/cpu/build_dartree.h"
#include "tree_parallel.h"

namespace dartree {

void build_dartree_cpu(const at::Tensor& cand_values, const at::Tensor& cand_ids, const at::Tensor& root,
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
  if (s.corrected && s.w2_table) {  // every candidate of a corrected level reads its W_2 row
    for (int64_t d = prefix_len; d < s.L; ++d) {
      check_ids_in_vocab(cand_ids.data_ptr<int64_t>() + d * s.C, s.C, s.w2_rows, "build_dartree",
                         "W_2");
    }
  }
  if (s.gru) {  // the GRU reads input_table rows of the tokens picked at levels 0 .. L-2
    for (int64_t d = 0; d + 1 < s.L; ++d) {
      check_ids_in_vocab(cand_ids.data_ptr<int64_t>() + d * s.C, s.E, s.vocab, "build_dartree",
                         "input_table");
    }
  }
  const int64_t root_token = root.data_ptr<int64_t>()[0];
  if (s.root_from_table) {
    TORCH_CHECK_VALUE(root_token >= 0 && root_token < s.vocab, "build_dartree: root token ", root_token,
                      " is outside the input_table vocabulary [0, ", s.vocab, ")");
  }
  int result = 0;
  AT_DISPATCH_FLOATING_TYPES(cand_values.scalar_type(), "build_dartree_cpu", [&] {
    const BuildInputs<scalar_t> in = build_inputs<scalar_t>(
        cand_values, cand_ids, root, root_state, z, w_s, w_2, b_2, input_table, w_hh, b_hh, plan,
        prefix_len, depth_bonus);
    const BuildOutputs<scalar_t> out{tokens.data_ptr<int64_t>(), parents.data_ptr<int64_t>(),
                                     depths.data_ptr<int64_t>(), scores.data_ptr<scalar_t>(),
                                     status.data_ptr<int32_t>()};
    result = cpu::build_dartree<scalar_t>(s, in, out, cpu::Parallel());
  });
  TORCH_CHECK_VALUE(result == 0, "build_dartree: a kept node's parent was pruned; scores + "
                    "depth_bonus * depths must not increase from a parent to its child");
  status.data_ptr<int32_t>()[0] = 0;
}

TORCH_LIBRARY_IMPL(dartree, CPU, m) { m.impl("build_dartree", &build_dartree_cpu); }

}  // namespace dartree
