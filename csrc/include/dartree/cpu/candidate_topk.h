// CPU candidate top-k: the C best entries of each row of logits [k, V] and the row's logsumexp.
//
// candidate_topk_row(x [V], count = C) -> values [C] (float; double for double input), ids [C]
// int64 best first by ranking.h's order, *lse = logsumexp(x) when lse is not null.
// Work: one row per call (the launcher, csrc/cpu/candidate_topk.cpp, splits rows over threads).
// The maxima of 4C equal chunks give a bound that at least C entries reach; one pass (AVX2: 8
// compares at a time) sends the entries above it into a pool of 4C (value, index) pairs that is
// cut back to the C best with nth_element when full, and finds the row max; a last pass sums
// exp(x - max) when the logsumexp is wanted. Reads the row 2-3 times (once more with the lse),
// writes C values and ids; scratch pool_items of 4C entries from the caller.
// Assumes 1 <= C <= V. Inputs: float, double, or the bits of bfloat16 / float16 (Bf16, Fp16).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <type_traits>

#include "ranking.h"
#include "simd.h"

namespace dartree {
namespace cpu {

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

}  // namespace cpu
}  // namespace dartree
