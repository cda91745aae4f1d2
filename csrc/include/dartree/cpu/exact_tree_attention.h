// CPU batch-invariant tree attention (op exact_tree_attention; the CUDA twin:
// dartree/exact.cuh): the contract of tree_attention (csrc/ops.cpp), with every output row a
// function of its own logical key list alone. The rows, their walk and their store:
// attention_rows.h.
//
// A query row's logical key list is the prefix keys 0..P-1 followed by its tree ancestors and
// itself in depth (= index) order. The same query run as one token of a chain (T = 1, prefix =
// its position) has the same list, and so gets the same bits: nothing below depends on T, on P
// as a split point, on the other rows, on tiling or on the thread count.
//   score_j = fma chain over d = 0..D-1 of (q_d * scale) k_jd     (one rounding order per key)
//   m       = max_j score_j                                        (exact in any order)
//   p_j     = exp(score_j - m)                                     (elementwise)
//   l       = sum_j p_j, lane-blocked by logical index (lane = j mod 8, fixed combine)
//   o_d     = fma chain over the logical j of p_j v_jd;  out = o * (1 / l)
// Lane-wise FMA chains give the same bits at any vector width (16, 8 or 1 lanes): only the exp
// differs between the SIMD polynomial and std::exp, and each machine always takes one of them.
// The launcher's cap (DARTREE_EXACT_ISA, as for exact_linear) bounds the path, so a wide CPU also
// runs the tests of the narrower ones (tests/test_exact_ops.py::..._every_cpu_path).
//
// Work split: items (batch, KV head, block of row_block's of its g*T query rows) in parallel
// (`par`). An item computes scores of all its rows against all P + T keys in chunks of kChunk keys (K widened and
// transposed once per chunk, shared by its rows), compacts each row's tree scores to its
// ancestors, then accumulates P V over the prefix in chunks (V widened once per chunk; float V
// rows D apart, a cache's, are read in place) and over the row's ancestors. Accumulation is
// float32 (float64 for float64 inputs).
// Reads K and V once per item (P + T rows of D), q once; writes out once.
// Assumes the launcher's checks (csrc/checks.h::check_tree_attention), K/V rows with unit d stride.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_rows.h"
#include "exact_simd.h"

namespace dartree {
namespace cpu {
namespace exact_attn {

constexpr int64_t kChunk = 64;     // keys per chunk (a multiple of every lane count)
constexpr int64_t kRowBlock = 32;  // query rows per work item

// ------------------------------------------------------------------------------------------------
// The three inner loops, portable (std::fma, any acc_t) and SIMD (float).
//
// scores: out[r * ld + c] = fma chain over d of q[r * D + d] * kt[d * kChunk + c], c < kChunk
// pv:     o[d] = fma(p[j], v[j * D + d], o[d]) for j = 0..n-1 in order
// exp_sum: x[j] = exp(x[j] - shift) for j < n; returns their sum, lane-blocked by j mod 8

template <typename acc_t>
void scores_portable(const acc_t* q, int64_t rows, int64_t dim, const acc_t* kt, acc_t* out, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < kChunk; ++c) {
      acc_t s = 0;
      for (int64_t d = 0; d < dim; ++d) s = std::fma(q[r * dim + d], kt[d * kChunk + c], s);
      out[r * ld + c] = s;
    }
  }
}

template <typename acc_t>
void pv_portable(acc_t* o, const acc_t* p, const acc_t* v, int64_t n, int64_t dim) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < dim; ++d) o[d] = std::fma(p[j], v[j * dim + d], o[d]);
}

// pv on four rows (o [4, dim] row stride dim; p row i at p + i * ldp), one at a time.
template <typename acc_t, void (*pv)(acc_t*, const acc_t*, const acc_t*, int64_t, int64_t)>
void pv4_rows(acc_t* o, const acc_t* p, int64_t ldp, const acc_t* v, int64_t n, int64_t dim) {
  for (int i = 0; i < 4; ++i) pv(o + i * dim, p + i * ldp, v, n, dim);
}

