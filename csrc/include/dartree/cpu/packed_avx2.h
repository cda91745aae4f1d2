// Packed GGUF rows rebuilt 8 values at a time with AVX2, for packed_linear on a CPU without AVX-512
// (most laptops), or under DARTREE_EXACT_ISA=avx2: in registers for calls of up to 16 rows
// (packed_tile, from packed_simd.h's run_small), into packed_rows.h's scratch for more. The reference is
// gguf::block_value (dartree/gguf_blocks.h): every value is computed as it computes it, the same
// products and sums in the same order, each rounded alike (products through product8, which the
// compiler cannot fuse into the following add or subtraction), so exact_linear's AVX2 tiles see
// the very weights exact_linear(x, dequantize(packed).to(x.dtype)) would see.
//
// Why: the scalar rebuild (gguf::dequantize_block, then a rounding per value, into the scratch) took
// most of a one-row step there; rebuilt 8 values at a time into the scratch, the step was still
// about half llama.cpp's speed (bench/results/floor_avx2cap_epyc_zen4_794fd8c.md). In registers,
// against that vectorised scratch (2 threads, EPYC Zen 4 capped at AVX2, SmolLM2's shapes,
// `DARTREE_EXACT_ISA=avx2 python bench/packed_linear.py --types Q4_1,Q4_K,Q6_K,Q8_0 --rows 1,5
// --against ...`): bfloat16 1.20-1.48x at one row, 0.94-1.43x at five; float32 1.19-1.74x and
// 1.36-1.65x. A block of 32 weights still costs ~45 instructions to rebuild bit-exactly (a 16-entry
// table, built and rounded per block, and a two-permute lookup per 8 values) against ~8 for
// llama.cpp's 8-bit dot products (our count of the code).
//
//   rebuild32<T, kRound>(b, j, w): values 32 j .. 32 j + 31 of the block at b, in 4 registers of 8
//   packed_tile<T, MR, NR, kRound>: exact_lin::tile_avx2's sums with the weights rebuilt in
//                                   registers (packed_simd.h's run_small: calls of up to 8 rows,
//                                   9-16 in two groups)
//   fill_rows<T>(rows, row_bytes, count, K, dst):      count rows -> float32 [count, K]
//   fill_rows_bf16<T>(rows, row_bytes, count, K, dst): ... -> bfloat16 bits [count, K], each value
//                                                      rounded as c10::BFloat16(float) rounds
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../gguf_blocks.h"
#include "exact_linear.h"
#include "simd.h"

namespace dartree {
namespace cpu {
namespace packed_avx2 {

#if DARTREE_X86 && defined(__GNUC__)
// 8 bytes -> 8 int32 lanes, unsigned / signed.
DARTREE_AVX2 inline __m256i u8x8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
DARTREE_AVX2 inline __m256i i8x8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
DARTREE_AVX2 inline __m256 to_float(__m256i q) { return _mm256_cvtepi32_ps(q); }
DARTREE_AVX2 inline __m256i nibble(__m256i q, int high) {  // the low (0) or high (1) nibble
  return _mm256_and_si256(_mm256_srli_epi32(q, 4 * high), _mm256_set1_epi32(0x0F));
}
// Bit 4 of the 5-bit codes i .. i + 7 of the 32-value types: bit i + lane of qh, as 16 or 0.
DARTREE_AVX2 inline __m256i fifth_bits(uint32_t qh, int i) {
  const __m256i at = _mm256_add_epi32(_mm256_set1_epi32(i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(qh)), at),
                                       _mm256_set1_epi32(1));
  return _mm256_slli_epi32(bit, 4);
}
DARTREE_AVX2 inline float half(const uint8_t* p) { return _cvtsh_ss(gguf::load_u16(p)); }  // exact
DARTREE_AVX2 inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Lane i = table[idx[i]], idx in 0 .. 15: two 8-entry tables (codes 0 - 7, 8 - 15), bit 3 choosing.
DARTREE_AVX2 inline __m256 lookup16(__m256i idx, __m256 low, __m256 high) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, idx), _mm256_permutevar8x32_ps(high, idx),
                          _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}
// kRound: v rounded to bfloat16 (as c10 rounds), kept as the float it stands for.
template <bool kRound>
DARTREE_AVX2 inline __m256 as_weight(__m256 v) {
  if constexpr (kRound) return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
  else return v;
}

