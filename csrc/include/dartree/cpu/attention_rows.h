// The query rows of tree attention as both CPU kernels walk them: the default kernel
// (tree_attention.h) and the batch-invariant one (exact_tree_attention.h) share the problem, the
// row walk and the row store, so that the two differ only in how a row's scores are reduced.
//
// q [B, Hq, T, D], k, v [B, Hkv, S, D] with unit d stride, mask bool [B, T, T] contiguous, keys
// [0, P) visible to every query and key P + j to query i where mask[b, i, j] (P = prefix, T =
// size). Grouped-query heads: KV head h serves query heads h * g .. h * g + g - 1, so its work
// is the g * T "rows" r = (query head h * g + r / T, tree query r % T), stacked in that order --
// the order of the output [B, Hq, T, D] == [B, Hkv, g * T, D], whose rows of one KV head are one
// contiguous block. acc_t: float32 (float64 for float64 inputs).
// Reads (per row) its query once; writes its D outputs once.
#pragma once
#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace dartree {
namespace cpu {

template <typename scalar_t>
using attention_acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename scalar_t>
struct AttentionProblem {
  const scalar_t* q;
  const scalar_t* k;
  const scalar_t* v;
  const bool* mask;  // contiguous [B, T, T]
  int64_t q_stride[4], k_stride[3], v_stride[3];  // k and v rows are contiguous (d stride 1)
  int64_t kv_heads, group, size, dim, prefix, keys, rows;  // keys = P + T, rows = g * T
  double scale;

  // Rows [r0, r1) of KV head h's g * T rows, pre-scaled, into out [r1 - r0, D] (the scale is
  // applied in double, then rounded: one rounding per element, the same in both kernels).
  template <typename acc_t>
  void load_queries(int64_t b, int64_t h, int64_t r0, int64_t r1, acc_t* out) const {
    for (int64_t r = r0; r < r1; ++r) {
      const scalar_t* src = q + b * q_stride[0] + (h * group + r / size) * q_stride[1] +
                            (r % size) * q_stride[2];
      acc_t* dst = out + (r - r0) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        dst[d] = static_cast<acc_t>(static_cast<acc_t>(src[d * q_stride[3]]) * scale);
      }
    }
  }
  // Row r's mask row: which of the T tree keys it sees.
  const bool* mask_row(int64_t b, int64_t r) const { return mask + (b * size + r % size) * size; }
  const scalar_t* k_head(int64_t b, int64_t h) const { return k + b * k_stride[0] + h * k_stride[1]; }
  const scalar_t* v_head(int64_t b, int64_t h) const { return v + b * v_stride[0] + h * v_stride[1]; }
};

// out = o / l, rounded to scalar_t; a row that saw no key (l = 0) gives zeros.
template <typename scalar_t, typename acc_t>
void store_row(const acc_t* o, acc_t l, int64_t dim, scalar_t* out) {
  const acc_t inv = l > 0 ? acc_t(1) / l : acc_t(0);
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<scalar_t>(o[d] * inv);
}

#if DARTREE_X86 && defined(__GNUC__)
// x[j] = exp(x[j] - shift) for j < n, returns their sum. exp goes through simd.h's polynomial for
// every element (the tail padded with -inf), so an element's value never depends on where it sits
// in the row; the sum is lane-blocked by j mod 8 with a fixed combine.
DARTREE_AVX2 inline float exp_sum_avx2(float* x, int64_t n, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + j), s));
    _mm256_storeu_ps(x + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (j < n) {
    alignas(32) float tail[8];
    const int64_t rest = n - j;
    for (int u = 0; u < 8; ++u) tail[u] = u < rest ? x[j + u] - shift : -INFINITY;
    const __m256 e = exp8_nonpositive(_mm256_load_ps(tail));
    _mm256_store_ps(tail, e);
    for (int64_t u = 0; u < rest; ++u) x[j + u] = tail[u];
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}
#endif

}  // namespace cpu
}  // namespace dartree
