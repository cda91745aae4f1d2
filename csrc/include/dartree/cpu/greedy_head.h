// Greedy decoding's output layer without its full float32 product (ops greedy_head and
// greedy_head_bounds; launcher: csrc/cpu/greedy_head.cpp; references: dartree/reference.py
// greedy_head_bounds and greedy_head).
//
// A greedy round reads one number of each row of logits: its argmax. In float32 the output
// layer's product x [T, K] W^T [K, V] is about a fifth of a verify row's arithmetic (SmolLM2: V
// 49,152, K 576), and a verify row runs at the FMA rate. Here an int8 copy of W (one scale per
// output column, codes + 128 as unsigned bytes) and x rounded to int8 per 32 values give every
// logit of every row by VPDPBUSD, 64 products an instruction against an FMA's 16, with a bound on
// its distance from the exact logit:
//
//   approx[r, c] = s_c * (sum_b sx[r, b] * sum_{k in b} (q[c, k] + 128) * xq[r, k]  -  offset_r)
//                  (offset_r = 128 * sum_b sx[r, b] * sum_{k in b} xq[r, k])
//   |exact[r, c] - approx[r, c]| <= bound[r, c]
//     = 1.001 * (err_c * |x_r|_2 + qnorm_c * |x_r - x~_r|_2 + fp_r * s_c) + 2^-20 * |approx|
//
// err_c = |w_c - s_c q_c|_2 and qnorm_c = |s_c q_c|_2 (the codes' builder,
// dartree/greedy_head.py) and x~ = sx * xq bound the two roundings by Cauchy-Schwarz; fp_r bounds
// the float32 rounding of both sums (RowTerms). Every column whose upper bound reaches the largest
// lower bound of its row is a candidate; the argmax is one of them, and so is every column that
// ties with it, since exact <= upper. The launcher computes the candidates' logits with
// packed_linear, whose bits do not depend on which columns a call holds, and takes the first of
// the largest (argmax_row's order). SmolLM2's edit answers (float32) had a median of 3 candidates
// a row, 223 at most.
//
// Codes layout: codes [G, K / 4, 64] uint8, G = ceil(V / 16): byte (g, k4, 4 j + t) holds
// q[16 g + j, 4 k4 + t] + 128 (VPDPBUSD's layout: 4 consecutive k of 16 columns a register).
// Columns past V are zero codes (128) with zero stats.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "exact_simd.h"

