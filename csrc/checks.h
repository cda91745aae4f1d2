// Argument checks shared by the CPU and CUDA launchers: every bad input becomes a TORCH_CHECK
// error naming the argument, never an out-of-bounds access.
#pragma once
#include <ATen/ATen.h>

namespace dartree {

// kv [..., S, D] contiguous; accepted int64 [A] on kv's device with 1 <= A and
// prefix_len + A <= S. With check_values (host-visible indices only), also
// accepted[0] == 0, strictly increasing, prefix_len + accepted[A-1] < S.
inline void check_kv_commit(const at::Tensor& kv, int64_t prefix_len, const at::Tensor& accepted,
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
  if (!check_values) return;
  const int64_t* idx = accepted.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(idx[0] == 0, "kv_commit: accepted[0] must be 0 (the root), got ", idx[0]);
  for (int64_t j = 1; j < count; ++j) {
    TORCH_CHECK_VALUE(idx[j] > idx[j - 1], "kv_commit: accepted must be strictly increasing, got ",
                idx[j - 1], " then ", idx[j], " at position ", j);
  }
  TORCH_CHECK_VALUE(prefix_len + idx[count - 1] < seq, "kv_commit: accepted index ", idx[count - 1],
              " at prefix_len ", prefix_len, " is outside the cache length ", seq);
}

}  // namespace dartree
