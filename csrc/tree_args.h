// The tensors of expand_level and build_dartree as the raw-pointer arguments of
// dartree/level_args.h and dartree/build_plan.h, for the CPU and the CUDA launchers alike (after
// csrc/tree_checks.h has checked them).
#pragma once
#include <ATen/ATen.h>

#include <optional>

#include "dartree/build_plan.h"
#include "dartree/level_args.h"
#include "tree_checks.h"

namespace dartree {

inline TableKind table_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return TableKind::kFloat;
    case at::kDouble: return TableKind::kDouble;
    case at::kHalf: return TableKind::kHalf;
    default: return TableKind::kBFloat16;
  }
}

template <typename T>
const T* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

template <typename T>
LevelArgs<T> expand_level_args(const LevelShape& s, const at::Tensor& parent_scores,
                               const std::optional<at::Tensor>& parent_states,
                               const std::optional<at::Tensor>& z,
                               const std::optional<at::Tensor>& w_s,
                               const std::optional<at::Tensor>& cand_w2,
                               const std::optional<at::Tensor>& cand_b2,
                               const at::Tensor& cand_base, const at::Tensor& cand_ids,
                               const std::optional<at::Tensor>& input_table,
                               const std::optional<at::Tensor>& w_hh,
                               const std::optional<at::Tensor>& b_hh, at::Tensor& parent_pos,
                               at::Tensor& tokens, at::Tensor& scores, at::Tensor& states) {
  LevelArgs<T> a;
  a.f = s.f, a.C = s.C, a.E = s.E, a.Q = s.Q, a.r = s.r, a.G = s.G, a.vocab = s.vocab;
  a.parent_scores = parent_scores.data_ptr<T>();
  a.states = (s.corrected || s.gru) ? parent_states->data_ptr<T>() : nullptr;
  if (s.corrected) {
    a.z = z->data_ptr<T>();
    a.w_s = w_s->data_ptr<T>();
    a.ld_ws = w_s->stride(0);
    a.w2 = cand_w2->data_ptr<T>();
    a.ld_w2 = cand_w2->stride(0);
    a.b2 = data_or_null<T>(cand_b2);
  }
  a.base = cand_base.data_ptr<T>();
  a.ids = cand_ids.data_ptr<int64_t>();
  if (s.gru) {
    a.table = input_table->data_ptr();
    a.table_kind = table_kind(input_table->scalar_type());
    a.ld_table = input_table->stride(0);
    a.w_hh = w_hh->data_ptr<T>();
    a.ld_hh = w_hh->stride(0);
    a.b_hh = data_or_null<T>(b_hh);
    a.states_out = states.data_ptr<T>();
  }
  a.parent_pos = parent_pos.data_ptr<int64_t>();
  a.tokens = tokens.data_ptr<int64_t>();
  a.scores = scores.data_ptr<T>();
  return a;
}

template <typename T>
BuildInputs<T> build_inputs(const at::Tensor& cand_values, const at::Tensor& cand_ids,
                            const at::Tensor& root, const std::optional<at::Tensor>& root_state,
                            const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& w_s,
                            const std::optional<at::Tensor>& w_2,
                            const std::optional<at::Tensor>& b_2,
                            const std::optional<at::Tensor>& input_table,
                            const std::optional<at::Tensor>& w_hh,
                            const std::optional<at::Tensor>& b_hh, at::IntArrayRef plan,
                            int64_t prefix_len, double depth_bonus) {
  BuildInputs<T> in;
  in.cand_values = cand_values.data_ptr<T>();
  in.cand_ids = cand_ids.data_ptr<int64_t>();
  in.root = root.data_ptr<int64_t>();
  in.root_state = data_or_null<T>(root_state);
  in.z = data_or_null<T>(z);
  if (w_s.has_value()) in.w_s = w_s->data_ptr<T>(), in.ld_ws = w_s->stride(0);
  if (w_2.has_value()) in.w_2 = w_2->data_ptr<T>(), in.ld_w2 = w_2->stride(0);
  in.b_2 = data_or_null<T>(b_2);
  if (input_table.has_value()) {
    in.input_table = input_table->data_ptr();
    in.table_kind = table_kind(input_table->scalar_type());
    in.ld_table = input_table->stride(0);
  }
  if (w_hh.has_value()) in.w_hh = w_hh->data_ptr<T>(), in.ld_hh = w_hh->stride(0);
  in.b_hh = data_or_null<T>(b_hh);
  in.plan = plan.data();
  in.prefix_len = prefix_len;
  in.depth_bonus = depth_bonus;
  return in;
}

}  // namespace dartree