// Values 32 j .. 32 j + 31 of the block at b (j = 0 for the 32-value types) -> w[0..3], 8 each; kRound:
// each rounded to bfloat16. The 4-bit types go through a table of their 16 values (rounded once, not
// per weight: a lookup only selects an entry, so rounding commutes with it).
template <int T, bool kRound>
DARTREE_AVX2 inline void rebuild32(const uint8_t* b, int j, __m256 (&w)[4]) {
  const __m256 codes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm256_set1_ps(8);
  if constexpr (T == gguf::Q4_0 || T == gguf::Q4_1 || T == gguf::Q4_K) {
    __m256 low, high;  // the values of codes 0 - 7 and 8 - 15
    const uint8_t* qs;
    if constexpr (T == gguf::Q4_0) {  // d * (q - 8)
      const __m256 d = _mm256_set1_ps(half(b));
      low = product8(d, _mm256_sub_ps(codes, eight));
      high = product8(d, codes);
      qs = b + 2;
    } else if constexpr (T == gguf::Q4_1) {  // d * q + m
      const __m256 d = _mm256_set1_ps(half(b)), m = _mm256_set1_ps(half(b + 2));
      low = _mm256_add_ps(product8(d, codes), m);
      high = _mm256_add_ps(product8(d, _mm256_add_ps(codes, eight)), m);
      qs = b + 4;
    } else {  // (d * sc) * q - dmin * mn, sub-block j: the nibble j % 2 of 32 bytes
      int sc, mn;
      gguf::k_scale_min(b + 4, j, &sc, &mn);
      const __m256 scale = _mm256_set1_ps(half(b) * static_cast<float>(sc));
      const __m256 offset = _mm256_set1_ps(half(b + 2) * static_cast<float>(mn));
      low = _mm256_sub_ps(product8(scale, codes), offset);
      high = _mm256_sub_ps(product8(scale, _mm256_add_ps(codes, eight)), offset);
      qs = b + 16 + (j / 2) * 32;
    }
    low = as_weight<kRound>(low);
    high = as_weight<kRound>(high);
    for (int i = 0; i < 32; i += 8) {  // Q4_0 / Q4_1: values 0 .. 15 the low nibbles of 16 bytes
      const __m256i q = T == gguf::Q4_K ? nibble(u8x8(qs + i), j % 2) : nibble(u8x8(qs + i % 16), i / 16);
      w[i / 8] = lookup16(q, low, high);
    }
  } else if constexpr (T == gguf::Q5_0 || T == gguf::Q5_1) {  // d * (q - 16), d * q + m
    constexpr bool kMin = T == gguf::Q5_1;
    const __m256 d = _mm256_set1_ps(half(b)), m = _mm256_set1_ps(kMin ? half(b + 2) : 0.0f);
    const uint32_t qh = load_u32(b + (kMin ? 4 : 2));
    const uint8_t* qs = b + (kMin ? 8 : 6);
    for (int i = 0; i < 32; i += 8) {
      const __m256i q = _mm256_or_si256(nibble(u8x8(qs + i % 16), i / 16), fifth_bits(qh, i));
      const __m256 v = product8(d, to_float(kMin ? q : _mm256_sub_epi32(q, _mm256_set1_epi32(16))));
      w[i / 8] = as_weight<kRound>(kMin ? _mm256_add_ps(v, m) : v);
    }
  } else if constexpr (T == gguf::Q8_0) {  // float(q) * d
    const __m256 d = _mm256_set1_ps(half(b));
    for (int i = 0; i < 32; i += 8) w[i / 8] = as_weight<kRound>(product8(to_float(i8x8(b + 2 + i)), d));
  } else if constexpr (T == gguf::Q5_K) {  // Q4_K's values with bit j of qh[i] as the fifth bit
    int sc, mn;
    gguf::k_scale_min(b + 4, j, &sc, &mn);
    const __m256 scale = _mm256_set1_ps(half(b) * static_cast<float>(sc));
    const __m256 offset = _mm256_set1_ps(half(b + 2) * static_cast<float>(mn));
    const uint8_t* qs = b + 48 + (j / 2) * 32;
    for (int i = 0; i < 32; i += 8) {
      const __m256i fifth = _mm256_and_si256(_mm256_srli_epi32(u8x8(b + 16 + i), j), _mm256_set1_epi32(1));
      const __m256i q = _mm256_or_si256(nibble(u8x8(qs + i), j % 2), _mm256_slli_epi32(fifth, 4));
      w[i / 8] = as_weight<kRound>(_mm256_sub_ps(product8(scale, to_float(q)), offset));
    }
  } else {  // Q6_K: (d * sc[16 values]) * q, q = (4 low bits | 2 high bits << 4) - 32
    static_assert(T == gguf::Q6_K, "rebuild32: a GGUF block type");
    const int half128 = j / 4, group = j % 4;
    const uint8_t* ql = b + half128 * 64 + (group % 2) * 32;
    const uint8_t* qh = b + 128 + half128 * 32;
    const float d = half(b + 208);
    for (int i = 0; i < 32; i += 8) {
      const __m256i lo = nibble(u8x8(ql + i), group / 2);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(u8x8(qh + i), 2 * group), _mm256_set1_epi32(3));
      const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
      const __m256 scale = _mm256_set1_ps(d * static_cast<float>(static_cast<int8_t>(b[192 + (32 * j + i) / 16])));
      w[i / 8] = as_weight<kRound>(product8(scale, to_float(q)));
    }
  }
}

