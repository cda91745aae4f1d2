// The CUDA level kernels' limits (dartree/expand_level.cuh), checked by the expand_level and
// build_dartree launchers before any launch.
#pragma once
#include "../tree_checks.h"
#include "dartree/block_topk.cuh"

namespace dartree {

inline void check_level_limits(int64_t f, int64_t C, int64_t E, int64_t Q, int64_t r, int64_t G,
                               const char* op) {
  TORCH_CHECK_VALUE(Q <= kMaxSelect, op, ": the CUDA kernel selects at most ", kMaxSelect,
                    " nodes per level, got ", Q);
  check_int_range(f * E, op, "frontier x num_expand");
  check_int_range(f * C, op, "frontier x candidates");
  check_int_range(3 * G, op, "3 x GRU width");
  check_int_range(r, op, "rank");
}

}  // namespace dartree
