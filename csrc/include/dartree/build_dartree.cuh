// The whole DARTree build of one round on the GPU (op build_dartree; the level walk:
// dartree/build_plan.h; the CPU twin: dartree/cpu/build_dartree.h), as host code that launches
// the kernels of expand_level.cuh for every level and then prune_tree.cuh, all on one stream with
// no host sync: the plan is known on the host, every index the kernels read is bounded on the
// device, and a bad one raises `status` (2: a candidate id outside W_2 or input_table; 1: a kept
// node whose parent was pruned) instead of being read.
//
// Launches: a GRU step from a zero state for the root when root_state is not given (root state =
// GRU(input_table[root], 0)); per level mid (corrected levels), select (which also writes the
// level's tree rows, and level 0 the root's), GRU (levels that step it); then the prune + gather
// into the outputs when N < 1 + sum(plan) (otherwise the levels write the outputs directly).
// Scratch (from the launcher): the unpruned tree [1 + sum(plan)] when pruning, two state buffers
// [max_width, G] (levels alternate), mid [max_width, r], logits [max_width, C], flat
// [max_width, E], parent_pos [max_width], the prune's scratch.
// Launcher: csrc/cuda/launcher.h on a GPU; tests/cuda_emu/tree_ops_emu.cpp runs this same code
// under the emulator.
// Assumes the limits of the kernels (max_width, N - 1 <= kMaxSelect; sizes < 2^31), checked by the
// launcher.
#pragma once
#include <cstdint>
#include <type_traits>

#include "build_plan.h"
#include "expand_level.cuh"
#include "prune_tree.cuh"

namespace dartree {

template <typename T, typename Launcher>
void launch_build_dartree(Launcher& launcher, const BuildShape& s, const BuildInputs<T>& in,
                          const BuildOutputs<T>& out) {
  const int64_t M = 1 + s.total, W = s.max_width, G = s.G;
  const bool prune = s.N < M;
  const bool tracked = s.corrected || s.gru;
  // the unpruned tree: straight into the outputs when nothing is pruned
  int64_t* tok = prune ? launcher.template scratch<int64_t>(M, "tree tokens") : out.tokens;
  int64_t* par = prune ? launcher.template scratch<int64_t>(M, "tree parents") : out.parents;
  int64_t* dep = prune ? launcher.template scratch<int64_t>(M, "tree depths") : out.depths;
  T* sc = prune ? launcher.template scratch<T>(M, "tree scores") : out.scores;
  T* states = launcher.template scratch<T>(tracked ? 2 * W * G : 0, "states");
  const LevelBuffers<T> buffers{launcher.template scratch<T>(s.corrected ? W * s.r : 0, "mid"),
                                launcher.template scratch<T>(s.corrected ? W * s.C : 0, "logits"),
                                launcher.template scratch<T>(W * s.E, "flat")};
  int64_t* parent_pos = launcher.template scratch<int64_t>(W, "parent_pos");
  launcher.zero(out.status, sizeof(int32_t));  // kernels only raise it
  const T* root_state = in.root_state;
  if (s.root_from_table) {  // GRU(input_table[root], 0): one GRU launch from a zero state
    T* table_root_state = launcher.template scratch<T>(G, "root state");
    T* zero_state = launcher.template scratch<T>(G, "zero state");
    int64_t* zero_pos = launcher.template scratch<int64_t>(1, "zero pos");
    launcher.zero(zero_state, G * sizeof(T));
    launcher.zero(zero_pos, sizeof(int64_t));
    with_table(in.table_kind, in.input_table, [&](auto* rows) {
      using TableT = std::remove_const_t<std::remove_pointer_t<decltype(rows)>>;
      launcher.launch(dim3(blocks_for_warps(G)), dim3(kWarpThreads), 0, level_gru_kernel<T, TableT>, 1,
                      static_cast<int>(G), static_cast<const T*>(zero_state),
                      static_cast<const int64_t*>(zero_pos), in.root, rows, in.ld_table, s.vocab,
                      in.w_hh, in.ld_hh, in.b_hh, table_root_state, out.status);
    });
    root_state = table_root_state;
  }
  LevelCursor at;
  for (; at.d < s.L; at.advance(in.plan[at.d])) {
    LevelArgs<T> a = level_args(s, in, at);
    a.parent_scores = sc + at.start;
    a.states = !tracked ? nullptr : at.d == 0 ? root_state : states + ((at.d - 1) % 2) * W * G;
    a.parent_pos = parent_pos;
    a.tokens = tok + at.placed;
    a.scores = sc + at.placed;
    a.states_out = states + (at.d % 2) * W * G;
    SelectArgs<T> select = select_args(a, buffers);
    select.tree_parents = par + at.placed;
    select.tree_depths = dep + at.placed;
    select.parent_offset = at.start;
    select.depth = at.d + 1;
    select.status = out.status;
    if (at.d == 0) {
      select.root = in.root;
      select.root_row_token = tok, select.root_row_parent = par, select.root_row_depth = dep;
      select.root_row_score = sc;
    }
    launch_level(launcher, a, select, buffers, out.status);
  }
  if (!prune) return;
  PruneArgs<T> p{};
  p.M = static_cast<int>(M), p.N = static_cast<int>(s.N);
  p.parents = par, p.depths = dep, p.scores = sc;
  p.bonus = static_cast<T>(in.depth_bonus);
  p.kept = launcher.template scratch<int64_t>(s.N, "kept");
  p.new_parents = out.parents;
  p.new_depths = out.depths;
  p.status = out.status;
  p.raise_status = true;
  p.tokens = tok;
  p.tokens_out = out.tokens;
  p.scores_out = out.scores;
  launch_prune_tree(launcher, p);
}

}  // namespace dartree
