// The elementwise steps of decoder_layer.h (the reference: its scalar loops) 16 lanes at a time
// with AVX-512 or 8 with AVX2, for float32 and bfloat16 storage; float16 keeps the scalar loops.
// Every lane computes what the scalar step computes for its element, so the bits do not depend on
// the path: each product passes through `product16` / `product8` (GCC would fuse a vector multiply
// and a following add into an FMA, which rounds once), and each result is rounded to the storage
// type as c10::BFloat16(float) rounds (nearest even, NaN -> 0x7FC0). A decode step ran these as
// scalar loops (the barrier also stops the compiler's vectoriser): 5% of a one-row SmolLM2 step and
// 7% of an eight-row verify (perf, bfloat16, EPYC Zen 4).
//
// Each `*_lanes` function does the first n - n % W elements (W = 16 or 8) and returns that count;
// the caller's scalar loop does the rest. `layer::vec` (below) picks the widest path the CPU and
// the instruction-set cap allow.
#pragma once
#include <cstdint>
#include <type_traits>

#include "decoder_layer.h"
#include "exact_simd.h"

namespace dartree {
namespace cpu {
namespace layer {

// The vector paths' storage types: float, and bfloat16 (as its bits).
template <typename S>
constexpr bool kLaned = std::is_same_v<S, float> || Bits16Of<S>::value == Bits16::kBFloat16;

#if DARTREE_X86 && defined(__GNUC__)
// ---- AVX-512: 16 lanes.
DARTREE_AVX512 inline __m512 product16(__m512 a, __m512 b) {
  __m512 p = _mm512_mul_ps(a, b);
  asm("" : "+v"(p));
  return p;
}
template <typename S>
DARTREE_AVX512 inline __m512 load16(const S* p) {
  if constexpr (std::is_same_v<S, float>) return _mm512_loadu_ps(p);
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                        reinterpret_cast<const __m256i*>(p))), 16));
}
// c10::BFloat16(v)'s bits, in the low half of each lane.
DARTREE_AVX512 inline __m512i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
// S(v) as a float again (bfloat16 widens exactly).
template <typename S>
DARTREE_AVX512 inline __m512 rounded16(__m512 v) {
  if constexpr (std::is_same_v<S, float>) return v;
  else return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}
template <typename S>
DARTREE_AVX512 inline void store16(S* p, __m512 v) {
  if constexpr (std::is_same_v<S, float>) _mm512_storeu_ps(p, v);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(v)));
}

template <typename S>
DARTREE_AVX512 int64_t squares_lanes16(const S* x, int64_t n, float* out) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const __m512 v = load16(x + d);
    _mm512_storeu_ps(out + d, product16(v, v));
  }
  return d;
}
template <typename S>
DARTREE_AVX512 int64_t rms_scale_lanes16(const S* x, int64_t n, float inv, const S* w, S* out) {
  const __m512 scale = _mm512_set1_ps(inv);
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const __m512 normed = rounded16<S>(product16(load16(x + d), scale));
    store16(out + d, product16(load16(w + d), normed));
  }
  return d;
}
// out[d] = S(S(x[d] * cos[d]) + S(swapped[d] * sin_signed[d])): one half of a head (the caller
// passes the other half as `swapped`).
template <typename S>
DARTREE_AVX512 int64_t rope_lanes16(const S* x, const S* swapped, const S* cos, const S* sin_signed, int64_t n,
                                    S* out) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const __m512 a = rounded16<S>(product16(load16(x + d), load16(cos + d)));
    const __m512 b = rounded16<S>(product16(load16(swapped + d), load16(sin_signed + d)));
    store16(out + d, _mm512_add_ps(a, b));
  }
  return d;
}
template <typename S>
DARTREE_AVX512 int64_t add_lanes16(S* x, const S* y, int64_t n) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) store16(x + d, _mm512_add_ps(load16(x + d), load16(y + d)));
  return d;
}
template <typename S>
DARTREE_AVX512 int64_t mul_lanes16(S* a, const S* b, int64_t n) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) store16(a + d, product16(load16(a + d), load16(b + d)));
  return d;
}

// ---- AVX2: 8 lanes, the same steps (product8, bf16_bits8: simd.h).
template <typename S>
DARTREE_AVX2 inline __m256 load8_of(const S* p) {
  if constexpr (std::is_same_v<S, float>) return _mm256_loadu_ps(p);
  else return load8_bf16(reinterpret_cast<const uint16_t*>(p));
}
template <typename S>
DARTREE_AVX2 inline __m256 rounded8(__m256 v) {
  if constexpr (std::is_same_v<S, float>) return v;
  else return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}
template <typename S>
DARTREE_AVX2 inline void store8(S* p, __m256 v) {
  if constexpr (std::is_same_v<S, float>) {
    _mm256_storeu_ps(p, v);
  } else {  // the 8 low halves, in order (packus works per 128-bit lane)
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits8(v), bf16_bits8(v)), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(words));
  }
}

