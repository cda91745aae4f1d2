// CPU kernels of the draft-tree ops (candidate top-k, one DARTree level, the whole DARTree build,
// pruning + verify layout, the verify walk), as templates on raw pointers with no torch headers:
// the csrc/cpu/*.cpp files check arguments and call these. Float32 takes AVX2/FMA paths when the
// CPU has them (simd.h); float64 and CPUs without AVX2 take plain loops.
//
// Orders shared with dartree/reference.py and the CUDA kernels:
//   ranks_before(a, i, b, j): a larger value first, NaN before every number, equal values (and
//   NaN against NaN) by the lower index -- the order of a stable descending sort.
// Callers validate every index before calling: these kernels trust parents, ids and plans.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace dartree {
namespace cpu {

template <typename T>
inline bool ranks_before(T a, int64_t ia, T b, int64_t ib) {
  const bool nan_a = std::isnan(a), nan_b = std::isnan(b);
  if (nan_a != nan_b) return nan_a;
  if (!nan_a && a != b) return a > b;
  return ia < ib;
}

// The best `n` entries of a stream fed in increasing index order: a binary heap whose root is the
// entry ranked last, so a new entry costs one comparison unless it enters.
template <typename T>
struct TopN {
  T* val;
  int64_t* idx;
  int64_t n;
  int64_t size = 0;

  TopN(T* v, int64_t* i, int64_t count) : val(v), idx(i), n(count) {}

  bool full() const { return size == n; }

  void push(T v, int64_t i) {
    if (size < n) {
      int64_t pos = size++;
      while (pos > 0) {  // sift up: parents rank after children
        const int64_t up = (pos - 1) / 2;
        if (!ranks_before(val[up], idx[up], v, i)) break;
        val[pos] = val[up];
        idx[pos] = idx[up];
        pos = up;
      }
      val[pos] = v;
      idx[pos] = i;
      return;
    }
    if (!ranks_before(v, i, val[0], idx[0])) return;
    int64_t pos = 0;
    for (;;) {  // sift down from the root
      const int64_t left = 2 * pos + 1;
      if (left >= n) break;
      int64_t worst = left;
      if (left + 1 < n && ranks_before(val[left], idx[left], val[left + 1], idx[left + 1])) {
        worst = left + 1;
      }
      if (!ranks_before(v, i, val[worst], idx[worst])) break;
      val[pos] = val[worst];
      idx[pos] = idx[worst];
      pos = worst;
    }
    val[pos] = v;
    idx[pos] = i;
  }

  // Best first. `order` is scratch of n int64.
  void sorted(int64_t* order) const {
    for (int64_t j = 0; j < size; ++j) order[j] = j;
    std::sort(order, order + size, [&](int64_t x, int64_t y) {
      return ranks_before(val[x], idx[x], val[y], idx[y]);
    });
  }
};

// ------------------------------------------------------------------------------------------------
// element loaders for the candidate top-k input (float, double, bfloat16, float16)

struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};

template <typename In>
struct Load;
template <>
struct Load<float> {
  using Acc = float;
  static float at(const float* p, int64_t i) { return p[i]; }
};
template <>
struct Load<double> {
  using Acc = double;
  static double at(const double* p, int64_t i) { return p[i]; }
};
template <>
struct Load<Bf16> {
  using Acc = float;
  static float at(const Bf16* p, int64_t i) { return bf16_to_float(p[i].bits); }
};
template <>
struct Load<Fp16> {
  using Acc = float;
  static float at(const Fp16* p, int64_t i) { return fp16_to_float(p[i].bits); }
};

// ------------------------------------------------------------------------------------------------
// candidate top-k of one row
//
// A pool of (value, index) pairs holds every entry that beat the threshold, the C-th best value
// seen so far; when the pool is full it is cut back to its C best (nth_element) and the threshold
// rises. Most entries cost one vector compare; the pool is cut a handful of times per row.

template <typename T>
struct Ranked {
  T value;
  int64_t index;
};

