// Argument checks of the draft-tree ops, shared by the CPU and CUDA launchers: every bad shape,
// dtype, device, layout or size becomes a ValueError naming the argument, never an out-of-bounds
// access. Index *values* (parents, candidate ids) live on the device on CUDA, so they are checked
// here only when the caller can read them (the CPU kernels); the CUDA kernels bound every index
// they read and report bad ones through their status/count outputs instead.
#pragma once
#include <ATen/ATen.h>

#include <climits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "dartree/build_plan.h"

namespace dartree {

inline std::string shape_str(at::IntArrayRef shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

// t is a contiguous `dtype` tensor of exactly `shape` on `device`.
inline void expect_tensor(const at::Tensor& t, const char* op, const char* name,
                          at::IntArrayRef shape, at::ScalarType dtype, const at::Device& device) {
  TORCH_CHECK_VALUE(t.sizes() == shape, op, ": ", name, " must have shape ", shape_str(shape),
                    ", got ", shape_str(t.sizes()));
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
                    t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), " but the inputs are on ",
                    device);
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// A matrix [rows, cols] whose rows may be strided (a column slice of a weight) but whose elements
// within a row are adjacent.
inline void expect_matrix(const at::Tensor& t, const char* op, const char* name, int64_t rows,
                          int64_t cols, at::ScalarType dtype, const at::Device& device) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, op, ": ", name,
                    " must have shape [", rows, ", ", cols, "], got ", shape_str(t.sizes()));
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
                    t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), " but the inputs are on ",
                    device);
  TORCH_CHECK_VALUE((cols <= 1 || t.stride(1) == 1) && (rows <= 1 || t.stride(0) >= cols), op, ": ",
                    name, " must have unit stride along its last dim (rows may be strided)");
}

// A size the CUDA kernels index with int.
inline void check_int_range(int64_t value, const char* op, const char* what) {
  TORCH_CHECK_VALUE(value < INT_MAX, op, ": ", what, " = ", value, " is too large for the CUDA kernel");
}

inline bool is_compute_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble;
}

inline bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// ------------------------------------------------------------------------------------------------

// The GRU step's weights: input_table [V, 3G] (any float dtype), w_hh [3G, G] and b_hh [3G] in
// dtype. Returns V.
inline int64_t check_gru_weights(const at::Tensor& table, const std::optional<at::Tensor>& w_hh,
                                 const std::optional<at::Tensor>& b_hh, int64_t G, const char* op,
                                 at::ScalarType dtype, at::Device device) {
  TORCH_CHECK_VALUE(table.dim() == 2 && table.size(1) == 3 * G && table.size(0) >= 1, op,
                    ": input_table must be [V, 3G] = [V, ", 3 * G, "], got ", shape_str(table.sizes()));
  TORCH_CHECK_VALUE(is_float_dtype(table.scalar_type()), op,
                    ": input_table must be float32, float64, float16 or bfloat16, got ",
                    table.scalar_type());
  const int64_t vocab = table.size(0);
  expect_matrix(table, op, "input_table", vocab, 3 * G, table.scalar_type(), device);
  TORCH_CHECK_VALUE(w_hh.has_value(), op, ": a GRU step (input_table given) needs w_hh");
  expect_matrix(*w_hh, op, "w_hh", 3 * G, G, dtype, device);
  if (b_hh.has_value()) expect_tensor(*b_hh, op, "b_hh", {3 * G}, dtype, device);
  return vocab;
}

// Returns C.
inline int64_t check_candidate_topk(const at::Tensor& logits, const at::Tensor& values,
                                    const at::Tensor& ids, const at::Tensor& lse) {
  constexpr const char* op = "candidate_topk";
  TORCH_CHECK_VALUE(logits.dim() == 2, op, ": logits must be a float [k, V] tensor, got ",
                    shape_str(logits.sizes()));
  TORCH_CHECK_VALUE(is_float_dtype(logits.scalar_type()), op,
                    ": logits must be float32, float64, float16 or bfloat16, got ", logits.scalar_type());
  TORCH_CHECK_VALUE(logits.is_contiguous(), op, ": logits must be contiguous");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK_VALUE(ids.dim() == 2, op, ": ids must be int64 [k, C], got ", shape_str(ids.sizes()));
  const int64_t count = ids.size(1);
  TORCH_CHECK_VALUE(count >= 1 && count <= vocab, op, ": num_candidates must be in [1, ", vocab,
                    "], got ", count);
  const auto compute = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto device = logits.device();
  expect_tensor(ids, op, "ids", {rows, count}, at::kLong, device);
  expect_tensor(values, op, "values", {rows, count}, compute, device);
  if (lse.numel() != 0 || rows == 0) {
    expect_tensor(lse, op, "lse", {rows}, compute, device);
  } else {
    TORCH_CHECK_VALUE(lse.device() == device, op, ": lse is on ", lse.device(), " but the inputs are on ",
                      device);
  }
  return count;
}

