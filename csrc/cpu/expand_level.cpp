// CPU launcher of expand_level, one DARTree level (kernel: dartree/cpu/expand_level.h; the op body
// shared with CUDA: csrc/tree_ops.h): the candidate ids the GRU reads are checked and raise.
#include <torch/library.h>

#include "../tree_ops.h"
#include "dartree/cpu/expand_level.h"
#include "tree_parallel.h"

namespace dartree {

struct CpuLevel {
  static void check_expand_level(const LevelShape& s, const at::Tensor& cand_ids) {
    if (s.gru) {
      check_ids_in_vocab(cand_ids.data_ptr<int64_t>(), s.E, s.vocab, "expand_level", "input_table");
    }
  }

  template <typename T>
  static void expand_level(const at::Device&, const LevelArgs<T>& a) {
    cpu::LevelScratch<T> scratch;
    cpu::expand_level(a, scratch, cpu::Parallel());
  }
};

TORCH_LIBRARY_IMPL(dartree, CPU, m) { m.impl("expand_level", &expand_level_op<CpuLevel>); }

}  // namespace dartree