template <typename T>
inline bool ranked_before(const Ranked<T>& a, const Ranked<T>& b) {
  return ranks_before(a.value, a.index, b.value, b.index);
}

template <typename T>
struct Pool {
  Ranked<T>* items;
  int64_t keep, capacity;
  int64_t size = 0;
  T threshold;  // the keep-th best value once the pool has held `keep` entries

  // Cut to the `keep` best; afterwards an entry must rank before items[keep - 1] to matter.
  void cut() {
    std::nth_element(items, items + keep - 1, items + size, ranked_before<T>);
    size = keep;
    threshold = items[keep - 1].value;
  }
  void add(T v, int64_t i) {
    items[size++] = Ranked<T>{v, i};
    if (size == capacity) cut();
  }
};

// Scalar part of the scan: entries [begin, end) into the pool, max (NaN if any NaN) into row_max.
template <typename In>
void topk_scan_scalar(const In* x, int64_t begin, int64_t end, Pool<typename Load<In>::Acc>& pool,
                      typename Load<In>::Acc& row_max) {
  for (int64_t i = begin; i < end; ++i) {
    const auto v = Load<In>::at(x, i);
    if (!(v <= pool.threshold)) pool.add(v, i);  // larger, or NaN on either side
    if (!(v <= row_max)) row_max = std::isnan(row_max) ? row_max : v;
  }
}

template <typename Acc, typename In>
Acc sum_exp_scalar(const In* x, int64_t vocab, Acc shift) {
  Acc sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<Acc>(Load<In>::at(x, i)) - shift);
  return sum;
}

#if DARTREE_X86 && defined(__GNUC__)
template <typename In>
DARTREE_AVX2 inline __m256 load8_any(const In* p);
template <>
DARTREE_AVX2 inline __m256 load8_any<float>(const float* p) {
  return _mm256_loadu_ps(p);
}
template <>
DARTREE_AVX2 inline __m256 load8_any<Bf16>(const Bf16* p) {
  return load8_bf16(reinterpret_cast<const uint16_t*>(p));
}
template <>
DARTREE_AVX2 inline __m256 load8_any<Fp16>(const Fp16* p) {
  return load8_fp16(reinterpret_cast<const uint16_t*>(p));
}

template <typename In>
DARTREE_AVX2 void topk_scan_avx2(const In* x, int64_t begin, int64_t end, Pool<float>& pool,
                                 float& row_max) {
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  __m256 nan = _mm256_setzero_ps();
  __m256 thr = _mm256_set1_ps(pool.threshold);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 v = load8_any<In>(x + i);
    vmax = _mm256_max_ps(vmax, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, thr, _CMP_NLE_UQ));
    if (mask) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, v);
      do {
        const int lane = __builtin_ctz(mask);
        mask &= mask - 1;
        pool.add(lanes[lane], i + lane);
      } while (mask);
      thr = _mm256_set1_ps(pool.threshold);
    }
  }
  const float block_max = _mm256_movemask_ps(nan) ? NAN : hmax8(vmax);
  if (!(block_max <= row_max)) row_max = std::isnan(row_max) ? row_max : block_max;
  topk_scan_scalar<In>(x, i, end, pool, row_max);
}

// Max of each of `chunks` chunks of `width` (a multiple of 8) entries; false if a NaN is seen.
template <typename In>
DARTREE_AVX2 bool chunk_maxima_avx2(const In* x, int64_t chunks, int64_t width, float* maxima) {
  __m256 nan = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const In* row = x + c * width;
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    int64_t i = 0;
    for (; i + 16 <= width; i += 16) {
      const __m256 a = load8_any<In>(row + i), b = load8_any<In>(row + i + 8);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
      m0 = _mm256_max_ps(m0, a);
      m1 = _mm256_max_ps(m1, b);
    }
    if (i < width) {
      const __m256 a = load8_any<In>(row + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
      m0 = _mm256_max_ps(m0, a);
    }
    maxima[c] = hmax8(_mm256_max_ps(m0, m1));
  }
  return _mm256_movemask_ps(nan) == 0;
}