// Rows of one block type into float32 scratch [count, K] (K a multiple of the block's values).
template <int T>
DARTREE_AVX2 void fill_rows(const uint8_t* rows, int64_t row_bytes, int64_t count, int64_t K, float* dst) {
  constexpr int kValues = gguf::block_values(T), kBytes = gguf::block_bytes(T);
  for (int64_t r = 0; r < count; ++r)
    for (int64_t k = 0; k < K; k += 32) {
      __m256 w[4];
      rebuild32<T, false>(rows + r * row_bytes + (k / kValues) * kBytes, static_cast<int>(k % kValues) / 32, w);
      for (int s = 0; s < 4; ++s) _mm256_storeu_ps(dst + r * K + k + 8 * s, w[s]);
    }
}

// ... into bfloat16 scratch (bits), each value rounded as c10::BFloat16(float) rounds.
template <int T>
DARTREE_AVX2 void fill_rows_bf16(const uint8_t* rows, int64_t row_bytes, int64_t count, int64_t K, uint16_t* dst) {
  constexpr int kValues = gguf::block_values(T), kBytes = gguf::block_bytes(T);
  for (int64_t r = 0; r < count; ++r)
    for (int64_t k = 0; k < K; k += 32) {
      __m256 w[4];
      rebuild32<T, true>(rows + r * row_bytes + (k / kValues) * kBytes, static_cast<int>(k % kValues) / 32, w);
      for (int s = 0; s < 4; s += 2) {  // 16 values -> 16 words, in order (packus works per 128-bit lane)
        const __m256i words = _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(w[s]), 16),
                                                  _mm256_srli_epi32(_mm256_castps_si256(w[s + 1]), 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * K + k + 8 * s), _mm256_permute4x64_epi64(words, 0xD8));
      }
    }
}

// exact_lin::tile_avx2<MR, NR> over packed rows, the weights rebuilt in registers (no scratch): x [mr, K]
// float32 row stride K (bfloat16 activations widened once by the caller: exact), rows [nr] packed rows
// of row_bytes, out [mr][NR] float sums; kRound: the weights rounded to bfloat16 (bfloat16 activations).
// Each sum is tile_avx2's: 8 lanes, an FMA chain over k = lane (mod 8) in increasing k, then hsum8. A
// column's 32 weights are rebuilt once per k-step for all MR rows.
template <int T, int MR, int NR, bool kRound>
DARTREE_AVX2 DARTREE_HOT void packed_tile(const float* x_in, int mr, const uint8_t* rows, int64_t row_bytes, int nr,
                              int64_t K, float* out) {
  constexpr int kValues = gguf::block_values(T), kBytes = gguf::block_bytes(T);
  const float* x[MR];
  const uint8_t* w[NR];
  for (int i = 0; i < MR; ++i) x[i] = x_in + std::min(i, mr - 1) * K;  // rows past mr repeat the last
  for (int j = 0; j < NR; ++j) w[j] = rows + std::min(j, nr - 1) * row_bytes;
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t at = (k / kValues) * kBytes;
    const int sub = static_cast<int>(k % kValues) / 32;
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      __m256 v[4];
      rebuild32<T, kRound>(w[j] + at, sub, v);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s) acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + k + 8 * s), v[s], acc[i][j]);
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) out[i * NR + j] = hsum8(acc[i][j]);
}

// bfloat16 bits [n] widened to float32 (exact), n a multiple of 8 (of K: whole blocks).
DARTREE_AVX2 inline void widen_bf16(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, load8_bf16(src + i));
}
#endif  // DARTREE_X86

}  // namespace packed_avx2
}  // namespace cpu
}  // namespace dartree
