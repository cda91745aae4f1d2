// CPU GRU step of the Domino head, one state at a time (PyTorch's GRUCell, gates r, z, n):
//
//   gru_gates(gi [3G], gh [3G], g [G]) -> out [G]:  r = sig(gi_r + gh_r), u = sig(gi_z + gh_z),
//   n = tanh(gi_n + r * gh_n), out = (1 - u) * n + u * g
//   table_row(table, kind, ld, token, 3G) -> gi: the input term E W_ih^T of `token`, precomputed
//   per vocabulary entry ([V, 3G] in any float dtype), widened to T.
// gh = W_hh g + b_hh comes from nt_gemm.h (once per distinct parent, see expand_level.h).
// Float32 with AVX2/FMA uses simd.h's sigmoid8 / tanh8 (a few 1e-7 absolute error); float64 and
// CPUs without AVX2 the exact std:: functions. Reads 3G + 3G + G, writes G. Assumes no aliasing
// between out and the inputs, and a token inside the table (the launcher checks ids).
#pragma once
#include <cmath>
#include <cstdint>

#include "../level_args.h"
#include "simd.h"

namespace dartree {
namespace cpu {

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

}  // namespace cpu
}  // namespace dartree