template <typename In>
DARTREE_AVX2 float sum_exp_avx2(const In* x, int64_t vocab, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= vocab; i += 16) {
    acc0 = _mm256_add_ps(acc0, exp8_nonpositive(_mm256_sub_ps(load8_any<In>(x + i), s)));
    acc1 = _mm256_add_ps(acc1, exp8_nonpositive(_mm256_sub_ps(load8_any<In>(x + i + 8), s)));
  }
  for (; i + 8 <= vocab; i += 8) {
    acc0 = _mm256_add_ps(acc0, exp8_nonpositive(_mm256_sub_ps(load8_any<In>(x + i), s)));
  }
  float sum = hsum8(_mm256_add_ps(acc0, acc1));
  for (; i < vocab; ++i) sum += std::exp(Load<In>::at(x, i) - shift);
  return sum;
}
#endif

// A value that at least `count` entries of the row reach: the count-th largest of the maxima of
// 4 * count equal chunks (count chunks have a maximum >= it). Starting the pool's threshold there
// instead of at -inf lets ~count entries into the pool instead of ~count * ln(vocab / count).
// Returns NaN (no bound) for short rows or rows with NaN. maxima: scratch of 4 * count.
template <typename In>
typename Load<In>::Acc chunk_bound(const In* x, int64_t vocab, int64_t count,
                                   typename Load<In>::Acc* maxima) {
  using Acc = typename Load<In>::Acc;
  const int64_t chunks = 4 * count;
  const int64_t width = (vocab / chunks) / 8 * 8;
  if (width < 8) return std::numeric_limits<Acc>::quiet_NaN();
#if DARTREE_X86 && defined(__GNUC__)
  if constexpr (!std::is_same<In, double>::value) {
    if (has_avx2()) {
      if (!chunk_maxima_avx2<In>(x, chunks, width, maxima)) return NAN;
      std::nth_element(maxima, maxima + count - 1, maxima + chunks, std::greater<Acc>());
      return maxima[count - 1];
    }
  }
#endif
  for (int64_t c = 0; c < chunks; ++c) {
    Acc m = -std::numeric_limits<Acc>::infinity();
    for (int64_t i = c * width; i < (c + 1) * width; ++i) {
      const Acc v = Load<In>::at(x, i);
      if (std::isnan(v)) return v;
      m = std::max(m, v);
    }
    maxima[c] = m;
  }
  std::nth_element(maxima, maxima + count - 1, maxima + chunks, std::greater<Acc>());
  return maxima[count - 1];
}

// Top `count` of row x[0, vocab): values (in Acc) and ids, best first, and the row's logsumexp
// when lse is not null. pool_items: scratch of at least 4 * count entries.
template <typename In>
void candidate_topk_row(const In* x, int64_t vocab, int64_t count, typename Load<In>::Acc* values,
                        int64_t* ids, typename Load<In>::Acc* lse,
                        Ranked<typename Load<In>::Acc>* pool_items) {
  using Acc = typename Load<In>::Acc;
  const Acc bound = chunk_bound<In>(x, vocab, count, reinterpret_cast<Acc*>(pool_items));
  // admit v >= bound; a NaN threshold admits everything (the compare is !(v <= threshold))
  const Acc start = (std::isnan(bound) || std::isinf(bound))
                        ? std::numeric_limits<Acc>::quiet_NaN()
                        : std::nextafter(bound, -std::numeric_limits<Acc>::infinity());
  Pool<Acc> pool{pool_items, count, 4 * count, 0, start};
  Acc row_max = -std::numeric_limits<Acc>::infinity();
  bool vector_done = false;
#if DARTREE_X86 && defined(__GNUC__)
  if constexpr (!std::is_same<In, double>::value) {
    if (has_avx2()) {
      topk_scan_avx2<In>(x, 0, vocab, pool, row_max);
      vector_done = true;
    }
  }
#endif
  if (!vector_done) topk_scan_scalar<In>(x, 0, vocab, pool, row_max);
  if (pool.size > count) pool.cut();
  std::sort(pool.items, pool.items + count, ranked_before<Acc>);
  for (int64_t j = 0; j < count; ++j) {
    values[j] = pool.items[j].value;
    ids[j] = pool.items[j].index;
  }
  if (lse == nullptr) return;
  if (std::isnan(row_max) || std::isinf(row_max)) {  // NaN, +inf, or a row of -inf
    *lse = row_max;
    return;
  }
  Acc sum;
#if DARTREE_X86 && defined(__GNUC__)
  if constexpr (!std::is_same<In, double>::value) {
    sum = has_avx2() ? sum_exp_avx2<In>(x, vocab, row_max) : sum_exp_scalar<Acc>(x, vocab, row_max);
  } else {
    sum = sum_exp_scalar<Acc>(x, vocab, row_max);
  }
#else
  sum = sum_exp_scalar<Acc>(x, vocab, row_max);
#endif
  *lse = row_max + std::log(sum);
}