// m = x[0], then m = x[j] > m ? x[j] : m for j = 1..n-1 (n >= 1): a NaN first sticks, a later one
// is skipped. The vector paths keep that lane by lane (max_ps(x, m) returns m where either is NaN)
// and combine their lanes the same way; they can differ from this loop only in the sign of a zero
// maximum, and x - (+0) equals x - (-0) for every x but a zero, whose exp is 1 either way.
template <typename acc_t>
acc_t max_portable(const acc_t* x, int64_t n) {
  acc_t best = x[0];
  for (int64_t j = 1; j < n; ++j) best = x[j] > best ? x[j] : best;
  return best;
}

template <typename acc_t>
acc_t exp_sum_portable(acc_t* x, int64_t n, acc_t shift) {
  acc_t lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] - shift);
    lanes[j % 8] += x[j];
  }
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

#if DARTREE_X86 && defined(__GNUC__)
// Four query rows share each load of the transposed keys (16 accumulators: 4 rows x 64 keys);
// every score is still one fma chain over d, so the rows' bits do not depend on the blocking.
DARTREE_AVX512 inline void scores4_avx512(const float* q, int64_t dim, const float* kt, float* out, int64_t ld) {
  __m512 a[4][4];
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < 4; ++c) a[i][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const float* kd = kt + d * kChunk;
    const __m512 k0 = _mm512_loadu_ps(kd), k1 = _mm512_loadu_ps(kd + 16);
    const __m512 k2 = _mm512_loadu_ps(kd + 32), k3 = _mm512_loadu_ps(kd + 48);
    for (int i = 0; i < 4; ++i) {
      const __m512 qd = _mm512_set1_ps(q[i * dim + d]);
      a[i][0] = _mm512_fmadd_ps(qd, k0, a[i][0]);
      a[i][1] = _mm512_fmadd_ps(qd, k1, a[i][1]);
      a[i][2] = _mm512_fmadd_ps(qd, k2, a[i][2]);
      a[i][3] = _mm512_fmadd_ps(qd, k3, a[i][3]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + i * ld + 16 * c, a[i][c]);
}

DARTREE_AVX512 inline void scores_avx512(const float* q, int64_t rows, int64_t dim, const float* kt, float* out,
                                  int64_t ld) {
  static_assert(kChunk == 64, "scores_avx512: four registers of 16 keys");
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) scores4_avx512(q + r * dim, dim, kt, out + r * ld, ld);
  for (; r < rows; ++r) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float* qr = q + r * dim;
    for (int64_t d = 0; d < dim; ++d) {
      const __m512 qd = _mm512_set1_ps(qr[d]);
      const float* kd = kt + d * kChunk;
      a0 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kd), a0);
      a1 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kd + 16), a1);
      a2 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kd + 32), a2);
      a3 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kd + 48), a3);
    }
    float* o = out + r * ld;
    _mm512_storeu_ps(o, a0);
    _mm512_storeu_ps(o + 16, a1);
    _mm512_storeu_ps(o + 32, a2);
    _mm512_storeu_ps(o + 48, a3);
  }
}

DARTREE_AVX512 inline void pv_avx512(float* o, const float* p, const float* v, int64_t n, int64_t dim) {
  int64_t d = 0;
  for (; d + 64 <= dim; d += 64) {  // four registers of o live across the keys
    __m512 o0 = _mm512_loadu_ps(o + d), o1 = _mm512_loadu_ps(o + d + 16);
    __m512 o2 = _mm512_loadu_ps(o + d + 32), o3 = _mm512_loadu_ps(o + d + 48);
    for (int64_t j = 0; j < n; ++j) {
      const __m512 pj = _mm512_set1_ps(p[j]);
      const float* vj = v + j * dim + d;
      o0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj), o0);
      o1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 16), o1);
      o2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 32), o2);
      o3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 48), o3);
    }
    _mm512_storeu_ps(o + d, o0);
    _mm512_storeu_ps(o + d + 16, o1);
    _mm512_storeu_ps(o + d + 32, o2);
    _mm512_storeu_ps(o + d + 48, o3);
  }
  for (; d < dim; d += 16) {
    const __mmask16 mask = dim - d >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (dim - d)) - 1);
    __m512 od = _mm512_maskz_loadu_ps(mask, o + d);
    for (int64_t j = 0; j < n; ++j)
      od = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_maskz_loadu_ps(mask, v + j * dim + d), od);
    _mm512_mask_storeu_ps(o + d, mask, od);
  }
}

