// CPU launcher of build_dartree (kernel: dartree/cpu/build_dartree.h; the op body shared with
// CUDA: csrc/tree_ops.h): every id the build reads (W_2 rows, input_table rows, the root) is
// checked and raises, and so does a kept node whose parent was pruned.
#include <torch/library.h>

#include "../tree_ops.h"
#include "dartree/cpu/build_dartree.h"
#include "tree_parallel.h"

namespace dartree {

struct CpuBuild {
  static void check_build_dartree(const BuildShape& s, const at::Tensor& cand_ids,
                                  const at::Tensor& root, int64_t prefix_len) {
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
      TORCH_CHECK_VALUE(root_token >= 0 && root_token < s.vocab, "build_dartree: root token ",
                        root_token, " is outside the input_table vocabulary [0, ", s.vocab, ")");
    }
  }

  template <typename T>
  static void build_dartree(const at::Device&, const BuildShape& s, const BuildInputs<T>& in,
                            const BuildOutputs<T>& out) {
    const int result = cpu::build_dartree<T>(s, in, out, cpu::Parallel());
    TORCH_CHECK_VALUE(result == 0, "build_dartree: a kept node's parent was pruned; scores + "
                      "depth_bonus * depths must not increase from a parent to its child");
    out.status[0] = 0;
  }
};

TORCH_LIBRARY_IMPL(dartree, CPU, m) { m.impl("build_dartree", &build_dartree_op<CpuBuild>); }

}  // namespace dartree