// ------------------------------------------------------------------------------------------------
// small dense pieces: C[m, n] = sum_k A_m[k] * B[n * ldb + k] (A given as row pointers)

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

#if DARTREE_X86 && defined(__GNUC__)
DARTREE_AVX2 inline int64_t add_silu_avx2(float* x, const float* z, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(x + i, silu8(_mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(z + i))));
  }
  return i;
}

// max and sum(exp(x - max)) of a float row
DARTREE_AVX2 inline float logsumexp_avx2(const float* x, int64_t n) {
  __m256 vmax = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vmax = _mm256_max_ps(vmax, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float m = hmax8(vmax);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < n; ++j) {
    has_nan |= std::isnan(x[j]);
    m = std::max(m, x[j]);
  }
  if (has_nan) return NAN;
  if (std::isinf(m)) return m;
  const __m256 s = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    acc = _mm256_add_ps(acc, exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
  }
  float sum = hsum8(acc);
  for (; i < n; ++i) sum += std::exp(x[i] - m);
  return m + std::log(sum);
}
#endif

#if DARTREE_X86 && defined(__GNUC__)
DARTREE_AVX2 inline int64_t gru_gates_avx2(const float* gi, const float* gh, const float* g,
                                           float* out, int64_t width) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t j = 0;
  for (; j + 8 <= width; j += 8) {
    const __m256 reset = sigmoid8(_mm256_add_ps(_mm256_loadu_ps(gi + j), _mm256_loadu_ps(gh + j)));
    const __m256 update = sigmoid8(
        _mm256_add_ps(_mm256_loadu_ps(gi + width + j), _mm256_loadu_ps(gh + width + j)));
    const __m256 fresh = tanh8(_mm256_add_ps(
        _mm256_loadu_ps(gi + 2 * width + j),
        _mm256_mul_ps(reset, _mm256_loadu_ps(gh + 2 * width + j))));
    const __m256 keep = _mm256_mul_ps(update, _mm256_loadu_ps(g + j));
    _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(one, update), fresh), keep));
  }
  return j;
}
#endif

// x[i] = silu(x[i] + z[i])
template <typename T>
inline void add_silu(T* x, const T* z, int64_t n) {
  int64_t i = 0;
#if DARTREE_X86 && defined(__GNUC__)
  if constexpr (std::is_same<T, float>::value) {
    if (has_avx2()) i = add_silu_avx2(x, z, n);
  }
#endif
  for (; i < n; ++i) {
    const T v = x[i] + z[i];
    x[i] = v / (T(1) + std::exp(-v));
  }
}


// logsumexp of x[0, n): NaN if any NaN, the max when it is infinite (all -inf gives -inf).
template <typename T>
inline T logsumexp(const T* x, int64_t n) {
#if DARTREE_X86 && defined(__GNUC__)
  if constexpr (std::is_same<T, float>::value) {
    if (has_avx2()) return logsumexp_avx2(x, n);
  }
#endif
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return x[i];
    m = std::max(m, x[i]);
  }
  if (std::isinf(m)) return m;
  T sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(x[i] - m);
  return m + std::log(sum);
}