// pv_avx512 for four rows at once over the same keys: o [4, dim] (row stride dim), p row i at
// p + i * ldp. Each v load serves the four rows (16 accumulators: 4 rows x 64 values of d); each
// o[i][d] is still one fma chain over j in order. dim % 64 != 0: one row at a time.
DARTREE_AVX512 inline void pv4_avx512(float* o, const float* p, int64_t ldp, const float* v, int64_t n,
                                      int64_t dim) {
  if (dim % 64 != 0) {
    for (int i = 0; i < 4; ++i) pv_avx512(o + i * dim, p + i * ldp, v, n, dim);
    return;
  }
  for (int64_t d = 0; d < dim; d += 64) {
    __m512 a[4][4];
    for (int i = 0; i < 4; ++i)
      for (int c = 0; c < 4; ++c) a[i][c] = _mm512_loadu_ps(o + i * dim + d + 16 * c);
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = v + j * dim + d;
      const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);
      const __m512 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
      for (int i = 0; i < 4; ++i) {
        const __m512 pj = _mm512_set1_ps(p[i * ldp + j]);
        a[i][0] = _mm512_fmadd_ps(pj, v0, a[i][0]);
        a[i][1] = _mm512_fmadd_ps(pj, v1, a[i][1]);
        a[i][2] = _mm512_fmadd_ps(pj, v2, a[i][2]);
        a[i][3] = _mm512_fmadd_ps(pj, v3, a[i][3]);
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + i * dim + d + 16 * c, a[i][c]);
  }
}

// max_portable's loop, 16 lanes: each lane the loop over its own j (a latency chain of one compare
// per key in the scalar loop; its rows' maxima were ~15% of a 12-row item at 300 keys).
DARTREE_AVX512 inline float max_avx512(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(x[0]);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) m = _mm512_max_ps(_mm512_loadu_ps(x + j), m);  // x > m ? x : m
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, m);
  float best = lanes[0];
  for (int u = 1; u < 16; ++u) best = lanes[u] > best ? lanes[u] : best;
  for (; j < n; ++j) best = x[j] > best ? x[j] : best;
  return best;
}

DARTREE_AVX2 inline float max_avx2(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(x[0]);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + j), m);  // x > m ? x : m
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float best = lanes[0];
  for (int u = 1; u < 8; ++u) best = lanes[u] > best ? lanes[u] : best;
  for (; j < n; ++j) best = x[j] > best ? x[j] : best;
  return best;
}

DARTREE_AVX2 inline void scores_avx2(const float* q, int64_t rows, int64_t dim, const float* kt, float* out,
                              int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < kChunk; c += 32) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      const float* qr = q + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const __m256 qd = _mm256_set1_ps(qr[d]);
        const float* kd = kt + d * kChunk + c;
        a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd), a0);
        a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd + 8), a1);
        a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd + 16), a2);
        a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd + 24), a3);
      }
      float* o = out + r * ld + c;
      _mm256_storeu_ps(o, a0);
      _mm256_storeu_ps(o + 8, a1);
      _mm256_storeu_ps(o + 16, a2);
      _mm256_storeu_ps(o + 24, a3);
    }
  }
}

