// The arguments of one DARTree level (op expand_level, csrc/ops.cpp) as raw pointers, shared by
// the CPU kernel (dartree/cpu/expand_level.h), the CUDA launch (dartree/expand_level.cuh), the
// whole build (dartree/build_plan.h) and the CUDA emulator test. Plain C++17: no torch, no CUDA.
// ld_* are row strides in elements; an optional input is null when absent.
#pragma once
#include <cstdint>

namespace dartree {

// The element type of a GRU input table ([V, 3G], any float dtype).
enum class TableKind { kFloat, kDouble, kHalf, kBFloat16 };

template <typename T>
struct LevelArgs {
  int64_t f = 0, C = 0, E = 0, Q = 0, r = 0, G = 0;
  int64_t vocab = 0;                     // V, the table's rows (CUDA bounds the ids it reads)
  const T* parent_scores = nullptr;      // [f]
  const uint8_t* parent_live = nullptr;  // [f] or null (every parent live): CPU only, see select_level
  const T* states = nullptr;             // [f, G] contiguous, or null (no correction, no GRU)
  const T* z = nullptr;                  // [r], or null: an uncorrected level
  const T* w_s = nullptr;                // [r, G], rows ld_ws apart
  int64_t ld_ws = 0;
  const T* w2 = nullptr;                 // [C, r], rows ld_w2 apart; with w2_ids: [w2_rows, r]
  int64_t ld_w2 = 0;
  const int64_t* w2_ids = nullptr;       // null, or candidate j's row of w2 is w2_ids[j]
  int64_t w2_rows = 0;
  const T* b2 = nullptr;                 // indexed as the rows of w2, or null
  const T* base = nullptr;               // [C]
  const int64_t* ids = nullptr;          // [C]
  const void* table = nullptr;           // [V, 3G] rows ld_table apart, or null: no GRU step
  TableKind table_kind = TableKind::kFloat;
  int64_t ld_table = 0;
  const T* w_hh = nullptr;               // [3G, G], rows ld_hh apart
  int64_t ld_hh = 0;
  const T* b_hh = nullptr;               // [3G] or null
  // outputs
  int64_t* parent_pos = nullptr;         // [Q]
  int64_t* tokens = nullptr;             // [Q]
  T* scores = nullptr;                   // [Q]
  T* states_out = nullptr;               // [Q, G] (with a table)
};

}  // namespace dartree