// GRU gates for one state: out = (1 - u) * n + u * g with r = sig(gi_r + gh_r),
// u = sig(gi_z + gh_z), n = tanh(gi_n + r * gh_n) (PyTorch's r, z, n gate order).
template <typename T>
inline void gru_gates(const T* gi, const T* gh, const T* g, T* out, int64_t width) {
  int64_t j = 0;
#if DARTREE_X86 && defined(__GNUC__)
  if constexpr (std::is_same<T, float>::value) {
    if (has_avx2()) j = gru_gates_avx2(gi, gh, g, out, width);
  }
#endif
  for (; j < width; ++j) {
    const T reset = T(1) / (T(1) + std::exp(-(gi[j] + gh[j])));
    const T update = T(1) / (T(1) + std::exp(-(gi[width + j] + gh[width + j])));
    const T fresh = std::tanh(gi[2 * width + j] + reset * gh[2 * width + j]);
    out[j] = (T(1) - update) * fresh + update * g[j];
  }
}


// ------------------------------------------------------------------------------------------------
// one DARTree level

enum class TableKind { kFloat, kDouble, kHalf, kBFloat16 };

template <typename T>
struct LevelArgs {
  int64_t f = 0, C = 0, E = 0, Q = 0, r = 0, G = 0;
  const T* parent_scores = nullptr;  // [f]
  const uint8_t* parent_live = nullptr;  // [f] or null (every parent live): see select_level
  const T* states = nullptr;         // [f, G] contiguous, or null (no correction, no GRU)
  const T* z = nullptr;              // [r], or null: an uncorrected level
  const T* w_s = nullptr;            // [r, G], rows ld_ws apart
  int64_t ld_ws = 0;
  const T* w2 = nullptr;  // [C, r], rows ld_w2 apart
  int64_t ld_w2 = 0;
  const T* b2 = nullptr;           // [C] or null
  const T* base = nullptr;         // [C]
  const int64_t* ids = nullptr;    // [C]
  const void* table = nullptr;     // [V, 3G] rows ld_table apart, or null: no GRU step
  TableKind table_kind = TableKind::kFloat;
  int64_t ld_table = 0;
  const T* w_hh = nullptr;  // [3G, G], rows ld_hh apart
  int64_t ld_hh = 0;
  const T* b_hh = nullptr;  // [3G] or null
  // outputs
  int64_t* parent_pos = nullptr;  // [Q]
  int64_t* tokens = nullptr;      // [Q]
  T* scores = nullptr;            // [Q]
  T* states_out = nullptr;        // [Q, G] (with a table)
};

// Scratch buffers reused across levels (grown, never shrunk).
template <typename T>
struct LevelScratch {
  std::vector<T> mid, logits, flat, gh, gi, lse, heap_val;
  std::vector<int64_t> heap_idx, order, slot_of;
  std::vector<const T*> rows;
};

template <typename T>
void table_row(const void* table, TableKind kind, int64_t ld, int64_t token, int64_t width, T* out) {
  switch (kind) {
    case TableKind::kFloat: {
      const float* row = static_cast<const float*>(table) + token * ld;
      for (int64_t j = 0; j < width; ++j) out[j] = static_cast<T>(row[j]);
      break;
    }
    case TableKind::kDouble: {
      const double* row = static_cast<const double*>(table) + token * ld;
      for (int64_t j = 0; j < width; ++j) out[j] = static_cast<T>(row[j]);
      break;
    }
    case TableKind::kHalf: {
      const uint16_t* row = static_cast<const uint16_t*>(table) + token * ld;
      for (int64_t j = 0; j < width; ++j) out[j] = static_cast<T>(fp16_to_float(row[j]));
      break;
    }
    case TableKind::kBFloat16: {
      const uint16_t* row = static_cast<const uint16_t*>(table) + token * ld;
      for (int64_t j = 0; j < width; ++j) out[j] = static_cast<T>(bf16_to_float(row[j]));
      break;
    }
  }
}

