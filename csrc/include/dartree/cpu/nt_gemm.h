// The small dense products of a DARTree level: C[m, n] = sum_k A_m[k] * B[n * ldb + k], A given
// as m_count row pointers (the frontier's states or mid rows), B row-major [N, depth] with row
// stride ldb (W_s, W_2, W_hh), C row-major with row stride ldc.
//
// nt_gemm(a, m_count, b, ldb, n_begin, n_end, depth, c, ldc) writes columns [n_begin, n_end) of C,
// so a caller can split the columns over threads. Float32 with AVX2/FMA: B rows stream once in
// groups of 6 while the A rows (a few KB) stay in L1, in tiles of up to 4 x 3 (12 of the 16 ymm
// registers accumulate: 7 loads per 12 FMAs), reduced by one 8-way horizontal sum. Otherwise
// (float64, no AVX2): four interleaved partial sums per element.
// Reads B once and A once per 6 columns, writes C once. Assumes depth >= 0 and no aliasing.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace dartree {
namespace cpu {

template <typename T>
void nt_gemm_plain(const T* const* a, int64_t m_count, const T* b, int64_t ldb, int64_t n_count,
                   int64_t depth, T* c, int64_t ldc) {
  for (int64_t m = 0; m < m_count; ++m) {
    const T* row = a[m];
    for (int64_t n = 0; n < n_count; ++n) {
      const T* col = b + n * ldb;
      T s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      int64_t k = 0;
      for (; k + 4 <= depth; k += 4) {
        s0 += row[k] * col[k];
        s1 += row[k + 1] * col[k + 1];
        s2 += row[k + 2] * col[k + 2];
        s3 += row[k + 3] * col[k + 3];
      }
      for (; k < depth; ++k) s0 += row[k] * col[k];
      c[m * ldc + n] = (s0 + s1) + (s2 + s3);
    }
  }
}

#if DARTREE_X86 && defined(__GNUC__)
// Horizontal sums of 8 vectors at once: out[i] = sum of the lanes of v[i] (9 instructions
// instead of ~50 for eight separate reductions).
DARTREE_AVX2 inline __m256 hsum8x8(const __m256* v) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // lanes 0-3: low halves of v0..v3 | 4-7: high halves of v0..v3 (and likewise for v4..v7)
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

// One MR x NR tile: MR*NR accumulators of 8 lanes, reduced at the end. 4 x 3 uses 12 of the 16
// ymm registers for sums, 3 for B and 1 for A: 7 loads per 12 FMAs.
template <int MR, int NR>
DARTREE_AVX2 inline void nt_tile(const float* const* a, const float* b, int64_t ldb, int64_t depth,
                                 float* c, int64_t ldc) {
  __m256 acc[MR * NR];
  for (int i = 0; i < MR * NR; ++i) acc[i] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= depth; k += 8) {
    __m256 bv[NR];
    for (int j = 0; j < NR; ++j) bv[j] = _mm256_loadu_ps(b + j * ldb + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_loadu_ps(a[i] + k);
      for (int j = 0; j < NR; ++j) acc[i * NR + j] = _mm256_fmadd_ps(av, bv[j], acc[i * NR + j]);
    }
  }
  if (k < depth) {
    const __m256i mask = tail_mask(depth - k);
    __m256 bv[NR];
    for (int j = 0; j < NR; ++j) bv[j] = _mm256_maskload_ps(b + j * ldb + k, mask);
    for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_maskload_ps(a[i] + k, mask);
      for (int j = 0; j < NR; ++j) acc[i * NR + j] = _mm256_fmadd_ps(av, bv[j], acc[i * NR + j]);
    }
  }
  alignas(32) float sums[MR * NR + 8];
  int e = 0;
  for (; e + 8 <= MR * NR; e += 8) _mm256_store_ps(sums + e, hsum8x8(acc + e));
  for (; e < MR * NR; ++e) sums[e] = hsum8(acc[e]);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) c[i * ldc + j] = sums[i * NR + j];
}

// Up to 6 columns (B rows) of up to 4 A rows: two 4x3 or 3x3 tiles, or one 2x6 / 1x6 tile for the
// last rows, so that a short remainder still runs 6+ independent FMA chains.
template <int MR>
DARTREE_AVX2 inline void nt_tile_cols(int nr, const float* const* a, const float* b, int64_t ldb,
                                      int64_t depth, float* c, int64_t ldc) {
  if (MR <= 2 && nr == 6) {
    nt_tile<MR, 6>(a, b, ldb, depth, c, ldc);
    return;
  }
  while (nr > 0) {
    const int step = nr >= 3 ? 3 : nr;
    switch (step) {
      case 3: nt_tile<MR, 3>(a, b, ldb, depth, c, ldc); break;
      case 2: nt_tile<MR, 2>(a, b, ldb, depth, c, ldc); break;
      default: nt_tile<MR, 1>(a, b, ldb, depth, c, ldc); break;
    }
    nr -= step;
    b += step * ldb;
    c += step;
  }
}

DARTREE_AVX2 inline void nt_gemm_avx2(const float* const* a, int64_t m_count, const float* b,
                                      int64_t ldb, int64_t n_begin, int64_t n_end, int64_t depth,
                                      float* c, int64_t ldc) {
  // B rows stream once (outer loop, 6 at a time); the A rows (a few KB) stay in L1.
  for (int64_t n = n_begin; n < n_end; n += 6) {
    const int nr = static_cast<int>(std::min<int64_t>(6, n_end - n));
    const float* bn = b + n * ldb;
    for (int64_t m = 0; m < m_count; m += 4) {
      const int mr = static_cast<int>(std::min<int64_t>(4, m_count - m));
      float* cm = c + m * ldc + n;
      switch (mr) {
        case 4: nt_tile_cols<4>(nr, a + m, bn, ldb, depth, cm, ldc); break;
        case 3: nt_tile_cols<3>(nr, a + m, bn, ldb, depth, cm, ldc); break;
        case 2: nt_tile_cols<2>(nr, a + m, bn, ldb, depth, cm, ldc); break;
        default: nt_tile_cols<1>(nr, a + m, bn, ldb, depth, cm, ldc); break;
      }
    }
  }
}
#endif

// C[m, n] for n in [n_begin, n_end): the range lets a caller split the columns over threads.
template <typename T>
inline void nt_gemm(const T* const* a, int64_t m_count, const T* b, int64_t ldb, int64_t n_begin,
                    int64_t n_end, int64_t depth, T* c, int64_t ldc) {
#if DARTREE_X86 && defined(__GNUC__)
  if constexpr (std::is_same<T, float>::value) {
    if (has_avx2()) {
      nt_gemm_avx2(a, m_count, b, ldb, n_begin, n_end, depth, c, ldc);
      return;
    }
  }
#endif
  nt_gemm_plain<T>(a, m_count, b + n_begin * ldb, ldb, n_end - n_begin, depth,
                   c + n_begin, ldc);
}

}  // namespace cpu
}  // namespace dartree