// Sizes of one level, derived from the arguments.
struct LevelShape {
  int64_t f, C, E, Q, r, G, vocab;
  bool corrected, gru;
};

inline LevelShape check_expand_level(const at::Tensor& parent_scores,
                                     const std::optional<at::Tensor>& parent_states,
                                     const std::optional<at::Tensor>& z,
                                     const std::optional<at::Tensor>& w_s,
                                     const std::optional<at::Tensor>& cand_w2,
                                     const std::optional<at::Tensor>& cand_b2,
                                     const at::Tensor& cand_base, const at::Tensor& cand_ids,
                                     int64_t num_expand, const std::optional<at::Tensor>& input_table,
                                     const std::optional<at::Tensor>& w_hh,
                                     const std::optional<at::Tensor>& b_hh,
                                     const at::Tensor& parent_pos, const at::Tensor& tokens,
                                     const at::Tensor& scores, const at::Tensor& states) {
  constexpr const char* op = "expand_level";
  LevelShape s{};
  TORCH_CHECK_VALUE(parent_scores.dim() == 1, op, ": parent_scores must be [f], got ",
                    shape_str(parent_scores.sizes()));
  const auto dtype = parent_scores.scalar_type();
  TORCH_CHECK_VALUE(is_compute_dtype(dtype), op, ": parent_scores must be float32 or float64, got ",
                    dtype);
  const auto device = parent_scores.device();
  s.f = parent_scores.size(0);
  TORCH_CHECK_VALUE(s.f >= 1, op, ": the frontier is empty (parent_scores has 0 entries)");
  expect_tensor(parent_scores, op, "parent_scores", {s.f}, dtype, device);
  TORCH_CHECK_VALUE(cand_base.dim() == 1 && cand_base.size(0) >= 1, op,
                    ": cand_base must be [C] with C >= 1, got ", shape_str(cand_base.sizes()));
  s.C = cand_base.size(0);
  expect_tensor(cand_base, op, "cand_base", {s.C}, dtype, device);
  expect_tensor(cand_ids, op, "cand_ids", {s.C}, at::kLong, device);
  TORCH_CHECK_VALUE(num_expand >= 1 && num_expand <= s.C, op, ": num_expand must be in [1, ", s.C,
                    "], got ", num_expand);
  s.E = num_expand;
  TORCH_CHECK_VALUE(parent_pos.dim() == 1, op, ": parent_pos must be int64 [Q], got ",
                    shape_str(parent_pos.sizes()));
  s.Q = parent_pos.size(0);
  TORCH_CHECK_VALUE(s.Q >= 1 && s.Q <= s.f * s.E, op, ": num_select must be in [1, ", s.f * s.E,
                    "], got ", s.Q);
  expect_tensor(parent_pos, op, "parent_pos", {s.Q}, at::kLong, device);
  expect_tensor(tokens, op, "tokens", {s.Q}, at::kLong, device);
  expect_tensor(scores, op, "scores", {s.Q}, dtype, device);
  s.corrected = z.has_value();
  s.gru = input_table.has_value();
  if (s.corrected || s.gru) {
    TORCH_CHECK_VALUE(parent_states.has_value() && parent_states->dim() == 2, op,
                      ": parent_states [f, G] are needed by the correction and the GRU step");
    s.G = parent_states->size(1);
    TORCH_CHECK_VALUE(s.G >= 1, op, ": parent_states must have G >= 1 columns");
    expect_tensor(*parent_states, op, "parent_states", {s.f, s.G}, dtype, device);
  }
  if (s.corrected) {
    TORCH_CHECK_VALUE(z->dim() == 1 && z->size(0) >= 1, op, ": z must be [r] with r >= 1, got ",
                      shape_str(z->sizes()));
    s.r = z->size(0);
    expect_tensor(*z, op, "z", {s.r}, dtype, device);
    TORCH_CHECK_VALUE(w_s.has_value() && cand_w2.has_value(), op,
                      ": a corrected level (z given) needs w_s and cand_w2");
    expect_matrix(*w_s, op, "w_s", s.r, s.G, dtype, device);
    expect_matrix(*cand_w2, op, "cand_w2", s.C, s.r, dtype, device);
    if (cand_b2.has_value()) expect_tensor(*cand_b2, op, "cand_b2", {s.C}, dtype, device);
  }
  if (s.gru) {
    s.vocab = check_gru_weights(*input_table, w_hh, b_hh, s.G, op, dtype, device);
    expect_tensor(states, op, "states", {s.Q, s.G}, dtype, device);
  } else {
    TORCH_CHECK_VALUE(states.numel() == 0, op,
                      ": states must be empty (numel 0) without an input_table, got ",
                      shape_str(states.sizes()));
  }
  return s;
}