DARTREE_AVX2 inline void pv_avx2(float* o, const float* p, const float* v, int64_t n, int64_t dim) {
  int64_t d = 0;
  for (; d + 32 <= dim; d += 32) {
    __m256 o0 = _mm256_loadu_ps(o + d), o1 = _mm256_loadu_ps(o + d + 8);
    __m256 o2 = _mm256_loadu_ps(o + d + 16), o3 = _mm256_loadu_ps(o + d + 24);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      const float* vj = v + j * dim + d;
      o0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj), o0);
      o1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8), o1);
      o2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 16), o2);
      o3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 24), o3);
    }
    _mm256_storeu_ps(o + d, o0);
    _mm256_storeu_ps(o + d + 8, o1);
    _mm256_storeu_ps(o + d + 16, o2);
    _mm256_storeu_ps(o + d + 24, o3);
  }
  for (; d < dim; ++d) {  // the same chain one lane at a time
    float od = o[d];
    for (int64_t j = 0; j < n; ++j) od = __builtin_fmaf(p[j], v[j * dim + d], od);
    o[d] = od;
  }
}

#endif  // DARTREE_X86

// ------------------------------------------------------------------------------------------------
// K transposed and K/V widened to acc_t per chunk. Widening is exact, so the vector path only
// changes the speed: at T = 1 these copies (P + T keys of one head, for 3 query rows) were most of
// the call, 30-120 us per layer on SmolLM2 shapes, done one element at a time.

#if DARTREE_X86 && defined(__GNUC__)
// 16 consecutive elements widened to float (bfloat16: the high half of a float; float16: F16C).
template <typename scalar_t>
DARTREE_AVX512 inline __m512 widen16(const scalar_t* src) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm512_loadu_ps(src);
  } else {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    if constexpr (Bits16Of<scalar_t>::value == Bits16::kBFloat16)
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    else
      return _mm512_cvtph_ps(half);
  }
}

// r[i] = row i of a 16 x 16 float block -> r[j] = its column j (unpacks, then 128-bit shuffles).
DARTREE_AVX512 inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
}

template <typename scalar_t>
DARTREE_AVX512 void transpose_keys_avx512(const scalar_t* keys, int64_t ld, int64_t n, int64_t dim, float* chunk) {
  __m512 r[16];
  for (int64_t c0 = 0; c0 < kChunk; c0 += 16) {
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
      for (int64_t i = 0; i < 16; ++i) r[i] = widen16(keys + std::min(c0 + i, n - 1) * ld + d0);
      transpose16(r);
      for (int64_t j = 0; j < 16; ++j) _mm512_storeu_ps(chunk + (d0 + j) * kChunk + c0, r[j]);
    }
  }
}

template <typename scalar_t>
DARTREE_AVX512 void widen_row_avx512(const scalar_t* src, int64_t dim, float* dst) {
  for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(dst + d, widen16(src + d));
}

#endif  // DARTREE_X86

// chunk[d * kChunk + c] = keys[min(c, n - 1) * ld + d] for c < kChunk, d < dim (rows past n repeat
// the last key: their scores are computed and never read).
// wide: AVX-512 copies allowed (InnerOps::wide_copies).
template <typename scalar_t, typename acc_t>
void transpose_keys(const scalar_t* keys, int64_t ld, int64_t n, int64_t dim, acc_t* chunk, bool wide) {
#if DARTREE_X86 && defined(__GNUC__)
  if constexpr (std::is_same_v<acc_t, float> && !std::is_same_v<scalar_t, double>) {
    if (wide && dim % 16 == 0) return transpose_keys_avx512(keys, ld, n, dim, chunk);
  }
#endif
  for (int64_t c = 0; c < kChunk; ++c) {
    const scalar_t* row = keys + std::min(c, n - 1) * ld;
    for (int64_t d = 0; d < dim; ++d) chunk[d * kChunk + c] = static_cast<acc_t>(row[d]);
  }
}

// dst[d] = src[d] for d < dim, widened.
template <typename scalar_t, typename acc_t>
void widen_row(const scalar_t* src, int64_t dim, acc_t* dst, bool wide) {
#if DARTREE_X86 && defined(__GNUC__)
  if constexpr (std::is_same_v<acc_t, float> && !std::is_same_v<scalar_t, double>) {
    if (wide && dim % 16 == 0) return widen_row_avx512(src, dim, dst);
  }
#endif
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<acc_t>(src[d]);
}