// Score every (parent p < f, candidate j < E) pair and keep the best Q: writes parent_pos, tokens
// and scores. See dartree/reference.py::expand_level for the formulas; this follows them operation
// by operation (c = base + (W_2 mid + b2), lp = c - lse, S = score_p + lp).
// A parent with parent_live[p] == 0 (when parent_live is set) is not scored: its pairs enter as
// -inf, which ranks them below every scored pair (build_levels uses this for bound pruning).
// par(n, cost, fn) runs fn(begin, end) over [0, n), maybe on several threads (cost = work per
// item); it splits the two GEMMs that can be large (W_s g and W_hh g) by output rows.
template <typename T, typename Par>
void select_level(const LevelArgs<T>& a, LevelScratch<T>& s, const Par& par) {
  const int64_t f = a.f, C = a.C, E = a.E, Q = a.Q, r = a.r, G = a.G;
  const auto live = [&](int64_t p) { return a.parent_live == nullptr || a.parent_live[p] != 0; };
  // 1. candidate logits per live parent: [f, C] (row k of the k-th live parent), or one shared
  // row when uncorrected
  const bool corrected = a.z != nullptr;
  const T* logits = a.base;
  int64_t row_stride = 0;
  s.rows.resize(std::max(f, Q));
  s.slot_of.assign(f, 0);
  int64_t scored = 0;
  for (int64_t p = 0; p < f; ++p) {
    if (live(p)) s.slot_of[p] = scored++;
  }
  if (corrected) {
    s.mid.resize(f * r);
    s.logits.resize(f * C);
    for (int64_t p = 0; p < f; ++p) {
      if (live(p)) s.rows[s.slot_of[p]] = a.states + p * G;
    }
    par(r, scored * G, [&](int64_t begin, int64_t end) {
      nt_gemm<T>(s.rows.data(), scored, a.w_s, a.ld_ws, begin, end, G, s.mid.data(), r);
    });
    for (int64_t k = 0; k < scored; ++k) add_silu<T>(s.mid.data() + k * r, a.z, r);
    for (int64_t k = 0; k < scored; ++k) s.rows[k] = s.mid.data() + k * r;
    nt_gemm<T>(s.rows.data(), scored, a.w2, a.ld_w2, 0, C, r, s.logits.data(), C);
    for (int64_t k = 0; k < scored; ++k) {
      T* row = s.logits.data() + k * C;
      if (a.b2 != nullptr) {
        for (int64_t j = 0; j < C; ++j) row[j] = a.base[j] + (row[j] + a.b2[j]);
      } else {
        for (int64_t j = 0; j < C; ++j) row[j] = a.base[j] + row[j];
      }
    }
    logits = s.logits.data();
    row_stride = C;
  }
  // 2. log-softmax over the C candidates, + parent score, streamed into the top-Q heap
  s.lse.resize(f);
  for (int64_t k = 0; k < scored; ++k) {
    s.lse[k] = (corrected || k == 0) ? logsumexp<T>(logits + k * row_stride, C) : s.lse[0];
  }
  s.heap_val.resize(Q);
  s.heap_idx.resize(Q);
  s.order.resize(Q);
  TopN<T> top(s.heap_val.data(), s.heap_idx.data(), Q);
  for (int64_t p = 0; p < f; ++p) {
    if (!live(p)) {
      for (int64_t j = 0; j < E; ++j) top.push(-std::numeric_limits<T>::infinity(), p * E + j);
      continue;
    }
    const int64_t k = s.slot_of[p];
    const T* row = logits + k * row_stride;
    const T score = a.parent_scores[p], lse = s.lse[k];
    for (int64_t j = 0; j < E; ++j) top.push(score + (row[j] - lse), p * E + j);
  }
  top.sorted(s.order.data());
  for (int64_t q = 0; q < Q; ++q) {
    const int64_t flat = s.heap_idx[s.order[q]];
    a.parent_pos[q] = flat / E;
    a.tokens[q] = a.ids[flat % E];
    a.scores[q] = s.heap_val[s.order[q]];
  }
}

