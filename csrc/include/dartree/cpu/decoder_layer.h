// The elementwise steps of a Llama-family decoder layer with the bits of transformers' eager
// forward on the CPU, for decoder_stack's launcher (csrc/cpu/decoder_stack.cpp; reference: the
// Python loop dartree/decoder_stack.py and transformers' own forward). S is the storage type
// (float, or torch's bfloat16 / float16, which widen to float and round to nearest even); each
// ATen op rounds its result to S on its own, and so does every step here:
//
//   rms_norm   out = w * S(f(x) * (1 / sqrt(mean(f(x)^2) + eps)))     f: widen to float32
//   rope       out = S(S(x * cos) + S(x[perm] * sin_signed))           perm: the halves swapped
//   add        x = S(x + y)          mul   out = S(a * b)
//
// decoder_layer_simd.h runs the same steps in AVX-512 / AVX2 lanes; these loops are its reference
// and its leftover elements.
//
// mean is ATen's: the sum of the squares in the order of its CPU reduction (aten_inner_sum), then
// one division. Products pass through `product`, which the compiler cannot fuse into a following
// add (an FMA rounds once and would change the last bit).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "simd.h"

namespace dartree {
namespace cpu {
namespace layer {

inline float product(float a, float b) {
  float p = a * b;
#if DARTREE_X86 && defined(__GNUC__)
  asm("" : "+x"(p));
#endif
  return p;
}

template <typename S>
inline float widen(S v) {
  return static_cast<float>(v);
}

// ATen's utils::CeilLog2.
inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x) - 1; v; v >>= 1) ++bits;
  return bits;
}

// sum(x[0 .. n)) in float32 as ATen's CPU sum reduces a contiguous row (SumKernel.cpp,
// vectorized_inner_sum with W-lane vectors; W = 1 is its scalar_inner_sum, taken for n < W):
// row_sum over the n / W vectors (4 interleaved accumulators, each a 4-level cascade that
// carries every 2^p additions up a level, p = max(4, ceil_log2(rows) / 4)), then the
// leftover scalars, then the lanes in order, onto the output's initial 0.
template <int W>
float aten_inner_sum(const float* x, int64_t n) {
  constexpr int kLevels = 4, kIlp = 4;
  const int64_t vectors = n / W, rows = vectors / kIlp;
  const int64_t power = std::max<int64_t>(4, ceil_log2(rows) / kLevels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  float acc[kLevels][kIlp][W] = {};
  const auto add_vector = [&](float* a, int64_t v) {
    for (int l = 0; l < W; ++l) a[l] += x[v * W + l];
  };
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i) {
      for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
    }
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        for (int l = 0; l < W; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.0f;
        }
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < rows; ++i) {
    for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
  }
  for (int j = 1; j < kLevels; ++j) {
    for (int k = 0; k < kIlp; ++k) {
      for (int l = 0; l < W; ++l) acc[0][k][l] += acc[j][k][l];
    }
  }
  for (int64_t v = rows * kIlp; v < vectors; ++v) add_vector(acc[0][0], v);
  for (int k = 1; k < kIlp; ++k) {
    for (int l = 0; l < W; ++l) acc[0][0][l] += acc[0][k][l];
  }
  float total = 0.0f;
  for (int64_t e = vectors * W; e < n; ++e) total += x[e];
  for (int l = 0; l < W; ++l) total += acc[0][0][l];
  return 0.0f + total;
}

// mean(x[0 .. n)) as ATen's CPU mean computes it (sum, then one division by n), for ATen's
// vector width `lanes` (16: AVX-512, 8: AVX2 and the default build; 0: unsupported).
inline float aten_mean(const float* x, int64_t n, int lanes) {
  const float sum = lanes == 16 && n >= 16 ? aten_inner_sum<16>(x, n)
                    : lanes == 8 && n >= 8 ? aten_inner_sum<8>(x, n)
                                           : aten_inner_sum<1>(x, n);
  return sum / static_cast<float>(n);
}

// squares[d] = f(x[d])^2 for d < n (hidden.to(float32).pow(2): one rounded product).
template <typename S>
void squares(const S* x, int64_t n, float* out) {
  for (int64_t d = 0; d < n; ++d) out[d] = product(widen(x[d]), widen(x[d]));
}

// out[d] = w[d] * S(f(x[d]) * inv) for d < n, given inv = 1 / sqrt(mean + eps) of the row.
template <typename S>
void rms_scale(const S* x, int64_t n, float inv, const S* w, S* out) {
  for (int64_t d = 0; d < n; ++d) {
    const S normed = static_cast<S>(product(widen(x[d]), inv));
    out[d] = static_cast<S>(product(widen(w[d]), widen(normed)));
  }
}

// 1 / sqrt(mean + eps) as ATen's `torch.rsqrt(variance + eps)` on float32 (eps rounded to float).
inline float inverse_rms(float mean, double eps) {
  const float shifted = mean + static_cast<float>(eps);
  return 1.0f / std::sqrt(shifted);
}

// One half of a head's RoPE: out[d] = S(S(x[d] * cos[d]) + S(swapped[d] * sin_signed[d])), d < n,
// where swapped is the other half of the head (rotate_half's source) and sin_signed carries its
// sign.
template <typename S>
void rope_half(const S* x, const S* swapped, const S* cos, const S* sin_signed, int64_t n, S* out) {
  for (int64_t d = 0; d < n; ++d) {
    const S a = static_cast<S>(product(widen(x[d]), widen(cos[d])));
    const S b = static_cast<S>(product(widen(swapped[d]), widen(sin_signed[d])));
    out[d] = static_cast<S>(widen(a) + widen(b));
  }
}

// x[d] = S(x[d] + y[d]) for d < n.
template <typename S>
void add_into(S* x, const S* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) x[d] = static_cast<S>(widen(x[d]) + widen(y[d]));
}

// a[d] = S(a[d] * b[d]) for d < n.
template <typename S>
void mul_into(S* a, const S* b, int64_t n) {
  for (int64_t d = 0; d < n; ++d) a[d] = static_cast<S>(product(widen(a[d]), widen(b[d])));
}

}  // namespace layer
}  // namespace cpu
}  // namespace dartree
