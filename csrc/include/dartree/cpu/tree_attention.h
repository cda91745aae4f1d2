// CPU tree attention (the contract of op tree_attention, csrc/ops.cpp; the CUDA twin:
// dartree/tree_attention.cuh). The rows, their walk and their store: attention_rows.h.
//
// Work split: one work item = (batch b, KV head h, key range). Its g = Hq / Hkv query heads share
// h's keys, so the item stacks their g x T query rows into one [M = g*T, D] matrix and walks the key
// range in chunks of Kc rows: scores = Q K^T and O += P V are two GEMMs of useful size (M = 256 for
// 32 query heads over 8 KV heads and T = 64), each K/V chunk is read (and widened to float for
// 16-bit inputs) once for all M rows, and the softmax is online (running max m and sum l per row),
// so no [T, S] mask or score matrix is ever materialised. The tree mask is read only for chunks that
// reach the tree keys [P, P + T). Items run in parallel (`par`); when there are fewer KV heads than
// threads the key range is split too and the partial rows merged by log-sum-exp.
// Reads K and V once per item (P + T rows of D), q once, writes out once.
// The GEMMs are the launcher's (`gemm`, BLAS through ATen: csrc/cpu/tree_attention.cpp):
//   gemm.scores(q [M, D], k rows [n] (row stride k_ld), n, scores [M, n]):  scores = q k^T
//   gemm.accumulate(o [M, D], M, D, p [M, n], n, v rows [n] (row stride v_ld)):  o += p v
// Accumulation is float32 (float64 for float64 inputs). Assumes the launcher's checks
// (csrc/checks.h::check_tree_attention) and K/V rows with unit d stride.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_rows.h"
#include "simd.h"

namespace dartree {
namespace cpu {
namespace tree_attn {

template <typename acc_t>
acc_t row_max_portable(const acc_t* x, int64_t n) {
  acc_t m = -std::numeric_limits<acc_t>::infinity();
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// x[j] = exp(x[j] - shift), returns the sum; exp(-inf) == 0 for masked entries.
template <typename acc_t>
acc_t exp_sum_portable(acc_t* x, int64_t n, acc_t shift) {
  acc_t sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] - shift);
    sum += x[j];
  }
  return sum;
}

inline void widen_bf16_portable(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = bf16_to_float(src[j]);
}

inline void widen_f16_portable(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = fp16_to_float(src[j]);
}

#if DARTREE_X86 && defined(__GNUC__)
DARTREE_AVX2 inline float row_max_avx2(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float out = lanes[0];
  for (int u = 1; u < 8; ++u) out = lanes[u] > out ? lanes[u] : out;
  for (; j < n; ++j) out = x[j] > out ? x[j] : out;
  return out;
}

DARTREE_AVX2 inline void widen_bf16_avx2(const uint16_t* src, float* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, load8_bf16(src + j));
  widen_bf16_portable(src + j, dst + j, n - j);
}

DARTREE_AVX2 inline void widen_f16_avx2(const uint16_t* src, float* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, load8_fp16(src + j));
  widen_f16_portable(src + j, dst + j, n - j);
}
#endif  // DARTREE_X86

struct FloatRowOps {
  float (*row_max)(const float*, int64_t);
  float (*exp_sum)(float*, int64_t, float);
  void (*widen_bf16)(const uint16_t*, float*, int64_t);
  void (*widen_f16)(const uint16_t*, float*, int64_t);
};

inline const FloatRowOps& float_row_ops() {
  static const FloatRowOps ops = [] {
#if DARTREE_X86 && defined(__GNUC__)
    if (has_avx2()) return FloatRowOps{row_max_avx2, exp_sum_avx2, widen_bf16_avx2, widen_f16_avx2};
#endif
    return FloatRowOps{row_max_portable<float>, exp_sum_portable<float>, widen_bf16_portable,
                       widen_f16_portable};
  }();
  return ops;
}

// acc_t-typed front ends: float goes through the table above, double stays portable.
inline float row_max(const float* x, int64_t n) { return float_row_ops().row_max(x, n); }
inline double row_max(const double* x, int64_t n) { return row_max_portable(x, n); }
inline float exp_sum(float* x, int64_t n, float s) { return float_row_ops().exp_sum(x, n, s); }
inline double exp_sum(double* x, int64_t n, double s) { return exp_sum_portable(x, n, s); }

