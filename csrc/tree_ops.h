// The op entry points of expand_level and build_dartree, one body for both devices: the schema's
// signature, the shape checks (tree_checks.h), the dtype dispatch and the tensors as the raw
// arguments of dartree/level_args.h and dartree/build_plan.h. `Device` (csrc/cpu/*.cpp,
// csrc/cuda/*.cu) adds what differs: its own checks (the CPU reads ids and raises; CUDA checks its
// kernels' limits) and how the level or the build runs.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

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

template <typename Device>
void expand_level_op(const at::Tensor& parent_scores, const std::optional<at::Tensor>& parent_states,
                     const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& w_s,
                     const std::optional<at::Tensor>& cand_w2,
                     const std::optional<at::Tensor>& cand_b2, const at::Tensor& cand_base,
                     const at::Tensor& cand_ids, int64_t num_expand,
                     const std::optional<at::Tensor>& input_table,
                     const std::optional<at::Tensor>& w_hh, const std::optional<at::Tensor>& b_hh,
                     at::Tensor parent_pos, at::Tensor tokens, at::Tensor scores, at::Tensor states) {
  const LevelShape s = check_expand_level(parent_scores, parent_states, z, w_s, cand_w2, cand_b2,
                                          cand_base, cand_ids, num_expand, input_table, w_hh, b_hh,
                                          parent_pos, tokens, scores, states);
  Device::check_expand_level(s, cand_ids);
  AT_DISPATCH_FLOATING_TYPES(parent_scores.scalar_type(), "expand_level", [&] {
    LevelArgs<scalar_t> a;
    a.f = s.f, a.C = s.C, a.E = s.E, a.Q = s.Q, a.r = s.r, a.G = s.G, a.vocab = s.vocab;
    a.parent_scores = parent_scores.data_ptr<scalar_t>();
    a.states = (s.corrected || s.gru) ? parent_states->data_ptr<scalar_t>() : nullptr;
    if (s.corrected) {
      a.z = z->data_ptr<scalar_t>();
      a.w_s = w_s->data_ptr<scalar_t>();
      a.ld_ws = w_s->stride(0);
      a.w2 = cand_w2->data_ptr<scalar_t>();
      a.ld_w2 = cand_w2->stride(0);
      a.b2 = data_or_null<scalar_t>(cand_b2);
    }
    a.base = cand_base.data_ptr<scalar_t>();
    a.ids = cand_ids.data_ptr<int64_t>();
    if (s.gru) {
      a.table = input_table->data_ptr();
      a.table_kind = table_kind(input_table->scalar_type());
      a.ld_table = input_table->stride(0);
      a.w_hh = w_hh->data_ptr<scalar_t>();
      a.ld_hh = w_hh->stride(0);
      a.b_hh = data_or_null<scalar_t>(b_hh);
      a.states_out = states.data_ptr<scalar_t>();
    }
    a.parent_pos = parent_pos.data_ptr<int64_t>();
    a.tokens = tokens.data_ptr<int64_t>();
    a.scores = scores.data_ptr<scalar_t>();
    Device::expand_level(parent_scores.device(), a);
  });
}

template <typename Device>
void build_dartree_op(const at::Tensor& cand_values, const at::Tensor& cand_ids, const at::Tensor& root,
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
  Device::check_build_dartree(s, cand_ids, root, prefix_len);
  AT_DISPATCH_FLOATING_TYPES(cand_values.scalar_type(), "build_dartree", [&] {
    const BuildOutputs<scalar_t> out{tokens.data_ptr<int64_t>(), parents.data_ptr<int64_t>(),
                                     depths.data_ptr<int64_t>(), scores.data_ptr<scalar_t>(),
                                     status.data_ptr<int32_t>()};
    BuildInputs<scalar_t> in;
    in.cand_values = cand_values.data_ptr<scalar_t>();
    in.cand_ids = cand_ids.data_ptr<int64_t>();
    in.root = root.data_ptr<int64_t>();
    in.root_state = data_or_null<scalar_t>(root_state);
    in.z = data_or_null<scalar_t>(z);
    if (w_s.has_value()) in.w_s = w_s->data_ptr<scalar_t>(), in.ld_ws = w_s->stride(0);
    if (w_2.has_value()) in.w_2 = w_2->data_ptr<scalar_t>(), in.ld_w2 = w_2->stride(0);
    in.b_2 = data_or_null<scalar_t>(b_2);
    if (input_table.has_value()) {
      in.input_table = input_table->data_ptr();
      in.table_kind = table_kind(input_table->scalar_type());
      in.ld_table = input_table->stride(0);
    }
    if (w_hh.has_value()) in.w_hh = w_hh->data_ptr<scalar_t>(), in.ld_hh = w_hh->stride(0);
    in.b_hh = data_or_null<scalar_t>(b_hh);
    in.plan = plan.data();
    in.prefix_len = prefix_len;
    in.depth_bonus = depth_bonus;
    Device::build_dartree(cand_values.device(), s, in, out);
  });
}

}  // namespace dartree