template <typename acc_t>
struct InnerOps {
  void (*scores)(const acc_t*, int64_t, int64_t, const acc_t*, acc_t*, int64_t);
  void (*pv)(acc_t*, const acc_t*, const acc_t*, int64_t, int64_t);
  void (*pv4)(acc_t*, const acc_t*, int64_t, const acc_t*, int64_t, int64_t);  // pv on 4 rows
  acc_t (*max)(const acc_t*, int64_t);  // n >= 1
  acc_t (*exp_sum)(acc_t*, int64_t, acc_t);
  bool wide_copies;  // keys and values widened with AVX-512
};

// The widest path the CPU and the launcher's cap allow (DARTREE_EXACT_ISA: avx2 1, avx512 2 and up).
template <typename acc_t>
InnerOps<acc_t> inner_ops(int cap) {
#if DARTREE_X86 && defined(__GNUC__)
  if constexpr (std::is_same_v<acc_t, float>) {
    if (cap >= 2 && has_avx512()) return {scores_avx512, pv_avx512, pv4_avx512, max_avx512, exp_sum_avx2, true};
    if (cap >= 1 && has_avx2()) return {scores_avx2, pv_avx2, pv4_rows<float, pv_avx2>, max_avx2, exp_sum_avx2, false};
  }
#endif
  return {scores_portable<acc_t>, pv_portable<acc_t>, pv4_rows<acc_t, pv_portable<acc_t>>,
          max_portable<acc_t>, exp_sum_portable<acc_t>, false};
}

// Rows [r0, r1) of the g*T rows of (batch b, KV head h) -> out rows (contiguous [rows, D] block).
template <typename scalar_t, typename acc_t>
void attend_rows(const AttentionProblem<scalar_t>& p, const InnerOps<acc_t>& inner, int64_t b,
                 int64_t h, int64_t r0, int64_t r1, scalar_t* out) {
  const int64_t n_rows = r1 - r0, dim = p.dim, size = p.size, prefix = p.prefix;
  const int64_t keys = prefix + size;
  const int64_t ld = (keys + kChunk - 1) / kChunk * kChunk;
  // A thread's buffers, kept from call to call (a decode step runs this for every KV head of
  // every layer): qs [rows, D], scores [rows, ld], chunk [kChunk, D], o [rows, D], sums [rows]
  thread_local std::vector<acc_t> qs, scores, chunk, o, sums;
  qs.resize(n_rows * dim);
  scores.resize(n_rows * ld);
  chunk.resize(kChunk * dim);
  o.assign(n_rows * dim, acc_t(0));
  sums.assign(n_rows, acc_t(0));

  p.load_queries(b, h, r0, r1, qs.data());
  const scalar_t* k_head = p.k_head(b, h);
  const scalar_t* v_head = p.v_head(b, h);

  // Scores against every key [0, P + T), K transposed per chunk: chunk[d * kChunk + c].
  for (int64_t start = 0; start < keys; start += kChunk) {
    const int64_t n = std::min(kChunk, keys - start);
    transpose_keys(k_head + start * p.k_stride[2], p.k_stride[2], n, dim, chunk.data(), inner.wide_copies);
    inner.scores(qs.data(), n_rows, dim, chunk.data(), scores.data() + start, ld);
  }

  // Each row's logical list: the prefix, then its visible tree keys in index order.
  for (int64_t rr = 0; rr < n_rows; ++rr) {
    const bool* allowed = p.mask_row(b, r0 + rr);
    acc_t* row = scores.data() + rr * ld;
    int64_t length = prefix;
    for (int64_t j = 0; j < size; ++j)
      if (allowed[j]) row[length++] = row[prefix + j];
    if (length == 0) continue;
    sums[rr] = inner.exp_sum(row, length, inner.max(row, length));
  }

  // O = P V over the prefix (V widened once per chunk for all rows), then each row's tree keys.
  // Float V rows D apart (a cache's) are read in place: their widening would be a copy.
  const bool in_place = std::is_same_v<scalar_t, acc_t> && p.v_stride[2] == dim;
  const auto v_rows = [&](int64_t first, int64_t n) -> const acc_t* {
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      if (in_place) return v_head + first * dim;
    }
    for (int64_t c = 0; c < n; ++c) widen_row(v_head + (first + c) * p.v_stride[2], dim, chunk.data() + c * dim, inner.wide_copies);
    return chunk.data();
  };
  for (int64_t start = 0; start < prefix; start += kChunk) {
    const int64_t n = std::min(kChunk, prefix - start);
    const acc_t* vc = v_rows(start, n);
    int64_t rr = 0;
    for (; rr + 4 <= n_rows; rr += 4)
      inner.pv4(o.data() + rr * dim, scores.data() + rr * ld + start, ld, vc, n, dim);
    for (; rr < n_rows; ++rr) inner.pv(o.data() + rr * dim, scores.data() + rr * ld + start, vc, n, dim);
  }
  for (int64_t rr = 0; rr < n_rows; ++rr) {
    const bool* allowed = p.mask_row(b, r0 + rr);
    int64_t at = prefix;
    for (int64_t j = 0; j < size; ++j) {
      if (!allowed[j]) continue;
      inner.pv(o.data() + rr * dim, scores.data() + rr * ld + at, v_rows(prefix + j, 1), 1, dim);
      ++at;
    }
    store_row(o.data() + rr * dim, sums[rr], dim, out + rr * dim);
  }
}