// Copy n rows of D elements (row stride ld) into a dense acc_t buffer.
template <typename scalar_t, typename acc_t>
void widen_rows(const scalar_t* src, int64_t ld, int64_t n, int64_t dim, acc_t* dst) {
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t* row = src + j * ld;
    acc_t* out = dst + j * dim;
    if constexpr (Bits16Of<scalar_t>::value == Bits16::kBFloat16) {
      float_row_ops().widen_bf16(reinterpret_cast<const uint16_t*>(row), out, dim);
    } else if constexpr (Bits16Of<scalar_t>::value == Bits16::kFloat16) {
      float_row_ops().widen_f16(reinterpret_cast<const uint16_t*>(row), out, dim);
    } else {
      for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<acc_t>(row[d]);
    }
  }
}

template <typename acc_t>
struct Workspace {
  std::vector<acc_t> q, scores, k, v;
  void reserve(int64_t rows, int64_t chunk, int64_t dim, bool widen) {
    q.resize(rows * dim);
    scores.resize(rows * chunk);
    if (widen) {
      k.resize(chunk * dim);
      v.resize(chunk * dim);
    }
  }
};

// Leaves the unnormalised output rows in o [M, D], their running max in m [M] and their sum of
// exponentials in l [M] (m = -inf and l = 0 for a row that saw no visible key).
template <typename scalar_t, typename acc_t, typename Gemm>
void attend(const AttentionProblem<scalar_t>& p, const Gemm& gemm, int64_t b, int64_t h,
            int64_t key_begin, int64_t key_end, int64_t chunk, Workspace<acc_t>& ws, acc_t* o,
            acc_t* m, acc_t* l) {
  constexpr bool kWiden = !std::is_same_v<scalar_t, acc_t>;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const int64_t rows = p.rows, dim = p.dim;

  acc_t* qs = ws.q.data();
  p.load_queries(b, h, 0, rows, qs);
  std::fill(o, o + rows * dim, acc_t(0));
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, acc_t(0));

  const scalar_t* k_head = p.k_head(b, h);
  const scalar_t* v_head = p.v_head(b, h);

  for (int64_t start = key_begin; start < key_end; start += chunk) {
    const int64_t n = std::min(chunk, key_end - start);
    const acc_t* k_rows;
    const acc_t* v_rows;
    int64_t k_ld = dim, v_ld = dim;
    if constexpr (kWiden) {
      widen_rows(k_head + start * p.k_stride[2], p.k_stride[2], n, dim, ws.k.data());
      widen_rows(v_head + start * p.v_stride[2], p.v_stride[2], n, dim, ws.v.data());
      k_rows = ws.k.data();
      v_rows = ws.v.data();
    } else {
      k_rows = k_head + start * p.k_stride[2];
      v_rows = v_head + start * p.v_stride[2];
      k_ld = p.k_stride[2];
      v_ld = p.v_stride[2];
    }

    // scores [M, n] = Q K^T
    acc_t* scores = ws.scores.data();
    gemm.scores(qs, rows, dim, k_rows, k_ld, n, scores);

    // The tree keys [P, P + T) of this chunk: query i sees tree key j only where mask[b, i, j].
    if (start + n > p.prefix) {
      const int64_t first = std::max<int64_t>(p.prefix - start, 0);  // first tree key's column
      for (int64_t r = 0; r < rows; ++r) {
        const bool* allowed = p.mask_row(b, r) + (start + first - p.prefix);
        acc_t* row = scores + r * n + first;
        for (int64_t j = 0; j < n - first; ++j) {
          if (!allowed[j]) row[j] = kNegInf;
        }
      }
    }

    // Online softmax: rescale what was accumulated when the row max grows.
    for (int64_t r = 0; r < rows; ++r) {
      acc_t* row = scores + r * n;
      const acc_t chunk_max = row_max(row, n);
      const acc_t new_max = chunk_max > m[r] ? chunk_max : m[r];
      if (new_max == kNegInf) {  // nothing visible to this row yet
        std::fill(row, row + n, acc_t(0));
        continue;
      }
      const acc_t alpha = m[r] == kNegInf ? acc_t(0) : std::exp(m[r] - new_max);
      l[r] = l[r] * alpha + exp_sum(row, n, new_max);
      m[r] = new_max;
      if (alpha != acc_t(1)) {
        acc_t* out = o + r * dim;
        for (int64_t d = 0; d < dim; ++d) out[d] *= alpha;
      }
    }

    // O += P V
    gemm.accumulate(o, rows, dim, scores, n, v_rows, v_ld);
  }
}

