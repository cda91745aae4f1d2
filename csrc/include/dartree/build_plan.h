// The whole DARTree build of one round (op build_dartree, csrc/ops.cpp) as every launcher plans
// it: the CPU kernel (dartree/cpu/build_dartree.h), the CUDA launch (dartree/build_dartree.cuh)
// and, through the latter, the CUDA emulator test walk the same levels with the same arguments
// per level; they differ only in how one level runs. Plain C++17: no torch, no CUDA.
//
// Tree rows: the root is row 0; level d (d < L = len(plan)) places its Q_d = plan[d] nodes at rows
// [placed, placed + Q_d), placed = 1 + Q_0 + ... + Q_{d-1}, and their parents are the Q_{d-1}
// nodes of the level before (the root for d = 0), rows [start, start + f). Level d is corrected
// when the head has z and d >= prefix_len, and steps the GRU of its nodes when there is an input
// table and d + 1 < L (the last level's states are never read). Its candidates are slot d's:
// cand_values / cand_ids row d; W_2 rows are either slot d's gathered [C, r] block or rows
// cand_ids[d, j] of the head's whole W_2 table.
#pragma once
#include <cstdint>

#include "level_args.h"

namespace dartree {

// Sizes of a build, from the launchers' argument checks (csrc/tree_checks.h).
struct BuildShape {
  int64_t k, C, E, L, N, total, r, G, vocab, max_width;  // total = sum(plan), max_width = max(plan)
  bool corrected, gru;
  bool w2_table;     // w_2 is [V2, r] indexed by cand_ids (else [k, C, r] gathered)
  int64_t w2_rows;   // V2
  bool root_from_table;  // no root_state: it is GRU(input_table[root], 0)
};

// The inputs as raw pointers (device pointers on CUDA; `plan` is always on the host). ld_* are row
// strides in elements; optional inputs are null when absent.
template <typename T>
struct BuildInputs {
  const T* cand_values = nullptr;    // [k, C]
  const int64_t* cand_ids = nullptr;  // [k, C]
  const int64_t* root = nullptr;      // [1]
  const T* root_state = nullptr;      // [G], or null (no head, or root_from_table)
  const T* z = nullptr;               // [k, r] or null: no correction
  const T* w_s = nullptr;             // [r, G]
  int64_t ld_ws = 0;
  const T* w_2 = nullptr;             // [V2, r] or [k, C, r]
  int64_t ld_w2 = 0;                  // stride of w_2's first dim
  const T* b_2 = nullptr;             // [V2] or [k, C], or null
  const void* input_table = nullptr;  // [V, 3G] of table_kind, or null: no GRU
  TableKind table_kind = TableKind::kFloat;
  int64_t ld_table = 0;
  const T* w_hh = nullptr;            // [3G, G]
  int64_t ld_hh = 0;
  const T* b_hh = nullptr;            // [3G] or null
  const int64_t* plan = nullptr;      // [L], host memory
  int64_t prefix_len = 0;
  double depth_bonus = 0;
};

// The outputs, [N] each (status [1]).
template <typename T>
struct BuildOutputs {
  int64_t* tokens;
  int64_t* parents;
  int64_t* depths;
  T* scores;
  int32_t* status;
};

// Where the walk is: level d's parents are tree rows [start, start + width), its nodes go to
// rows from `placed` on.
struct LevelCursor {
  int64_t d = 0, start = 0, width = 1, placed = 1;
  void advance(int64_t placed_now) {
    start = placed;
    placed += placed_now;
    width = placed_now;
    ++d;
  }
};

// Level `at.d`'s candidates, head weights and sizes. The caller adds what lives in its own
// buffers: parent_scores, states (and parent_live), parent_pos, tokens, scores, states_out.
// With a W_2 table, w2_ids points at the candidates' ids (the CPU copies those rows out first).
template <typename T>
LevelArgs<T> level_args(const BuildShape& s, const BuildInputs<T>& in, const LevelCursor& at) {
  const int64_t d = at.d;
  LevelArgs<T> a;
  a.f = at.width, a.C = s.C, a.E = s.E, a.Q = in.plan[d], a.r = s.r, a.G = s.G, a.vocab = s.vocab;
  if (s.corrected && d >= in.prefix_len) {
    a.z = in.z + d * s.r;
    a.w_s = in.w_s;
    a.ld_ws = in.ld_ws;
    if (s.w2_table) {
      a.w2 = in.w_2;
      a.ld_w2 = in.ld_w2;
      a.w2_ids = in.cand_ids + d * s.C;
      a.w2_rows = s.w2_rows;
      a.b2 = in.b_2;
    } else {
      a.w2 = in.w_2 + d * s.C * s.r;
      a.ld_w2 = s.r;
      a.b2 = in.b_2 != nullptr ? in.b_2 + d * s.C : nullptr;
    }
  }
  a.base = in.cand_values + d * s.C;
  a.ids = in.cand_ids + d * s.C;
  if (s.gru && d + 1 < s.L) {
    a.table = in.input_table;
    a.table_kind = in.table_kind;
    a.ld_table = in.ld_table;
    a.w_hh = in.w_hh;
    a.ld_hh = in.ld_hh;
    a.b_hh = in.b_hh;
  }
  return a;
}

}  // namespace dartree
