// CPU build of one round's whole DARTree (op build_dartree; the level walk: dartree/build_plan.h;
// the CUDA twin: dartree/build_dartree.cuh): every level's select_level and GRU step
// (expand_level.h), then pruning to the N - 1 best nodes (prune_tree.h), in one call -- a
// 16-level build costs one dispatch instead of ~150 small torch ops.
//
// out  tokens, parents, depths [N] int64 and scores [N] T (the pruned tree, parents first).
// Work: levels in order on the calling thread; inside a level the large GEMMs go through `par`.
// Bound pruning (depth_bonus <= 0): a child's key (score + bonus * depth) never exceeds its
// parent's, so once N - 1 keys are known, a node below the (N - 1)-th best so far can neither be
// kept nor have a kept descendant: its GRU step and its children's scoring are skipped (they
// enter the next selection as -inf, below every live pair, so every kept node keeps its rank and
// index), and a level with no live node ends the build. The result equals the unbounded build.
// Scratch: the unpruned tree (1 + sum(plan) rows), two [max_width, G] state buffers, LevelScratch.
// Returns 0, or 1 when a kept node's parent was pruned (scores must not grow from parent to child).
// Assumes the launcher checked every id the build reads (W_2 rows, input_table rows, the root).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "../build_plan.h"
#include "expand_level.h"
#include "gru.h"
#include "prune_tree.h"
#include "ranking.h"

namespace dartree {
namespace cpu {

template <typename T, typename Par>
int build_dartree(const BuildShape& s, const BuildInputs<T>& in, const BuildOutputs<T>& out,
                  const Par& par) {
  int64_t M = 1 + s.total;  // nodes built (fewer when bound pruning stops early)
  const int64_t G = s.G;
  const bool tracked = s.corrected || s.gru;
  std::vector<int64_t> tok(M), parent(M), dep(M), parent_pos(s.max_width);
  std::vector<T> sc(M), cur, nxt, w2_rows, b2_rows;
  tok[0] = *in.root, parent[0] = -1, dep[0] = 0, sc[0] = T(0);
  if (tracked) {
    cur.assign(s.max_width * G, T(0));
    nxt.resize(s.max_width * G);
    if (s.root_from_table) {  // GRU(input_table[root], 0): W_hh g = 0, so gh = b_hh
      std::vector<T> gi(3 * G), gh(3 * G, T(0)), zeros(G, T(0));
      table_row<T>(in.input_table, in.table_kind, in.ld_table, *in.root, 3 * G, gi.data());
      if (in.b_hh != nullptr) std::copy(in.b_hh, in.b_hh + 3 * G, gh.begin());
      gru_gates<T>(gi.data(), gh.data(), zeros.data(), cur.data(), G);
    } else {
      std::copy(in.root_state, in.root_state + G, cur.begin());
    }
  }
  if (s.corrected && s.w2_table) {  // a level's C rows of W_2 (and b_2) are copied out of the table
    w2_rows.resize(s.C * s.r);
    b2_rows.resize(s.C);
  }
  LevelScratch<T> scratch;
  const int64_t K = s.N - 1;
  const bool bounded = s.N < M && K > 0 && in.depth_bonus <= 0;
  std::vector<T> key_val(bounded ? K : 0);
  std::vector<int64_t> key_idx(bounded ? K : 0);
  TopN<T> best_keys(key_val.data(), key_idx.data(), bounded ? K : 0);
  std::vector<uint8_t> live(s.max_width, 1), next_live(s.max_width, 1);
  LevelCursor at;
  int64_t Q = 0;
  for (; at.d < s.L; at.advance(Q)) {
    LevelArgs<T> a = level_args(s, in, at);
    Q = a.Q;
    a.parent_scores = sc.data() + at.start;
    a.parent_live = bounded ? live.data() : nullptr;
    a.states = tracked ? cur.data() : nullptr;
    if (a.w2_ids != nullptr) {
      for (int64_t j = 0; j < s.C; ++j) {
        const int64_t id = a.w2_ids[j];
        std::copy(a.w2 + id * a.ld_w2, a.w2 + id * a.ld_w2 + s.r, w2_rows.data() + j * s.r);
        if (a.b2 != nullptr) b2_rows[j] = a.b2[id];
      }
      a.w2 = w2_rows.data();
      a.ld_w2 = s.r;
      a.w2_ids = nullptr;
      a.b2 = a.b2 != nullptr ? b2_rows.data() : nullptr;
    }
    a.parent_pos = parent_pos.data();
    a.tokens = tok.data() + at.placed;
    a.scores = sc.data() + at.placed;
    a.states_out = nxt.data();
    select_level(a, scratch, par);
    for (int64_t q = 0; q < a.Q; ++q) {
      parent[at.placed + q] = at.start + parent_pos[q];
      dep[at.placed + q] = at.d + 1;
    }
    int64_t live_count = a.Q;
    if (bounded) {
      // the same key as prune_tree: the product rounded before the sum
      volatile T step = static_cast<T>(in.depth_bonus) * static_cast<T>(at.d + 1);
      for (int64_t q = 0; q < a.Q; ++q) best_keys.push(sc[at.placed + q] + step, at.placed + q);
      live_count = 0;
      for (int64_t q = 0; q < a.Q; ++q) {
        next_live[q] = !(best_keys.full() && sc[at.placed + q] + step < key_val[0]);
        live_count += next_live[q];
      }
    }
    if (live_count == 0) {  // every later node is below the K-th best key
      at.advance(Q);
      break;
    }
    if (a.table != nullptr) gru_step(a, scratch, par, bounded ? next_live.data() : nullptr);
    std::swap(cur, nxt);
    std::swap(live, next_live);
  }
  M = at.placed;
  if (s.N == M) {
    std::copy(tok.begin(), tok.begin() + M, out.tokens);
    std::copy(parent.begin(), parent.begin() + M, out.parents);
    std::copy(dep.begin(), dep.begin() + M, out.depths);
    std::copy(sc.begin(), sc.begin() + M, out.scores);
    return 0;
  }
  std::vector<int64_t> kept(s.N), prune_scratch;
  std::vector<T> heap_scratch;
  const int status = prune_tree<T>(M, parent.data(), dep.data(), sc.data(),
                                   static_cast<T>(in.depth_bonus), s.N, kept.data(), out.parents,
                                   out.depths, nullptr, nullptr, nullptr, prune_scratch,
                                   heap_scratch);
  for (int64_t n = 0; n < s.N; ++n) {
    out.tokens[n] = tok[kept[n]];
    out.scores[n] = sc[kept[n]];
  }
  return status;
}

}  // namespace cpu
}  // namespace dartree