// GRU step of the winners (a.table set): states_out[q] = GRU(table[tokens[q]], states[parent_pos[q]])
// for every winner with winner_live[q] != 0 (every winner when winner_live is null); the other
// rows of states_out are left as they are. W_hh g runs once per distinct parent (winners share
// parents often).
template <typename T, typename Par>
void gru_step(const LevelArgs<T>& a, LevelScratch<T>& s, const Par& par,
              const uint8_t* winner_live = nullptr) {
  const int64_t f = a.f, Q = a.Q, G = a.G;
  const auto live = [&](int64_t q) { return winner_live == nullptr || winner_live[q] != 0; };
  s.rows.resize(std::max(f, Q));
  s.slot_of.assign(f, -1);
  int64_t distinct = 0;
  for (int64_t q = 0; q < Q; ++q) {
    const int64_t p = a.parent_pos[q];
    if (live(q) && s.slot_of[p] < 0) {
      s.slot_of[p] = distinct;
      s.rows[distinct++] = a.states + p * G;
    }
  }
  s.gh.resize(distinct * 3 * G);
  par(3 * G, distinct * G, [&](int64_t begin, int64_t end) {
    nt_gemm<T>(s.rows.data(), distinct, a.w_hh, a.ld_hh, begin, end, G, s.gh.data(), 3 * G);
  });
  if (a.b_hh != nullptr) {
    for (int64_t u = 0; u < distinct; ++u) {
      T* row = s.gh.data() + u * 3 * G;
      for (int64_t j = 0; j < 3 * G; ++j) row[j] = row[j] + a.b_hh[j];
    }
  }
  s.gi.resize(3 * G);
  for (int64_t q = 0; q < Q; ++q) {
    if (!live(q)) continue;
    const int64_t p = a.parent_pos[q];
    table_row<T>(a.table, a.table_kind, a.ld_table, a.tokens[q], 3 * G, s.gi.data());
    gru_gates<T>(s.gi.data(), s.gh.data() + s.slot_of[p] * 3 * G, a.states + p * G,
                 a.states_out + q * G, G);
  }
}

// One level: the selection, then (with a table) the GRU step of every winner.
template <typename T, typename Par>
void expand_level(const LevelArgs<T>& a, LevelScratch<T>& s, const Par& par) {
  select_level(a, s, par);
  if (a.table != nullptr) gru_step(a, s, par);
}

// ------------------------------------------------------------------------------------------------
// pruning + verify layout