// Host-visible ids only: candidate ids index a table (input_table, W_2).
inline void check_ids_in_vocab(const int64_t* ids, int64_t count, int64_t vocab, const char* op,
                               const char* table) {
  for (int64_t j = 0; j < count; ++j) {
    TORCH_CHECK_VALUE(ids[j] >= 0 && ids[j] < vocab, op, ": candidate id ", ids[j],
                      " is outside the ", table, " vocabulary [0, ", vocab, ")");
  }
}

// Returns (M, N).
inline std::pair<int64_t, int64_t> check_prune_tree(
    const at::Tensor& parents, const at::Tensor& depths, const at::Tensor& scores,
    const at::Tensor& kept, const at::Tensor& new_parents, const at::Tensor& new_depths,
    const at::Tensor& ancestors, const at::Tensor& first_child, const at::Tensor& next_sibling,
    const at::Tensor& status) {
  constexpr const char* op = "prune_tree";
  TORCH_CHECK_VALUE(parents.dim() == 1 && parents.size(0) >= 1, op,
                    ": parents must be int64 [M] with M >= 1, got ", shape_str(parents.sizes()));
  const int64_t M = parents.size(0);
  const auto device = parents.device();
  expect_tensor(parents, op, "parents", {M}, at::kLong, device);
  expect_tensor(depths, op, "depths", {M}, at::kLong, device);
  TORCH_CHECK_VALUE(is_compute_dtype(scores.scalar_type()), op,
                    ": scores must be float32 or float64, got ", scores.scalar_type());
  expect_tensor(scores, op, "scores", {M}, scores.scalar_type(), device);
  TORCH_CHECK_VALUE(kept.dim() == 1, op, ": kept must be int64 [N], got ", shape_str(kept.sizes()));
  const int64_t N = kept.size(0);
  TORCH_CHECK_VALUE(N >= 1 && N <= M, op, ": N = 1 + budget must be in [1, ", M,
                    "] (the root and at most all M - 1 other nodes), got ", N);
  expect_tensor(kept, op, "kept", {N}, at::kLong, device);
  expect_tensor(new_parents, op, "new_parents", {N}, at::kLong, device);
  expect_tensor(new_depths, op, "new_depths", {N}, at::kLong, device);
  expect_tensor(first_child, op, "first_child", {N}, at::kLong, device);
  expect_tensor(next_sibling, op, "next_sibling", {N}, at::kLong, device);
  expect_tensor(ancestors, op, "ancestors", {N, (N + 31) / 32}, at::kInt, device);
  expect_tensor(status, op, "status", {1}, at::kInt, device);
  return {M, N};
}

// CPU only: parents[0] == -1 and 0 <= parents[i] < i.
inline void check_parent_values(const int64_t* parents, int64_t count, const char* op) {
  TORCH_CHECK_VALUE(parents[0] == -1, op, ": parents[0] must be -1 (the root), got ", parents[0]);
  for (int64_t i = 1; i < count; ++i) {
    TORCH_CHECK_VALUE(parents[i] >= 0 && parents[i] < i, op, ": parents[", i, "] = ", parents[i],
                      " is out of range: parents must satisfy 0 <= parents[i] < i");
  }
}

