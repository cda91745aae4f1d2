// CPU DARTree levels: the per-level op (expand_level) and the whole build of one round
// (build_dartree: every level, then pruning, in one call -- a 16-level build costs one dispatch
// instead of ~150 small torch ops). Both run cpu::expand_level from tree_kernels.h.
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../tree_checks.h"
#include "tree_kernels.h"
#include "tree_parallel.h"

namespace dartree {

static cpu::TableKind table_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cpu::TableKind::kFloat;
    case at::kDouble: return cpu::TableKind::kDouble;
    case at::kHalf: return cpu::TableKind::kHalf;
    default: return cpu::TableKind::kBFloat16;
  }
}

template <typename T>
static const T* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

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
    cpu::LevelArgs<scalar_t> a;
    a.f = shape.f, a.C = shape.C, a.E = shape.E, a.Q = shape.Q, a.r = shape.r, a.G = shape.G;
    a.parent_scores = parent_scores.data_ptr<scalar_t>();
    a.states = (shape.corrected || shape.gru) ? parent_states->data_ptr<scalar_t>() : nullptr;
    if (shape.corrected) {
      a.z = z->data_ptr<scalar_t>();
      a.w_s = w_s->data_ptr<scalar_t>();
      a.ld_ws = w_s->stride(0);
      a.w2 = cand_w2->data_ptr<scalar_t>();
      a.ld_w2 = cand_w2->stride(0);
      a.b2 = ptr_or_null<scalar_t>(cand_b2);
    }
    a.base = cand_base.data_ptr<scalar_t>();
    a.ids = cand_ids.data_ptr<int64_t>();
    if (shape.gru) {
      a.table = input_table->data_ptr();
      a.table_kind = table_kind(input_table->scalar_type());
      a.ld_table = input_table->stride(0);
      a.w_hh = w_hh->data_ptr<scalar_t>();
      a.ld_hh = w_hh->stride(0);
      a.b_hh = ptr_or_null<scalar_t>(b_hh);
      a.states_out = states.data_ptr<scalar_t>();
    }
    a.parent_pos = parent_pos.data_ptr<int64_t>();
    a.tokens = tokens.data_ptr<int64_t>();
    a.scores = scores.data_ptr<scalar_t>();
    cpu::LevelScratch<scalar_t> scratch;
    cpu::expand_level(a, scratch, cpu::Parallel());
  });
}

