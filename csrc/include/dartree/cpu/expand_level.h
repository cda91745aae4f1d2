// CPU DARTree level (the CUDA twin: dartree/expand_level.cuh; the formulas:
// dartree/reference.py::expand_level):
//
//   select_level: for the f frontier parents with states g [f, G] and scores s [f]:
//     mid [f, r] = SiLU(W_s g + z)                       (a corrected level; else no correction)
//     logits [f, C] = base + (W_2 mid + b2)              (an uncorrected level: base for every p)
//     S[p, j] = s_p + (logits[p, j] - logsumexp_C(logits[p]))   for j < E
//     the best Q pairs by ranking.h's order -> parent_pos [Q], tokens = ids[j] [Q], scores [Q]
//   gru_step: states_out [Q, G] = GRU(table[tokens[q]], g[parent_pos[q]])   (gru.h)
// Work: the two GEMMs that can be large (W_s g: r x G per live parent; W_hh g: 3G x G per distinct
// parent) are split over output rows by the launcher's `par` (nt_gemm.h); everything else runs on
// one thread (a level is latency, not FLOPs). Reads W_s, W_2, W_hh and the Q table rows once,
// writes Q (tokens, parents, scores) and Q x G states. Scratch: LevelScratch, reused across levels.
// Assumes 1 <= Q <= f * E, E <= C, and ids inside the table (the launcher checks them).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../level_args.h"
#include "gru.h"
#include "nt_gemm.h"
#include "ranking.h"
#include "simd.h"

namespace dartree {
namespace cpu {

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

// Scratch buffers reused across levels (grown, never shrunk).
template <typename T>
struct LevelScratch {
  std::vector<T> mid, logits, flat, gh, gi, lse, heap_val;
  std::vector<int64_t> heap_idx, order, slot_of;
  std::vector<const T*> rows;
};


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

}  // namespace cpu
}  // namespace dartree