// Returns T.
inline int64_t check_verify_tree(const at::Tensor& parents, const at::Tensor& tokens,
                                 const at::Tensor& target_tokens,
                                 const std::optional<at::Tensor>& first_child,
                                 const std::optional<at::Tensor>& next_sibling,
                                 const at::Tensor& accepted, const at::Tensor& num_accepted,
                                 const at::Tensor& bonus) {
  constexpr const char* op = "verify_tree";
  TORCH_CHECK_VALUE(parents.dim() == 1 && parents.size(0) >= 1, op,
                    ": parents must be a non-empty int64 [T] tensor, got ", shape_str(parents.sizes()));
  const int64_t T = parents.size(0);
  const auto device = parents.device();
  expect_tensor(parents, op, "parents", {T}, at::kLong, device);
  expect_tensor(tokens, op, "tokens", {T}, at::kLong, device);
  expect_tensor(target_tokens, op, "target_tokens", {T}, at::kLong, device);
  TORCH_CHECK_VALUE(first_child.has_value() == next_sibling.has_value(), op,
                    ": first_child and next_sibling must be given together");
  if (first_child.has_value()) {
    expect_tensor(*first_child, op, "first_child", {T}, at::kLong, device);
    expect_tensor(*next_sibling, op, "next_sibling", {T}, at::kLong, device);
  }
  expect_tensor(accepted, op, "accepted", {T}, at::kLong, device);
  expect_tensor(num_accepted, op, "num_accepted", {}, at::kLong, device);
  expect_tensor(bonus, op, "bonus", {}, at::kLong, device);
  return T;
}