namespace dartree {
namespace cpu {
namespace greedy {

constexpr int kCols = 16;    // output columns a code group holds
constexpr int kBlock = 32;   // x values sharing one scale
constexpr int kMaxRows = 8;  // rows a tile takes

// A row's quantities in the bound (float: the tile's vector arithmetic), from quantize_row.
struct RowTerms {
  float offset;  // 128 * sum_b sx_b * sum_{k in b} xq_k
  float norm;    // |x|_2
  float delta;   // |x - x~|_2
  float fp;      // float32 rounding of both sums, per unit of s_c (see quantize_row)
};

// x [K] -> xq [K] int8, sx [K / 32] (max |x_b| / 127, so |xq| <= 127) and the row's terms.
// Returns false when x holds a NaN or an infinity, or a logit could overflow: the launcher then
// takes that row's exact product. The float32 rounding the bound allows, per unit of s_c:
//   the exact logit (any order of K products and sums): (K + 8) u sum_k |w_k x_k|
//                                                       <= (K + 8) u * 127 s_c * |x|_1
//   approx: D_b exact integers, |D_b| <= 255 sum_{k in b} |xq_k|; nb + 3 roundings over
//           magnitudes <= 383 * S (S = sum_b sx_b sum_{k in b} |xq_k|): (nb + 3) u * 383 S
// (u = 2^-24; 127 s_c >= max_k |w_ck| up to the 1.001 the bound carries).
inline bool quantize_row(const float* x, int64_t K, int8_t* xq, float* sx, RowTerms& terms) {
  const int64_t blocks = K / kBlock;
  double norm2 = 0, delta2 = 0, norm1 = 0, offset = 0, scaled = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    float top = 0;
    for (int k = 0; k < kBlock; ++k) {
      if (!std::isfinite(xb[k])) return false;
      top = std::max(top, std::fabs(xb[k]));
    }
    const float s = top / 127.0f;
    sx[b] = s;
    int64_t sum = 0, sum_abs = 0;
    for (int k = 0; k < kBlock; ++k) {
      const int v = s > 0 ? static_cast<int>(std::clamp(std::nearbyint(xb[k] / s), -127.0f, 127.0f)) : 0;
      xq[b * kBlock + k] = static_cast<int8_t>(v);
      sum += v;
      sum_abs += v < 0 ? -v : v;
      const double d = static_cast<double>(xb[k]) - static_cast<double>(s) * v;
      delta2 += d * d;
      norm2 += static_cast<double>(xb[k]) * xb[k];
      norm1 += std::fabs(static_cast<double>(xb[k]));
    }
    offset += 128.0 * s * static_cast<double>(sum);
    scaled += static_cast<double>(s) * static_cast<double>(sum_abs);
  }
  constexpr double u = 1.0 / (1 << 24);
  const double fp = u * (static_cast<double>(K + 8) * 127.0 * norm1 + static_cast<double>(blocks + 3) * 383.0 * scaled);
  terms = {static_cast<float>(offset), static_cast<float>(std::sqrt(norm2)), static_cast<float>(std::sqrt(delta2)),
           static_cast<float>(fp)};
  // |logit| <= max |w| * |x|_1, and a GGUF weight is below 2^24 (a float16 scale times a code):
  // every sum stays far from float32's range
  return norm1 < 1e28;
}

// One column's bounds from its code-group sum acc = sum_b sx_b D_b (the portable form of the
// tile's epilogue).
inline void column_bounds(float acc, const RowTerms& t, float scale, float err, float qnorm, float& upper,
                          float& lower) {
  const float a = scale * (acc - t.offset);
  const float b = 1.001f * (err * t.norm + qnorm * t.delta + t.fp * scale) + std::fabs(a) * (1.0f / (1 << 20));
  upper = a + b;
  lower = a - b;
}

// The portable tile: rows [mr] of xq [., K] / sx [., K / 32] / terms against one code group
// codes [K / 4, 64] with its 16 columns' scale, err, qnorm; upper [mr] rows of stride ld, lower
// likewise unless null, and row_max [mr][16] raised to every lower bound (lane j: column j).
inline void bounds_group_portable(const uint8_t* codes, const int8_t* xq, const float* sx, const RowTerms* terms,
                                  int mr, const float* scale, const float* err, const float* qnorm, int64_t K,
                                  float* upper, float* lower, int64_t ld, float* row_max) {
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < kCols; ++j) {
      float acc = 0;
      for (int64_t b = 0; b < K / kBlock; ++b) {
        int32_t d = 0;
        for (int k = 0; k < kBlock; ++k) {
          const int64_t kk = b * kBlock + k;
          d += static_cast<int32_t>(codes[(kk / 4) * 64 + j * 4 + kk % 4]) * xq[i * K + kk];
        }
        acc += static_cast<float>(d) * sx[i * (K / kBlock) + b];
      }
      float up, low;
      column_bounds(acc, terms[i], scale[j], err[j], qnorm[j], up, low);
      upper[i * ld + j] = up;
      if (lower != nullptr) lower[i * ld + j] = low;
      row_max[i * kCols + j] = std::max(row_max[i * kCols + j], low);
    }
}

#if DARTREE_X86 && defined(__GNUC__)
#define DARTREE_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))

inline bool has_avx512_vnni() {
  static const bool ok = has_avx512() && __builtin_cpu_supports("avx512vnni");
  return ok;
}

// bounds_group_portable with VPDPBUSD: MR rows share each 64-byte load of codes; a row's four x
// bytes are broadcast from memory. The lower bounds are kept as each row's running maximum, not
// written out (SmolLM2, 8 rows: 3 MB less to write and read again). Rows past mr repeat the last (computed, not stored). The int32
// sums of a block are exact (|D| <= 8 * 4 * 255 * 127 per lane), then scaled in float.
template <int MR>
DARTREE_VNNI DARTREE_HOT void bounds_group_vnni(const uint8_t* codes, const int8_t* xq, const float* sx,
                                                const RowTerms* terms, int mr, const float* scale,
                                                const float* err, const float* qnorm, int64_t K, float* upper,
                                                float* lower, int64_t ld, float* row_max) {
  const int64_t blocks = K / kBlock;
  const int8_t* x[MR];
  const float* s[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) x[i] = xq + std::min(i, mr - 1) * K, s[i] = sx + std::min(i, mr - 1) * blocks;
  __m512 acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i d[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) d[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int step = 0; step < kBlock / 4; ++step) {
      const __m512i w = _mm512_loadu_si512(codes + (b * (kBlock / 4) + step) * 64);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        int32_t four;
        std::memcpy(&four, x[i] + b * kBlock + step * 4, sizeof(four));
        d[i] = _mm512_dpbusd_epi32(d[i], w, _mm512_set1_epi32(four));
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[i]), _mm512_set1_ps(s[i][b]), acc[i]);
  }
  const __m512 sc = _mm512_loadu_ps(scale), e = _mm512_loadu_ps(err), qn = _mm512_loadu_ps(qnorm);
  const __m512 slack = _mm512_set1_ps(1.001f), rel = _mm512_set1_ps(1.0f / (1 << 20));
  for (int i = 0; i < mr; ++i) {
    const RowTerms& t = terms[i];
    const __m512 a = _mm512_mul_ps(sc, _mm512_sub_ps(acc[i], _mm512_set1_ps(t.offset)));
    __m512 b = _mm512_mul_ps(e, _mm512_set1_ps(t.norm));
    b = _mm512_fmadd_ps(qn, _mm512_set1_ps(t.delta), b);
    b = _mm512_fmadd_ps(sc, _mm512_set1_ps(t.fp), b);
    b = _mm512_fmadd_ps(_mm512_abs_ps(a), rel, _mm512_mul_ps(b, slack));
    const __m512 low = _mm512_sub_ps(a, b);
    _mm512_storeu_ps(upper + i * ld, _mm512_add_ps(a, b));
    if (lower != nullptr) _mm512_storeu_ps(lower + i * ld, low);
    _mm512_storeu_ps(row_max + i * kCols, _mm512_max_ps(_mm512_loadu_ps(row_max + i * kCols), low));
  }
}

// The columns c < n with upper[c] >= floor, ascending, appended to out (a vector-like with
// push_back). (AVX-512: the launcher takes the bounds only on an AVX512-VNNI CPU.)
template <typename Out>
DARTREE_VNNI void reaching(const float* upper, int64_t n, float floor, Out& out) {
  const __m512 f = _mm512_set1_ps(floor);
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(upper + c), f, _CMP_GE_OQ);
    while (m) {
      out.push_back(c + __builtin_ctz(m));
      m &= m - 1;
    }
  }
  for (; c < n; ++c)
    if (upper[c] >= floor) out.push_back(c);
}
#else
inline bool has_avx512_vnni() { return false; }
template <typename Out>
void reaching(const float* upper, int64_t n, float floor, Out& out) {
  for (int64_t c = 0; c < n; ++c)
    if (upper[c] >= floor) out.push_back(c);
}
#endif

}  // namespace greedy
}  // namespace cpu
}  // namespace dartree