template <typename S>
DARTREE_AVX2 int64_t squares_lanes8(const S* x, int64_t n, float* out) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const __m256 v = load8_of(x + d);
    _mm256_storeu_ps(out + d, product8(v, v));
  }
  return d;
}
template <typename S>
DARTREE_AVX2 int64_t rms_scale_lanes8(const S* x, int64_t n, float inv, const S* w, S* out) {
  const __m256 scale = _mm256_set1_ps(inv);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const __m256 normed = rounded8<S>(product8(load8_of(x + d), scale));
    store8(out + d, product8(load8_of(w + d), normed));
  }
  return d;
}
template <typename S>
DARTREE_AVX2 int64_t rope_lanes8(const S* x, const S* swapped, const S* cos, const S* sin_signed, int64_t n,
                                 S* out) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const __m256 a = rounded8<S>(product8(load8_of(x + d), load8_of(cos + d)));
    const __m256 b = rounded8<S>(product8(load8_of(swapped + d), load8_of(sin_signed + d)));
    store8(out + d, _mm256_add_ps(a, b));
  }
  return d;
}
template <typename S>
DARTREE_AVX2 int64_t add_lanes8(S* x, const S* y, int64_t n) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) store8(x + d, _mm256_add_ps(load8_of(x + d), load8_of(y + d)));
  return d;
}
template <typename S>
DARTREE_AVX2 int64_t mul_lanes8(S* a, const S* b, int64_t n) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) store8(a + d, product8(load8_of(a + d), load8_of(b + d)));
  return d;
}
#endif  // DARTREE_X86

// The steps of decoder_layer.h on the widest lanes allowed: `lanes` 16, 8 or 1 (scalar), from
// vec::lanes(cap) with cap the instruction-set rank of exact_lin::isa_rank (DARTREE_EXACT_ISA).
struct vec {
  int lanes;

  static int choose(int cap) {
    if (cap >= 2 && has_avx512()) return 16;
    if (cap >= 1 && has_avx2()) return 8;
    return 1;
  }

  template <typename S>
  void squares(const S* x, int64_t n, float* out) const {
    int64_t d = 0;
#if DARTREE_X86 && defined(__GNUC__)
    if constexpr (kLaned<S>) d = lanes == 16 ? squares_lanes16(x, n, out) : lanes == 8 ? squares_lanes8(x, n, out) : 0;
#endif
    layer::squares(x + d, n - d, out + d);
  }

  template <typename S>
  void rms_scale(const S* x, int64_t n, float inv, const S* w, S* out) const {
    int64_t d = 0;
#if DARTREE_X86 && defined(__GNUC__)
    if constexpr (kLaned<S>)
      d = lanes == 16 ? rms_scale_lanes16(x, n, inv, w, out) : lanes == 8 ? rms_scale_lanes8(x, n, inv, w, out) : 0;
#endif
    layer::rms_scale(x + d, n - d, inv, w + d, out + d);
  }

  // layer::rope on one head of `dim` values: each half in lanes, its leftover in rope_half.
  template <typename S>
  void rope(const S* x, const S* cos, const S* sin_signed, int64_t dim, S* out) const {
    const int64_t half = dim / 2;
    for (const int64_t h : {int64_t(0), half}) {
      const S* swapped = x + (h == 0 ? half : 0);
      int64_t d = 0;
#if DARTREE_X86 && defined(__GNUC__)
      if constexpr (kLaned<S>)
        d = lanes == 16  ? rope_lanes16(x + h, swapped, cos + h, sin_signed + h, half, out + h)
            : lanes == 8 ? rope_lanes8(x + h, swapped, cos + h, sin_signed + h, half, out + h)
                         : 0;
#endif
      rope_half(x + h + d, swapped + d, cos + h + d, sin_signed + h + d, half - d, out + h + d);
    }
  }

  template <typename S>
  void add_into(S* x, const S* y, int64_t n) const {
    int64_t d = 0;
#if DARTREE_X86 && defined(__GNUC__)
    if constexpr (kLaned<S>) d = lanes == 16 ? add_lanes16(x, y, n) : lanes == 8 ? add_lanes8(x, y, n) : 0;
#endif
    layer::add_into(x + d, y + d, n - d);
  }

  template <typename S>
  void mul_into(S* a, const S* b, int64_t n) const {
    int64_t d = 0;
#if DARTREE_X86 && defined(__GNUC__)
    if constexpr (kLaned<S>) d = lanes == 16 ? mul_lanes16(a, b, n) : lanes == 8 ? mul_lanes8(a, b, n) : 0;
#endif
    layer::mul_into(a + d, b + d, n - d);
  }
};

}  // namespace layer
}  // namespace cpu
}  // namespace dartree