inline BuildShape check_build_dartree(
    const at::Tensor& cand_values, const at::Tensor& cand_ids, const at::Tensor& root,
    const std::optional<at::Tensor>& root_state, const std::optional<at::Tensor>& z,
    const std::optional<at::Tensor>& w_s, const std::optional<at::Tensor>& w_2,
    const std::optional<at::Tensor>& b_2, const std::optional<at::Tensor>& input_table,
    const std::optional<at::Tensor>& w_hh, const std::optional<at::Tensor>& b_hh,
    int64_t num_expand, at::IntArrayRef plan, int64_t prefix_len, const at::Tensor& tokens,
    const at::Tensor& parents, const at::Tensor& depths, const at::Tensor& scores,
    const at::Tensor& status) {
  constexpr const char* op = "build_dartree";
  BuildShape s{};
  TORCH_CHECK_VALUE(cand_values.dim() == 2 && cand_values.size(0) >= 1 && cand_values.size(1) >= 1,
                    op, ": cand_values must be [k, C] with k, C >= 1, got ",
                    shape_str(cand_values.sizes()));
  const auto dtype = cand_values.scalar_type();
  TORCH_CHECK_VALUE(is_compute_dtype(dtype), op, ": cand_values must be float32 or float64, got ",
                    dtype);
  const auto device = cand_values.device();
  s.k = cand_values.size(0);
  s.C = cand_values.size(1);
  expect_tensor(cand_values, op, "cand_values", {s.k, s.C}, dtype, device);
  expect_tensor(cand_ids, op, "cand_ids", {s.k, s.C}, at::kLong, device);
  expect_tensor(root, op, "root", {1}, at::kLong, device);
  TORCH_CHECK_VALUE(num_expand >= 1 && num_expand <= s.C, op, ": num_expand must be in [1, ", s.C,
                    "], got ", num_expand);
  s.E = num_expand;
  s.L = static_cast<int64_t>(plan.size());
  TORCH_CHECK_VALUE(s.L >= 1 && s.L <= s.k, op, ": plan must have between 1 and k = ", s.k,
                    " levels, got ", s.L);
  TORCH_CHECK_VALUE(prefix_len >= 0, op, ": prefix_len must be >= 0, got ", prefix_len);
  int64_t frontier = 1;
  s.total = 0;
  s.max_width = 1;
  for (int64_t d = 0; d < s.L; ++d) {
    TORCH_CHECK_VALUE(plan[d] >= 1 && plan[d] <= frontier * s.E, op, ": plan[", d, "] = ", plan[d],
                      " must be in [1, ", frontier * s.E, "] (frontier ", frontier, " x num_expand ",
                      s.E, ")");
    frontier = plan[d];
    s.total += plan[d];
    s.max_width = std::max(s.max_width, plan[d]);
  }
  s.corrected = z.has_value();
  s.gru = input_table.has_value();
  if (s.corrected || s.gru) {
    if (root_state.has_value()) {
      TORCH_CHECK_VALUE(root_state->numel() >= 1 && (root_state->dim() == 1 ||
                        (root_state->dim() == 2 && root_state->size(0) == 1)),
                        op, ": root_state must be [G] or [1, G], got ", shape_str(root_state->sizes()));
      s.G = root_state->numel();
      expect_tensor(*root_state, op, "root_state", root_state->sizes(), dtype, device);
    } else {
      TORCH_CHECK_VALUE(s.gru && w_hh.has_value() && w_hh->dim() == 2 && w_hh->size(1) >= 1, op,
                        ": root_state [G] is needed by the correction (or give input_table and "
                        "w_hh: the root state is then GRU(input_table[root], 0))");
      s.G = w_hh->size(1);
      s.root_from_table = true;
    }
  }
  if (s.corrected) {
    TORCH_CHECK_VALUE(z->dim() == 2 && z->size(0) == s.k && z->size(1) >= 1, op,
                      ": z must be [k, r] = [", s.k, ", r], got ", shape_str(z->sizes()));
    s.r = z->size(1);
    expect_tensor(*z, op, "z", {s.k, s.r}, dtype, device);
    // level d >= 1 is corrected from its parents' states, which only the GRU (input_table) makes
    TORCH_CHECK_VALUE(s.gru || std::max<int64_t>(prefix_len, 1) >= s.L, op,
                      ": z corrects levels ", std::max<int64_t>(prefix_len, 1), " to ", s.L - 1,
                      " (prefix_len = ", prefix_len, ", ", s.L, " levels), which read the states "
                      "of their parents: give input_table and w_hh too (the GRU that makes them)");
    TORCH_CHECK_VALUE(w_s.has_value() && w_2.has_value(), op,
                      ": a corrected build (z given) needs w_s and w_2");
    expect_matrix(*w_s, op, "w_s", s.r, s.G, dtype, device);
    TORCH_CHECK_VALUE((w_2->dim() == 2 && w_2->size(0) >= 1) || w_2->dim() == 3, op,
                      ": w_2 must be [V2, r] (indexed by cand_ids) or [k, C, r], got ",
                      shape_str(w_2->sizes()));
    s.w2_table = w_2->dim() == 2;
    if (s.w2_table) {
      s.w2_rows = w_2->size(0);
      expect_matrix(*w_2, op, "w_2", s.w2_rows, s.r, dtype, device);
      if (b_2.has_value()) expect_tensor(*b_2, op, "b_2", {s.w2_rows}, dtype, device);
    } else {
      expect_tensor(*w_2, op, "w_2", {s.k, s.C, s.r}, dtype, device);
      if (b_2.has_value()) expect_tensor(*b_2, op, "b_2", {s.k, s.C}, dtype, device);
    }
  }
  if (s.gru) {
    s.vocab = check_gru_weights(*input_table, w_hh, b_hh, s.G, op, dtype, device);
  }
  TORCH_CHECK_VALUE(tokens.dim() == 1, op, ": tokens must be int64 [N], got ", shape_str(tokens.sizes()));
  s.N = tokens.size(0);
  TORCH_CHECK_VALUE(s.N >= 2 && s.N <= 1 + s.total, op, ": N = tokens.size(0) must be 1 + min(budget, ",
                    s.total, ") with budget >= 1, got ", s.N);
  expect_tensor(tokens, op, "tokens", {s.N}, at::kLong, device);
  expect_tensor(parents, op, "parents", {s.N}, at::kLong, device);
  expect_tensor(depths, op, "depths", {s.N}, at::kLong, device);
  expect_tensor(scores, op, "scores", {s.N}, dtype, device);
  expect_tensor(status, op, "status", {1}, at::kInt, device);
  return s;
}

}  // namespace dartree