// Keep the root and the N - 1 nodes with the largest key = score + bonus * depth (ties: lower
// index), in index order. Writes kept/new_parents (and each optional layout output when not null).
// Returns 0, or 1 when a kept node's parent was pruned (new_parents then holds -1 there).
// parents must satisfy parents[0] == -1, 0 <= parents[i] < i (checked by the caller).
template <typename T>
int prune_tree(int64_t M, const int64_t* parents, const int64_t* depths, const T* scores, T bonus,
               int64_t N, int64_t* kept, int64_t* new_parents, int64_t* new_depths,
               int32_t* ancestors, int64_t* first_child, int64_t* next_sibling,
               std::vector<int64_t>& scratch, std::vector<T>& heap_scratch) {
  scratch.assign(M + 2 * N, 0);
  int64_t* remap = scratch.data();
  int64_t* order = remap + M;
  int64_t* heap_idx = order + N;
  heap_scratch.resize(N);
  const int64_t K = N - 1;
  kept[0] = 0;
  if (K > 0) {
    TopN<T> top(heap_scratch.data(), heap_idx, K);
    for (int64_t i = 1; i < M; ++i) {
      // the product is rounded before the sum, as in the reference (no fused multiply-add)
      volatile T step = bonus * static_cast<T>(depths[i]);
      top.push(scores[i] + step, i);
    }
    std::copy(heap_idx, heap_idx + K, kept + 1);
    std::sort(kept + 1, kept + N);
  }
  std::fill(remap, remap + M, -1);
  for (int64_t n = 0; n < N; ++n) remap[kept[n]] = n;
  int status = 0;
  new_parents[0] = -1;
  for (int64_t n = 1; n < N; ++n) {
    new_parents[n] = remap[parents[kept[n]]];
    if (new_parents[n] < 0) status = 1;
  }
  if (new_depths != nullptr) {
    for (int64_t n = 0; n < N; ++n) new_depths[n] = depths[kept[n]];
  }
  if (first_child != nullptr) {
    std::fill(first_child, first_child + N, -1);
    std::fill(next_sibling, next_sibling + N, -1);
    for (int64_t n = N - 1; n >= 1; --n) {  // descending: lists come out in index order
      const int64_t p = new_parents[n];
      if (p < 0) continue;
      next_sibling[n] = first_child[p];
      first_child[p] = n;
    }
  }
  if (ancestors != nullptr) {
    const int64_t words = (N + 31) / 32;
    std::fill(ancestors, ancestors + N * words, 0);
    for (int64_t n = 0; n < N; ++n) {
      int32_t* row = ancestors + n * words;
      const int64_t p = new_parents[n];
      if (p >= 0) std::copy(ancestors + p * words, ancestors + (p + 1) * words, row);
      row[n / 32] |= static_cast<int32_t>(1u << (n % 32));
    }
  }
  return status;
}

// ------------------------------------------------------------------------------------------------
// the verify walk

// From the root, move to the lowest-index child whose token equals target[cur] while one exists.
// Links (first_child/next_sibling) are built from parents when null. Writes accepted[0, a) and -1
// after, *count = a, *bonus = target[last]. Returns 0, or 1 for parents that are not a tree
// (parents[0] != -1 or parents[i] outside [0, i)), 2 for links that disagree with parents.
inline int verify_tree(int64_t T, const int64_t* parents, const int64_t* tokens,
                       const int64_t* target, const int64_t* first_child,
                       const int64_t* next_sibling, int64_t* accepted, int64_t* count,
                       int64_t* bonus, std::vector<int64_t>& scratch) {
  if (parents[0] != -1) return 1;
  for (int64_t i = 1; i < T; ++i) {
    if (parents[i] < 0 || parents[i] >= i) return 1;
  }
  if (first_child != nullptr) {  // links are -1 or a later node (as the CUDA kernel checks)
    for (int64_t i = 0; i < T; ++i) {
      const int64_t fc = first_child[i], ns = next_sibling[i];
      if ((fc != -1 && (fc <= i || fc >= T)) || (ns != -1 && (ns <= i || ns >= T))) return 2;
    }
  } else {
    scratch.assign(2 * T, -1);
    int64_t* fc = scratch.data();
    int64_t* ns = fc + T;
    for (int64_t i = T - 1; i >= 1; --i) {
      ns[i] = fc[parents[i]];
      fc[parents[i]] = i;
    }
    first_child = fc;
    next_sibling = ns;
  }
  int64_t a = 0, cur = 0;
  accepted[a++] = 0;
  for (;;) {
    const int64_t want = target[cur];
    int64_t next = -1;
    // links only move to higher indices, so the walk ends after at most T steps
    for (int64_t c = first_child[cur], prev = cur; c != -1; prev = c, c = next_sibling[c]) {
      if (c <= prev || c >= T || parents[c] != cur) return 2;
      if (tokens[c] == want) {
        next = c;
        break;
      }
    }
    if (next < 0) break;
    accepted[a++] = next;
    cur = next;
  }
  for (int64_t i = a; i < T; ++i) accepted[i] = -1;
  *count = a;
  *bonus = target[cur];
  return 0;
}

}  // namespace cpu
}  // namespace dartree
