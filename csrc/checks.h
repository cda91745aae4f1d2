// Argument checks shared by the CPU and CUDA launchers: every bad input becomes a TORCH_CHECK
// error naming the argument, never an out-of-bounds access.
#pragma once
#include <ATen/ATen.h>

namespace dartree {

// kv [..., S, D] contiguous; accepted int64 [A] on kv's device with 1 <= A and
// prefix_len + A <= S. With check_values (host-visible indices only), also
// accepted[0] == 0, strictly increasing, prefix_len + accepted[A-1] < S.
// Returns the number of [S, D] row groups (the product of kv's leading dims: no division, so an
// empty row, D = 0, is a clean no-op).
inline int64_t check_kv_commit(const at::Tensor& kv, int64_t prefix_len, const at::Tensor& accepted,
                               bool check_values) {
  TORCH_CHECK_VALUE(kv.dim() >= 2, "kv_commit: kv must have at least 2 dims [..., S, D], got ",
              kv.sizes());
  TORCH_CHECK_VALUE(kv.is_contiguous(), "kv_commit: kv must be contiguous");
  TORCH_CHECK_VALUE(accepted.dim() == 1, "kv_commit: accepted must be 1-D, got ", accepted.sizes());
  TORCH_CHECK_VALUE(accepted.scalar_type() == at::kLong, "kv_commit: accepted must be int64, got ",
              accepted.scalar_type());
  TORCH_CHECK_VALUE(accepted.device() == kv.device(), "kv_commit: accepted is on ", accepted.device(),
              " but kv is on ", kv.device());
  TORCH_CHECK_VALUE(accepted.is_contiguous(), "kv_commit: accepted must be contiguous");
  const int64_t seq = kv.size(-2);
  const int64_t count = accepted.numel();
  TORCH_CHECK_VALUE(count >= 1, "kv_commit: accepted must hold at least the root, got 0 indices");
  TORCH_CHECK_VALUE(prefix_len >= 0 && prefix_len + count <= seq, "kv_commit: prefix_len ", prefix_len,
              " + ", count, " accepted rows exceeds the cache length ", seq);
  const int64_t groups = c10::multiply_integers(kv.sizes().slice(0, kv.dim() - 2));
  if (!check_values) return groups;
  const int64_t* idx = accepted.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(idx[0] == 0, "kv_commit: accepted[0] must be 0 (the root), got ", idx[0]);
  for (int64_t j = 1; j < count; ++j) {
    TORCH_CHECK_VALUE(idx[j] > idx[j - 1], "kv_commit: accepted must be strictly increasing, got ",
                idx[j - 1], " then ", idx[j], " at position ", j);
  }
  TORCH_CHECK_VALUE(prefix_len + idx[count - 1] < seq, "kv_commit: accepted index ", idx[count - 1],
              " at prefix_len ", prefix_len, " is outside the cache length ", seq);
  return groups;
}

// q [B, Hq, T, D], k and v [B, Hkv, S, D] of q's dtype, tree_mask bool [B, T, T], all on q's device;
// Hq % Hkv == 0, 0 <= prefix_len, prefix_len + T <= S. Strides are free: launchers copy what their
// kernel cannot read in place. On CUDA also D in {64, 128} and a 16- or 32-bit float dtype.
inline void check_tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& tree_mask, int64_t prefix_len) {
  TORCH_CHECK_VALUE(q.dim() == 4, "tree_attention: q must be [B, Hq, T, D], got ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == 4, "tree_attention: k must be [B, Hkv, S, D], got ", k.sizes());
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), "tree_attention: v must have k's shape ", k.sizes(),
                    ", got ", v.sizes());
  const auto dtype = q.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
                        dtype == at::kBFloat16,
                    "tree_attention: q must be float32, float64, float16 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(k.scalar_type() == dtype && v.scalar_type() == dtype,
                    "tree_attention: k and v must have q's dtype ", dtype, ", got ",
                    k.scalar_type(), " and ", v.scalar_type());
  for (const auto* t : {&k, &v, &tree_mask}) {
    TORCH_CHECK_VALUE(t->device() == q.device(), "tree_attention: ",
                      t == &k ? "k" : t == &v ? "v" : "tree_mask", " is on ", t->device(),
                      " but q is on ", q.device());
  }
  const int64_t batch = q.size(0), heads = q.size(1), size = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k.size(1), seq = k.size(2);
  TORCH_CHECK_VALUE(k.size(0) == batch, "tree_attention: k has batch ", k.size(0), ", q has ", batch);
  TORCH_CHECK_VALUE(k.size(3) == dim, "tree_attention: k has head dim ", k.size(3), ", q has ", dim);
  TORCH_CHECK_VALUE(dim >= 1, "tree_attention: head dim must be >= 1, got ", dim);
  TORCH_CHECK_VALUE(kv_heads >= 1 && heads % kv_heads == 0, "tree_attention: Hq ", heads,
                    " is not a multiple of Hkv ", kv_heads);
  TORCH_CHECK_VALUE(tree_mask.scalar_type() == at::kBool, "tree_attention: tree_mask must be bool, got ",
                    tree_mask.scalar_type());
  TORCH_CHECK_VALUE(tree_mask.dim() == 3 && tree_mask.size(0) == batch && tree_mask.size(1) == size &&
                        tree_mask.size(2) == size,
                    "tree_attention: tree_mask must be [", batch, ", ", size, ", ", size, "], got ",
                    tree_mask.sizes());
  TORCH_CHECK_VALUE(prefix_len >= 0 && prefix_len + size <= seq, "tree_attention: prefix_len ",
                    prefix_len, " + T ", size, " exceeds the key length ", seq);
}

}  // namespace dartree