// The whole op: out [B, Hq, T, D] contiguous. par(begin, end, grain, fn) runs fn over a range,
// maybe on several threads (at::parallel_for).
// Query rows per work item: kRowBlock, or fewer where a few items would not fill the threads evenly
// (SmolLM2: 3 KV heads on 2 threads, one item each, kept one thread idle a third of a tree's call;
// a 24-node tree's 72 rows a head as 32 + 32 + 8 gave the threads 136 and 80 rows, 9% (float32) and
// 13% (bfloat16) slower than BLAS at 1500 keys; 4 blocks of 20 give them 112 and 104, 8% and 1%
// faster than BLAS, the two builds timed in turns). A smaller block transposes its keys
// again, so the split stops at 8 rows (a multiple of the 4-row tiles), and heads of fewer than 8
// rows (a decode step's 3: its 2 + 1 blocks measured no faster) or many items keep kRowBlock.
inline int64_t row_block(int64_t rows, int64_t heads, int64_t threads) {
  threads = std::max<int64_t>(threads, 1);
  const int64_t first = (rows + kRowBlock - 1) / kRowBlock;  // blocks a head at kRowBlock
  if (rows < 8 || heads * first >= 16 * threads) return kRowBlock;
  for (int64_t per_head = first;; ++per_head) {
    const int64_t block = std::max<int64_t>(8, ((rows + per_head - 1) / per_head + 3) / 4 * 4);
    if (block == 8 || heads * ((rows + block - 1) / block) % threads == 0) return block;
  }
}

template <typename scalar_t, typename Par>
void exact_tree_attention(const AttentionProblem<scalar_t>& p, int64_t batch, const Par& par,
                          scalar_t* out, int cap) {
  using acc_t = attention_acc_t<scalar_t>;
  const InnerOps<acc_t> inner = inner_ops<acc_t>(cap);
  const int64_t heads = batch * p.kv_heads;
  const int64_t block = row_block(p.rows, heads, par.threads());
  const int64_t blocks = (p.rows + block - 1) / block;
  // Output [B, Hq, T, D] contiguous == [B, Hkv, g*T, D]: a row block is one contiguous range.
  par(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t head = item / blocks, r0 = (item % blocks) * block;
      const int64_t r1 = std::min(p.rows, r0 + block);
      attend_rows<scalar_t, acc_t>(p, inner, head / p.kv_heads, head % p.kv_heads, r0, r1,
                                   out + (head * p.rows + r0) * p.dim);
    }
  });
}

}  // namespace exact_attn
}  // namespace cpu
}  // namespace dartree