// The whole op: out [B, Hq, T, D] contiguous. par(begin, end, grain, fn) runs fn over a range,
// maybe on several threads (at::parallel_for); `threads` is how many it has.
template <typename scalar_t, typename Gemm, typename Par>
void tree_attention(const AttentionProblem<scalar_t>& p, int64_t batch, const Gemm& gemm,
                    const Par& par, int64_t threads, scalar_t* out) {
  using acc_t = attention_acc_t<scalar_t>;
  const int64_t rows = p.rows, dim = p.dim;
  const int64_t heads = batch * p.kv_heads;
  // About 64K scores per chunk (256 keys for M = 256): big enough GEMMs, and the chunk's scores,
  // K and V rows still fit in L2 between the two GEMMs.
  const int64_t chunk = std::clamp<int64_t>(
      int64_t(1) << (63 - __builtin_clzll(std::max<int64_t>(65536 / rows, 1))), 64, 512);
  // Split the keys too when there are few KV heads for the threads (at least 512 keys a split).
  int64_t splits = 1;
  if (heads < 4 * threads) {
    splits = std::clamp<int64_t>((4 * threads + heads - 1) / heads, 1, std::max<int64_t>(p.keys / 512, 1));
  }
  const int64_t span = (p.keys + splits - 1) / splits;
  splits = (p.keys + span - 1) / span;
  const int64_t items = heads * splits;
  // One item per task even for tiny problems: inside the parallel region BLAS runs
  // single-threaded. Run serially instead, BLAS would fork its own threads for every GEMM,
  // however small.
  const int64_t grain = 1;

  std::vector<acc_t> part_o, part_m, part_l;
  if (splits > 1) {
    part_o.resize(items * rows * dim);
    part_m.resize(items * rows);
    part_l.resize(items * rows);
  }
  par(0, items, grain, [&](int64_t begin, int64_t end) {
    Workspace<acc_t> ws;
    ws.reserve(rows, chunk, dim, !std::is_same_v<scalar_t, acc_t>);
    std::vector<acc_t> own_o, own_m, own_l;
    if (splits == 1) {
      own_o.resize(rows * dim);
      own_m.resize(rows);
      own_l.resize(rows);
    }
    for (int64_t item = begin; item < end; ++item) {
      const int64_t head = item / splits, split = item % splits;
      const int64_t b = head / p.kv_heads, h = head % p.kv_heads;
      const int64_t key_begin = split * span, key_end = std::min(p.keys, key_begin + span);
      if (splits == 1) {
        attend(p, gemm, b, h, key_begin, key_end, chunk, ws, own_o.data(), own_m.data(), own_l.data());
        for (int64_t r = 0; r < rows; ++r) {
          store_row(own_o.data() + r * dim, own_l[r], dim, out + (head * rows + r) * dim);
        }
      } else {
        attend(p, gemm, b, h, key_begin, key_end, chunk, ws, part_o.data() + item * rows * dim,
               part_m.data() + item * rows, part_l.data() + item * rows);
      }
    }
  });
  if (splits == 1) return;

  // Merge the splits of every row: weights exp(m_s - max m), divided by the merged sum.
  par(0, heads * rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(dim);
    for (int64_t hr = begin; hr < end; ++hr) {
      const int64_t head = hr / rows, r = hr % rows;
      acc_t best = -std::numeric_limits<acc_t>::infinity();
      for (int64_t s = 0; s < splits; ++s) best = std::max(best, part_m[(head * splits + s) * rows + r]);
      std::fill(acc.begin(), acc.end(), acc_t(0));
      acc_t total = 0;
      if (best != -std::numeric_limits<acc_t>::infinity()) {
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t at = (head * splits + s) * rows + r;
          if (part_l[at] == acc_t(0)) continue;
          const acc_t w = std::exp(part_m[at] - best);
          total += w * part_l[at];
          const acc_t* row = part_o.data() + at * dim;
          for (int64_t d = 0; d < dim; ++d) acc[d] += w * row[d];
        }
      }
      store_row(acc.data(), total, dim, out + hr * dim);
    }
  });
}

}  // namespace tree_attn
}  // namespace cpu
}  // namespace dartree