template <typename T>
static void build_levels(const BuildShape& s, const at::Tensor& cand_values,
                         const at::Tensor& cand_ids, int64_t root,
                         const std::optional<at::Tensor>& root_state,
                         const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& w_s,
                         const std::optional<at::Tensor>& w_2,
                         const std::optional<at::Tensor>& b_2,
                         const std::optional<at::Tensor>& input_table,
                         const std::optional<at::Tensor>& w_hh,
                         const std::optional<at::Tensor>& b_hh, at::IntArrayRef plan,
                         int64_t prefix_len, double depth_bonus, at::Tensor& tokens,
                         at::Tensor& parents, at::Tensor& depths, at::Tensor& scores) {
  int64_t M = 1 + s.total;  // nodes built (fewer when bound pruning stops early)
  const int64_t G = s.G;
  const bool tracked = s.corrected || s.gru;
  std::vector<int64_t> tok(M), par(M), dep(M), parent_pos(s.max_width);
  std::vector<T> sc(M), cur, nxt, w2_rows, b2_rows;
  tok[0] = root, par[0] = -1, dep[0] = 0, sc[0] = T(0);
  if (tracked) {
    cur.assign(s.max_width * G, T(0));
    nxt.resize(s.max_width * G);
    if (s.root_from_table) {  // GRU(input_table[root], 0): W_hh g = 0, so gh = b_hh
      std::vector<T> gi(3 * G), gh(3 * G, T(0)), zeros(G, T(0));
      cpu::table_row<T>(input_table->data_ptr(), table_kind(input_table->scalar_type()),
                        input_table->stride(0), root, 3 * G, gi.data());
      if (b_hh.has_value()) std::copy(b_hh->data_ptr<T>(), b_hh->data_ptr<T>() + 3 * G, gh.begin());
      cpu::gru_gates<T>(gi.data(), gh.data(), zeros.data(), cur.data(), G);
    } else {
      std::copy(root_state->data_ptr<T>(), root_state->data_ptr<T>() + G, cur.begin());
    }
  }
  cpu::LevelArgs<T> a;
  a.C = s.C, a.E = s.E, a.r = s.r, a.G = G;
  if (s.corrected) {
    a.w_s = w_s->data_ptr<T>();
    a.ld_ws = w_s->stride(0);
    a.ld_w2 = s.r;
    if (s.w2_table) {  // this level's C rows of W_2 (and b_2) are copied out of the table
      w2_rows.resize(s.C * s.r);
      b2_rows.resize(s.C);
    }
  }
  if (s.gru) {
    a.table_kind = table_kind(input_table->scalar_type());
    a.ld_table = input_table->stride(0);
    a.w_hh = w_hh->data_ptr<T>();
    a.ld_hh = w_hh->stride(0);
    a.b_hh = ptr_or_null<T>(b_hh);
  }
  const T* values = cand_values.data_ptr<T>();
  const int64_t* ids = cand_ids.data_ptr<int64_t>();
  cpu::LevelScratch<T> scratch;
  // Bound pruning: the kept set is the best K = N - 1 keys (score + bonus * depth) of the whole
  // tree, and a child's key never exceeds its parent's (lp <= 0, bonus <= 0). Once K keys are
  // known, a node whose key is below the K-th best so far can neither be kept nor have a kept
  // descendant, so its GRU step and its children's scoring are skipped (the children enter the
  // next selection as -inf, below every live pair, so every kept node keeps its rank and index).
  // When no winner of a level is live, no later node can be kept and the build stops there.
  // The result equals the unbounded build exactly.
  const int64_t K = s.N - 1;
  const bool bounded = s.N < M && K > 0 && depth_bonus <= 0;
  std::vector<T> key_val(bounded ? K : 0);
  std::vector<int64_t> key_idx(bounded ? K : 0);
  cpu::TopN<T> best_keys(key_val.data(), key_idx.data(), bounded ? K : 0);
  std::vector<uint8_t> live(s.max_width, 1), next_live(s.max_width, 1);
  int64_t start = 0, width = 1, placed = 1;
  for (int64_t d = 0; d < s.L; ++d) {
    a.f = width;
    a.Q = plan[d];
    a.parent_scores = sc.data() + start;
    a.parent_live = bounded ? live.data() : nullptr;
    a.states = tracked ? cur.data() : nullptr;
    const bool corrected = s.corrected && d >= prefix_len;
    a.z = corrected ? z->data_ptr<T>() + d * s.r : nullptr;
    a.w2 = nullptr;
    a.b2 = nullptr;
    if (corrected && s.w2_table) {
      const T* table = w_2->data_ptr<T>();
      const int64_t ld = w_2->stride(0);
      for (int64_t j = 0; j < s.C; ++j) {
        const int64_t id = ids[d * s.C + j];
        std::copy(table + id * ld, table + id * ld + s.r, w2_rows.data() + j * s.r);
        if (b_2.has_value()) b2_rows[j] = b_2->data_ptr<T>()[id];
      }
      a.w2 = w2_rows.data();
      a.b2 = b_2.has_value() ? b2_rows.data() : nullptr;
    } else if (corrected) {
      a.w2 = w_2->data_ptr<T>() + d * s.C * s.r;
      a.b2 = b_2.has_value() ? b_2->data_ptr<T>() + d * s.C : nullptr;
    }
    a.base = values + d * s.C;
    a.ids = ids + d * s.C;
    a.table = s.gru && d + 1 < s.L ? input_table->data_ptr() : nullptr;
    a.parent_pos = parent_pos.data();
    a.tokens = tok.data() + placed;
    a.scores = sc.data() + placed;
    a.states_out = nxt.data();
    cpu::select_level(a, scratch, cpu::Parallel());
    for (int64_t q = 0; q < a.Q; ++q) {
      par[placed + q] = start + parent_pos[q];
      dep[placed + q] = d + 1;
    }
    int64_t live_count = a.Q;
    if (bounded) {
      // the same key as cpu::prune_tree: the product rounded before the sum
      volatile T step = static_cast<T>(depth_bonus) * static_cast<T>(d + 1);
      for (int64_t q = 0; q < a.Q; ++q) best_keys.push(sc[placed + q] + step, placed + q);
      live_count = 0;
      for (int64_t q = 0; q < a.Q; ++q) {
        next_live[q] = !(best_keys.full() && sc[placed + q] + step < key_val[0]);
        live_count += next_live[q];
      }
    }
    start = placed;
    placed += a.Q;
    width = a.Q;
    if (live_count == 0) break;  // every later node is below the K-th best key
    if (a.table != nullptr) cpu::gru_step(a, scratch, cpu::Parallel(), bounded ? next_live.data() : nullptr);
    std::swap(cur, nxt);
    std::swap(live, next_live);
  }
  M = placed;
  int64_t* out_tokens = tokens.data_ptr<int64_t>();
  int64_t* out_parents = parents.data_ptr<int64_t>();
  int64_t* out_depths = depths.data_ptr<int64_t>();
  T* out_scores = scores.data_ptr<T>();
  if (s.N == M) {
    std::copy(tok.begin(), tok.end(), out_tokens);
    std::copy(par.begin(), par.end(), out_parents);
    std::copy(dep.begin(), dep.end(), out_depths);
    std::copy(sc.begin(), sc.end(), out_scores);
    return;
  }
  std::vector<int64_t> kept(s.N), prune_scratch;
  std::vector<T> heap_scratch;
  const int status = cpu::prune_tree<T>(M, par.data(), dep.data(), sc.data(), static_cast<T>(depth_bonus),
                                        s.N, kept.data(), out_parents, out_depths, nullptr, nullptr,
                                        nullptr, prune_scratch, heap_scratch);
  TORCH_CHECK_VALUE(status == 0, "build_dartree: a kept node's parent was pruned; scores + "
                    "depth_bonus * depths must not increase from a parent to its child");
  for (int64_t n = 0; n < s.N; ++n) {
    out_tokens[n] = tok[kept[n]];
    out_scores[n] = sc[kept[n]];
  }
}

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
  AT_DISPATCH_FLOATING_TYPES(cand_values.scalar_type(), "build_dartree_cpu", [&] {
    build_levels<scalar_t>(s, cand_values, cand_ids, root_token, root_state, z, w_s, w_2, b_2,
                           input_table, w_hh, b_hh, plan, prefix_len, depth_bonus, tokens, parents,
                           depths, scores);
  });
  status.data_ptr<int32_t>()[0] = 0;
}

TORCH_LIBRARY_IMPL(dartree, CPU, m) {
  m.impl("expand_level", &expand_level_cpu);
  m.impl("build_dartree", &build_dartree_cpu);
}

}  // namespace dartree
