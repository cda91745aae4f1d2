// GGUF blocks dequantised in AVX-512 registers, 16 values at a time, for packed_linear's CPU
// kernels (launcher: csrc/cpu/exact_linear.cpp; rows in scratch: dartree/cpu/packed_rows.h).
//
//   dq32<T, kBf16>(row, k, lo, hi, ks): values k .. k + 31 of a packed row of block type T (k % 32
//   == 0; 32 divides every block, so they never straddle two blocks), 16 in each register; kBf16:
//   each rounded to bfloat16; ks: a K-quant's super-block scales (k_scales, kept by RowScales)
//   dq32_bf16<T>(row, k, ks): the same values rounded to bfloat16, all 32 in one register
//
// The bits are gguf::block_value's (dartree/gguf_blocks.h): the same integer unpacking, then each
// multiply and add rounded on its own. Types of at most 32 codes a block (Q4_0/1, Q5_0/1, Q4_K,
// Q5_K) compute the value of every code once per block (16 or 32 lanes, with those same rounded
// products and sums) and look each weight's value up by its code: a permute instead of a
// conversion, a product and a sum per 16 weights. One-row calls are bound by this rebuilding,
// not by the bytes read (bench/results/packed_tables_amd_epyc.md: 1.13-1.44x at M = 1 for the
// one-register tables; Q5_1/Q5_K's two-register ones within the noise). The K-quants' scales (the
// 6-bit fields with d and dmin, or Q6_K's int8 scales with d) are unpacked once per super-block of
// 256 values and row (k_scales, kept by RowScales while a tile's k crosses the block), not once
// per 32 values, and Q6_K's codes are put together on bytes, 32 to a register: in-cache calls of
// 1-5 rows ran 1.8-2.0x (Q4_K) and 1.5-1.9x (Q6_K) faster for it, bfloat16, EPYC Zen 4
// (`python bench/packed_linear.py --types Q4_K,Q6_K --rows 1,5 --dtype bfloat16 --against ...`).
// GCC contracts a vector multiply and a following add into
// one FMA (which rounds once and would change the last bit), so every product passes through
// `mul`, whose result the compiler cannot see through.
//
// packed_tile<T, MR, NR, scalar_t> is exact_lin::tile_avx512<MR, NR, scalar_t> with its weight
// loads replaced by dq32: the same 16-lane FMA chain over k for every output, the same horizontal
// sum, so an output has the bits exact_linear gives on the dequantised weights, without the weights
// ever being written out. bfloat16 activations: exact_linear sees the weights rounded to bfloat16
// (as torch's .to rounds them), so the values are rounded alike in registers: where exact_linear
// takes VDPBF16PS (AVX512-BF16), 32 to a register for it by VCVTNE2PS2BF16 (dq32_bf16;
// packed_tile_bf16: tile_avx512_bf16's chain), otherwise kept as floats for the FMA chain
// (dq32<T, true> with bf16_bits; packed_tile). The launcher takes them for calls of up to 8 rows
// (decode, small drafts and trees, where rebuilding the weights is the whole cost; 9 on the FMA
// tiles) and for up to 16 rows in two balanced groups, each rebuilding the weights: a verify of
// 9-10 rows ran 7-23% faster this way than on the scratch, of 12 and 16 rows 0-19% (SmolLM2 packed,
// float32 and bfloat16 exact, EPYC Zen 4, two runs). On the FMA tiles one 9 x 2 tile instead of
// 5 + 4 rows ran 8-32% faster on every type (float32, and bfloat16 capped at AVX-512), and float32
// 17-18 rows in two groups 4-23% faster than the scratch (Q5_K: 2-5% slower, so it keeps the
// scratch; bfloat16 too: 5-17% slower); 10-12 rows in one tile spill (12-18% slower), 2 threads,
// EPYC Zen 4 (`python bench/packed_linear.py --rows 9,17 --against ...`). Larger M rebuilds each
// block of rows once into scratch (fill_rows, fill_rows_bf16) and reuses exact_linear's tiles.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../gguf_blocks.h"
#include "exact_linear.h"
#include "packed_avx2.h"

namespace dartree {
namespace cpu {
namespace packed {

#if DARTREE_X86 && defined(__GNUC__)
// A product the compiler cannot fuse into a following add: the empty asm hides its value.
DARTREE_AVX512 inline __m512 mul(__m512 a, __m512 b) {
  __m512 p = _mm512_mul_ps(a, b);
  asm("" : "+v"(p));
  return p;
}
DARTREE_AVX512 inline __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
DARTREE_AVX512 inline __m512 sub(__m512 a, __m512 b) { return _mm512_sub_ps(a, b); }
// A half widened exactly (F16C converts every half, subnormals included, without rounding).
DARTREE_AVX512 inline float half(const uint8_t* p) { return _cvtsh_ss(gguf::load_u16(p)); }
DARTREE_AVX512 inline __m512 half16(const uint8_t* p) {  // without a round trip through a scalar
  return _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(gguf::load_u16(p))));
}
// The halves at p and p + 2 (a block's d and m), each widened into every lane: one load and one
// conversion for both.
DARTREE_AVX512 inline void half_pair16(const uint8_t* p, __m512& first, __m512& second) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  const __m512 both = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits))));
  first = _mm512_permutexvar_ps(_mm512_setzero_si512(), both);
  second = _mm512_permutexvar_ps(_mm512_set1_epi32(1), both);
}
// 16 bytes -> 16 int32 lanes, unsigned / signed.
DARTREE_AVX512 inline __m512i u8x16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
DARTREE_AVX512 inline __m512i i8x16(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// Nibble `hi` (0: low, 1: high) of each lane's byte.
DARTREE_AVX512 inline __m512i nibble(__m512i bytes, int hi) {
  return _mm512_and_si512(_mm512_srli_epi32(bytes, 4 * hi), _mm512_set1_epi32(0x0F));
}
DARTREE_AVX512 inline __m512 to_float(__m512i q) { return _mm512_cvtepi32_ps(q); }
// Lanes whose bit is set in `high` gain 16 (the fifth bit of Q5 values).
DARTREE_AVX512 inline __m512i add_fifth_bit(__m512i q, __mmask16 high) {
  return _mm512_mask_or_epi32(q, high, q, _mm512_set1_epi32(16));
}
DARTREE_AVX512 inline __mmask16 q5_high_bits(const uint8_t* qh, int half_block) {
  return static_cast<__mmask16>(gguf::load_u16(qh + 2 * half_block));
}

// The 32 Q6_K codes less 32 of one group (0..3) of one half, int8 in value order: low (group < 2)
// or high nibbles of 32 ql bytes, 2-bit fields at 2 * group of 32 qh bytes. Built on bytes, 32 to
// a 256-bit register (a 16-bit shift's bits from the neighbouring byte are masked away), widened
// only to be converted.
DARTREE_AVX512 inline __m256i q6_codes(const uint8_t* ql, const uint8_t* qh, int group) {
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  const __m256i low = _mm256_and_si256(group < 2 ? l : _mm256_srli_epi16(l, 4), _mm256_set1_epi8(0x0F));
  const __m256i high = _mm256_and_si256(_mm256_srli_epi16(h, 2 * group), _mm256_set1_epi8(3));
  return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
}
// int8 lanes 0 .. 15 / 16 .. 31 of `codes` as 16 floats.
DARTREE_AVX512 inline __m512 low_codes(__m256i codes) {
  return to_float(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes)));
}
DARTREE_AVX512 inline __m512 high_codes(__m256i codes) {
  return to_float(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1)));
}

// A K-quant super-block's scales as floats, once per 256 values rather than once per 32 (the
// launcher's tiles keep them per row while k crosses the block), each the product
// gguf::block_value rounds:
//   Q4_K / Q5_K: s[j] = d * sc_j, s[8 + j] = dmin * mn_j for the sub-blocks j = 0 .. 7
//                (gguf::k_scale_min's 6-bit fields, unpacked for all 16 at once)
//   Q6_K:        s[g] = d * sc_g for the 16 groups of 16 values (int8 scales)
template <int T>
DARTREE_AVX512 inline void k_scales(const uint8_t* b, float* s) {
  if constexpr (T == gguf::Q6_K) {
    const __m512 sc = to_float(i8x16(b + 192));
    _mm512_storeu_ps(s, mul(_mm512_set1_ps(half(b + 208)), sc));
  } else {
    static_assert(T == gguf::Q4_K || T == gguf::Q5_K, "k_scales: a K-quant");
    // bytes q = b[4 .. 15]: sc_j = q[j] & 63 (j < 4), (q[j + 4] & 15) | (q[j - 4] >> 6) << 4;
    // mn_j = q[j + 4] & 63 (j < 4), (q[j + 4] >> 4) | (q[j] >> 6) << 4. Lanes 0-7: sc, 8-15: mn.
    const __m512i q = u8x16(b + 4);
    const __m512i low = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11), q);
    const __m512i top = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7), q);
    const __m512i field = _mm512_and_si512(
        _mm512_srlv_epi32(low, _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4)),
        _mm512_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
    const __m512i v = _mm512_mask_or_epi32(field, 0xF0F0, field, _mm512_slli_epi32(_mm512_srli_epi32(top, 6), 4));
    __m512 d, dmin;
    half_pair16(b, d, dmin);
    _mm512_storeu_ps(s, mul(_mm512_mask_mov_ps(d, 0xFF00, dmin), to_float(v)));
  }
}

// The 16 values a block's 4-bit (or half of its 5-bit) codes stand for, lane q = the value of code
// q, each computed as gguf::block_value computes it (the same products and sums, rounded alike).
// A block's 32 values then cost one permute per 16 lanes instead of a conversion, a product and a
// sum each: the decode-step kernels spend most of their time rebuilding weights (one FMA each per
// row of x), so this is the cost that counts.
DARTREE_AVX512 inline __m512 codes(int first) {  // first, first + 1, ..., first + 15 as floats
  return _mm512_add_ps(_mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                       _mm512_set1_ps(static_cast<float>(first)));
}
// Lane i = table[index[i] % 16] (the low 4 bits of each int32 lane); two tables: index % 32.
DARTREE_AVX512 inline __m512 lookup(__m512i index, __m512 table) { return _mm512_permutexvar_ps(index, table); }
DARTREE_AVX512 inline __m512 lookup(__m512i index, __m512 low, __m512 high) {
  return _mm512_permutex2var_ps(low, index, high);
}
// The low nibbles of each lane's byte need no mask for a 16-entry lookup (it reads 4 bits); the
// high ones a shift.
DARTREE_AVX512 inline __m512i high_nibble(__m512i bytes) { return _mm512_srli_epi32(bytes, 4); }

// 16 floats rounded to bfloat16 as c10::BFloat16(float) rounds them (nearest even; NaN -> 0x7FC0),
// the bits in the low half of each lane. Integer arithmetic, not VCVTNEPS2BF16, which flushes
// subnormal inputs to zero where c10 keeps them.
DARTREE_AVX512 inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
// The rounded value as a float again (exact: a bfloat16 widens without rounding).
DARTREE_AVX512 inline __m512 bf16_rounded(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
// v itself, or rounded to bfloat16 (`round`: the weights bfloat16 activations see).
template <bool round>
DARTREE_AVX512 inline __m512 as_weight(__m512 v) {
  if constexpr (round) return bf16_rounded(v);
  return v;
}
// The values of a block's codes for the types of at most 32 codes (see codes()), as
// gguf::block_value computes each: low = those of codes 0 .. 15 and, for the 5-bit types, high =
// those of codes 16 .. 31; j = the sub-block of 32 (Q4_K / Q5_K), ks = its super-block's
// k_scales.
template <int T>
DARTREE_AVX512 inline void code_tables(const uint8_t* b, int j, __m512& low, __m512& high, const float* ks) {
  if constexpr (T == gguf::Q4_0) {  // d * (q - 8)
    low = mul(half16(b), codes(-8));
  } else if constexpr (T == gguf::Q4_1 || T == gguf::Q5_1) {  // d * q + m
    __m512 d, m;
    half_pair16(b, d, m);
    low = add(mul(d, codes(0)), m);
    if constexpr (T == gguf::Q5_1) high = add(mul(d, codes(16)), m);
  } else if constexpr (T == gguf::Q5_0) {  // d * (q - 16)
    const __m512 d = half16(b);
    low = mul(d, codes(-16));
    high = mul(d, codes(0));
  } else {  // Q4_K / Q5_K: scale * q - offset per sub-block
    static_assert(T == gguf::Q4_K || T == gguf::Q5_K, "code_tables: a type of at most 32 codes");
    const __m512 scale = _mm512_set1_ps(ks[j]), offset = _mm512_set1_ps(ks[8 + j]);
    low = sub(mul(scale, codes(0)), offset);
    if constexpr (T == gguf::Q5_K) high = sub(mul(scale, codes(16)), offset);
  }
}

// Values k .. k + 31 of `row` (block type T; k % 32 == 0) as gguf::block_value computes each:
// lo = values k .. k + 15, hi = k + 16 .. k + 31. 32 values share their scales (a block of the
// 32-value types, a sub-block of Q4_K / Q5_K) and their quant bytes, so each is read once; the
// types of at most 32 codes a block go through a table of their values (above). kBf16: each value
// rounded to bfloat16 (as_weight), the tables' 16 or 32 entries once rather than every weight
// (a lookup only selects an entry, so rounding commutes with it). ks: the K-quants' k_scales of
// the super-block holding k (RowScales; read by no other type).
template <int T, bool kBf16 = false>
DARTREE_AVX512 inline void dq32(const uint8_t* row, int64_t k, __m512& lo, __m512& hi, const float* ks) {
  constexpr int kValues = gguf::block_values(T), kBytes = gguf::block_bytes(T);
  const uint8_t* b = row + (k / kValues) * kBytes;
  const int j = static_cast<int>(k % kValues) / 32;  // sub-block of 32 (the K-quants)
  __m512 low, high;
  if constexpr (T != gguf::Q8_0 && T != gguf::Q6_K) {
    code_tables<T>(b, j, low, high, ks);
    low = as_weight<kBf16>(low);
    if constexpr (T == gguf::Q5_0 || T == gguf::Q5_1 || T == gguf::Q5_K) high = as_weight<kBf16>(high);
  }
  if constexpr (T == gguf::Q4_0 || T == gguf::Q4_1) {
    const __m512i q = u8x16(b + (T == gguf::Q4_0 ? 2 : 4));
    lo = lookup(q, low);
    hi = lookup(high_nibble(q), low);
  } else if constexpr (T == gguf::Q5_0 || T == gguf::Q5_1) {  // q = nibble | fifth bit << 4
    const int qh = T == gguf::Q5_0 ? 2 : 4;
    const __m512i q = u8x16(b + qh + 4);
    lo = lookup(add_fifth_bit(nibble(q, 0), q5_high_bits(b + qh, 0)), low, high);
    hi = lookup(add_fifth_bit(high_nibble(q), q5_high_bits(b + qh, 1)), low, high);
  } else if constexpr (T == gguf::Q8_0) {  // 256 codes: converted, not looked up
    const __m512 d = _mm512_set1_ps(half(b));  // half16's vector widening was no faster here
    lo = as_weight<kBf16>(mul(to_float(i8x16(b + 2)), d));
    hi = as_weight<kBf16>(mul(to_float(i8x16(b + 18)), d));
  } else if constexpr (T == gguf::Q4_K || T == gguf::Q5_K) {
    const uint8_t* qs = b + (T == gguf::Q4_K ? 16 : 48) + (j / 2) * 32;
    const __m512i bytes_lo = u8x16(qs), bytes_hi = u8x16(qs + 16);
    if constexpr (T == gguf::Q4_K) {
      lo = lookup(j % 2 ? high_nibble(bytes_lo) : bytes_lo, low);
      hi = lookup(j % 2 ? high_nibble(bytes_hi) : bytes_hi, low);
    } else {  // bit j of qh[r] is the fifth bit of value r
      const __m512i one = _mm512_set1_epi32(1);
      const __m512i q_lo = _mm512_or_si512(
          nibble(bytes_lo, j % 2), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u8x16(b + 16), j), one), 4));
      const __m512i q_hi = _mm512_or_si512(
          nibble(bytes_hi, j % 2), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u8x16(b + 32), j), one), 4));
      lo = lookup(q_lo, low, high);
      hi = lookup(q_hi, low, high);
    }
  } else {  // Q6_K: see gguf::block_value for the layout
    static_assert(T == gguf::Q6_K, "dq32: unsupported block type");
    const int i = static_cast<int>(k % kValues), h = i / 128, group = (i % 128) / 32;
    const __m256i codes = q6_codes(b + h * 64 + (group % 2) * 32, b + 128 + h * 32, group);
    // d * sc of values i .. i + 15 and i + 16 .. i + 31
    lo = as_weight<kBf16>(mul(_mm512_set1_ps(ks[i / 16]), low_codes(codes)));
    hi = as_weight<kBf16>(mul(_mm512_set1_ps(ks[i / 16 + 1]), high_codes(codes)));
  }
}

// Values k .. k + 31 of `row` rounded to bfloat16, 32 to a register in memory order (VDPBF16PS's
// operand). VCVTNE2PS2BF16 rounds as c10 does (nearest even) except that it reads subnormal
// inputs as zero, and no value of a block is a float32 subnormal: every float16 is a multiple of
// 2^-24, and so is each product and sum of them with integer codes (rounded or not), so a
// non-zero value is at least 2^-24. (A NaN, from a non-finite scale, comes out as some NaN, as
// from torch's own casts.) The table types round their 16 or 32 code values and look each weight
// up among them by a 16-bit permute (VPERMW, 5 index bits), the others convert values.
template <int T>
DARTREE_AVX512BF16 inline __m512i dq32_bf16(const uint8_t* row, int64_t k, const float* ks) {
  if constexpr (T == gguf::Q8_0 || T == gguf::Q6_K) {
    __m512 lo, hi;
    dq32<T>(row, k, lo, hi, ks);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  } else {
    constexpr int kValues = gguf::block_values(T), kBytes = gguf::block_bytes(T);
    const uint8_t* b = row + (k / kValues) * kBytes;
    const int j = static_cast<int>(k % kValues) / 32;
    __m512 low, high;
    code_tables<T>(b, j, low, high, ks);
    __m512i code;  // word i: the code of value k + i
    if constexpr (T == gguf::Q4_K || T == gguf::Q5_K) {  // nibble j % 2 of 32 bytes
      const uint8_t* qs = b + (T == gguf::Q4_K ? 16 : 48) + (j / 2) * 32;
      code = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)));
      if (j % 2) code = _mm512_srli_epi16(code, 4);
    } else {  // values 0 .. 15: the low nibbles of 16 bytes, 16 .. 31: their high nibbles
      const uint8_t* qs = b + (T == gguf::Q4_0 ? 2 : T == gguf::Q4_1 ? 4 : T == gguf::Q5_0 ? 6 : 8);
      code = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))));
      code = _mm512_mask_srli_epi16(code, 0xFFFF0000u, code, 4);
    }
    if constexpr (T == gguf::Q4_0 || T == gguf::Q4_1 || T == gguf::Q4_K) {
      // The table twice: VPERMW reads 5 index bits, the fifth a low nibble's neighbour.
      return _mm512_permutexvar_epi16(code, (__m512i)_mm512_cvtne2ps_pbh(low, low));
    } else {  // 5-bit codes: the nibble, and the fifth bit from a mask of 32
      __mmask32 fifth;
      if constexpr (T == gguf::Q5_K) {  // bit j of qh[r], r = 0 .. 31
        fifth = _mm256_test_epi8_mask(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)),
                                      _mm256_set1_epi8(static_cast<char>(1 << j)));
      } else {
        uint32_t bits;
        std::memcpy(&bits, b + (T == gguf::Q5_0 ? 2 : 4), sizeof(bits));
        fifth = bits;
      }
      code = _mm512_and_si512(code, _mm512_set1_epi16(0x0F));
      code = _mm512_mask_add_epi16(code, fifth, code, _mm512_set1_epi16(16));  // an or: bit 4 is clear
      return _mm512_permutexvar_epi16(code, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
  }
}

// A tile's N row pointers: row i of `base` (row stride `stride`), rows past n repeating the last
// (their sums are computed and dropped, so a tile never branches on its shape).
template <int N, typename P>
inline void tile_rows(const P* base, int n, int64_t stride, const P* (&out)[N]) {
  for (int i = 0; i < N; ++i) out[i] = base + std::min(i, n - 1) * stride;
}
// The next tile's packed rows into L2, a few cache lines at each of this tile's k-steps (its NR
// rows lie back to back: one span of NR * row_bytes bytes, all requested by the tile's end). A
// one-row call streams its weights from memory, and the hardware prefetcher, seeing NR interleaved
// row streams, keeps too few lines in flight. A 256 MB Q4_1 matrix, K 576 / 1536, bfloat16, one
// row (EPYC Zen 4, 2 threads, a standalone timing loop over packed_tile_bf16) streamed at 8.3-10.8
// GB/s with a prefetch of each row's next block in the next tile, 13.1-14.1 GB/s with this one.
struct NextTile {
  const uint8_t* next;  // the span after this tile's
  int64_t lines, per_step;
  NextTile(const uint8_t* rows, int64_t span, int64_t steps)
      : next(rows + span), lines((span + 63) / 64), per_step(((span + 63) / 64 + steps - 1) / steps) {}
  void operator()(int64_t step) const {  // prefetcht1; past the tensor's end it reads nothing
    for (int64_t l = step * per_step, end = std::min(lines, l + per_step); l < end; ++l)
      __builtin_prefetch(next + l * 64, 0, 2);
  }
};

// The k_scales of each of N packed rows for the super-block that holds k, refreshed as k enters
// the next one (K-quants; other types keep nothing and give nullptr).
template <int T, int N>
struct RowScales {
  static constexpr bool kKept = T == gguf::Q4_K || T == gguf::Q5_K || T == gguf::Q6_K;
  alignas(64) float s[kKept ? N : 1][16];
  DARTREE_AVX512 inline void at_k(const uint8_t* const (&w)[N], int64_t k) {
    if constexpr (kKept) {
      if (k % 256 == 0)
        for (int j = 0; j < N; ++j) k_scales<T>(w[j] + (k / 256) * gguf::block_bytes(T), s[j]);
    }
  }
  const float* of(int j) const {
    if constexpr (kKept) return s[j];
    return nullptr;
  }
};

// exact_lin::tile_avx512<MR, NR, scalar_t> over packed rows (see the header comment): x [mr, K]
// (float32 or bfloat16) row stride K, rows [nr] packed rows of row_bytes, out [mr][NR] float sums
// before the bias.
template <int T, int MR, int NR, typename scalar_t>
DARTREE_AVX512 DARTREE_HOT void packed_tile(const scalar_t* x_in, int mr, const uint8_t* rows, int64_t row_bytes, int nr,
                                int64_t K, float* out) {
  using Load = exact_lin::Avx512Loader<scalar_t>;
  constexpr bool kBf16 = Bits16Of<scalar_t>::value == Bits16::kBFloat16;
  static_assert(kBf16 || std::is_same_v<scalar_t, float>, "packed_tile: float32 or bfloat16 x");
  const scalar_t* x[MR];
  const uint8_t* w[NR];
  tile_rows(x_in, mr, K, x);
  tile_rows(rows, nr, row_bytes, w);
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const NextTile prefetch(rows, NR * row_bytes, K / 32);
  RowScales<T, NR> scales;
  // Software-pipelined where the registers allow (as packed_tile_bf16): step k + 32's weights are
  // rebuilt while step k's products run. kAhead: the MR x NR sums and two steps' lo / hi of NR rows
  // fit in 28 of the 32 registers (not the 1 x 8 and 4 x 4 tiles, which would spill).
  constexpr bool kAhead = MR * NR + 4 * NR <= 28;
  __m512 lo[NR], hi[NR];
  if constexpr (kAhead) {
    scales.at_k(w, 0);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) dq32<T, kBf16>(w[j], 0, lo[j], hi[j], scales.of(j));
  }
  for (int64_t k = 0; k < K; k += 32) {
    prefetch(k / 32);
    __m512 next_lo[NR], next_hi[NR];
    if constexpr (kAhead) {
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) next_lo[j] = lo[j], next_hi[j] = hi[j];  // the last step rebuilds nothing
      if (k + 32 < K) {
        scales.at_k(w, k + 32);
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) dq32<T, kBf16>(w[j], k + 32, next_lo[j], next_hi[j], scales.of(j));
      }
    } else {
      scales.at_k(w, k);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) dq32<T, kBf16>(w[j], k, lo[j], hi[j], scales.of(j));
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {  // k .. k + 15, then k + 16 .. k + 31: exact_linear's order
      __m512 a = Load::load(x[i] + k), a2 = Load::load(x[i] + k + 16);
      // x read once a step, into registers the NR products share: GCC otherwise folds the load
      // into every FMA, NR loads of the same bytes (the 8 x 2 float32 tile: 32 loads a step, as
      // many as its FMAs, and Zen 4 loads one 512-bit operand a cycle)
      if constexpr (NR > 1) asm("" : "+v"(a), "+v"(a2));
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(a2, hi[j], _mm512_fmadd_ps(a, lo[j], acc[i][j]));
    }
    if constexpr (kAhead) {
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) lo[j] = next_lo[j], hi[j] = next_hi[j];
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) out[i * NR + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// exact_lin::tile_avx512_bf16<MR, NR> over packed rows: x [mr, K] bfloat16 bits, the weights
// rounded to bfloat16 in registers, one VDPBF16PS per 32 k into each output's 16 lanes (K % 32 ==
// 0 for every block type: no tail step). A function of its own rather than a branch of
// packed_tile: it needs the AVX512-BF16 target, which packed_tile must not assume.
template <int T, int MR, int NR>
DARTREE_AVX512BF16 DARTREE_HOT void packed_tile_bf16(const uint16_t* x_in, int mr, const uint8_t* rows, int64_t row_bytes,
                                         int nr, int64_t K, float* out) {
  const uint16_t* x[MR];
  const uint8_t* w[NR];
  tile_rows(x_in, mr, K, x);
  tile_rows(rows, nr, row_bytes, w);
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const NextTile prefetch(rows, NR * row_bytes, K / 32);
  RowScales<T, NR> scales;
  // Software-pipelined: the weights of step k + 32 are rebuilt while step k's products run, so the
  // products never wait on the rebuild's long chain of shuffles (the same operations, in the same
  // order for every output: the bits do not move).
  __m512bh b[NR];
  scales.at_k(w, 0);
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) b[j] = (__m512bh)dq32_bf16<T>(w[j], 0, scales.of(j));
  for (int64_t k = 0; k < K; k += 32) {
    prefetch(k / 32);
    __m512bh next[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) next[j] = b[j];  // the last step rebuilds nothing
    if (k + 32 < K) {
      scales.at_k(w, k + 32);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) next[j] = (__m512bh)dq32_bf16<T>(w[j], k + 32, scales.of(j));
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = exact_lin::load_bf16x32(x[i] + k);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) b[j] = next[j];
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) out[i * NR + j] = _mm512_reduce_add_ps(acc[i][j]);
}

constexpr int64_t kMaxFusedRows = 8;      // calls of up to this many rows dequantise in registers
constexpr int64_t kMaxFmaRows = 9;        // ... on the AVX-512 FMA tiles (9 x 2: 26 registers)
constexpr int64_t kMaxSplitRows = 16;     // in groups of at most those; more: scratch
constexpr int64_t kMaxFmaSplitRows = 18;  // ... float32 on the FMA tiles (the launcher: not Q5_K)

// packed_tile_bf16 behind packed_tile's signature (x as bfloat16 bits).
template <int T, int MR, int NR, typename scalar_t>
void packed_tile_vdp(const scalar_t* x, int mr, const uint8_t* rows, int64_t row_bytes, int nr, int64_t K,
                     float* out) {
  packed_tile_bf16<T, MR, NR>(reinterpret_cast<const uint16_t*>(x), mr, rows, row_bytes, nr, K, out);
}

// Which tiles run_small takes: exact_linear's choice of arithmetic on this CPU under the cap.
enum class SmallTiles { kAvx2, kAvx512, kVdpbf16 };

// out [M, N] = x [M, K] W^T + bias for M <= kMaxFusedRows (kMaxFmaRows on the FMA tiles; float32,
// or bfloat16 where exact_linear does not take AMX: `path` = its tiles, AVX2 ones from
// packed_avx2.h), W the packed rows, with exact_lin::run_rows's
// work split (RowBlocks: about kBlockN rows per task) and its epilogue (the bias added in float, then
// rounded to scalar_t). The tile shape is free: it only decides which outputs share a dequantised
// weight, never how one is summed. All M rows of x share each one, so a weight is rebuilt once per
// call. Weight rows a tile: 8 for one row, 4 for 2-4; for 5-9 rows, 2 on the FMA tiles and 3 on
// the VDPBF16PS ones (5 rows: 4), which ran 4-8% (8 rows) and 5-24% (5-6 rows) faster than 2 on
// every type, bfloat16, 2 threads, EPYC Zen 4 (`python bench/packed_linear.py --dtype bfloat16
// --rows 4,5,6,8 --against ...`). The FMA tiles stay at 2: 4 gained 7-13% on Q4_K and Q8_0 but
// lost 4-17% on Q5_0/1, Q5_K and Q6_K at 8 rows (32 sums spill), within the noise on Q4_0/1.
template <int T, typename scalar_t, typename Par>
void run_small(const scalar_t* x, const uint8_t* rows, int64_t row_bytes, const scalar_t* bias, int64_t M,
               int64_t N, int64_t K, scalar_t* out, SmallTiles path, const Par& par) {
  using Tile = void (*)(const scalar_t*, int, const uint8_t*, int64_t, int, int64_t, float*);
  static constexpr Tile kFma[kMaxFmaRows] = {
      packed_tile<T, 1, 8, scalar_t>, packed_tile<T, 2, 4, scalar_t>, packed_tile<T, 3, 4, scalar_t>,
      packed_tile<T, 4, 4, scalar_t>, packed_tile<T, 5, 2, scalar_t>, packed_tile<T, 6, 2, scalar_t>,
      packed_tile<T, 7, 2, scalar_t>, packed_tile<T, 8, 2, scalar_t>, packed_tile<T, 9, 2, scalar_t>};
  static constexpr int kFmaWidths[kMaxFmaRows] = {8, 4, 4, 4, 2, 2, 2, 2, 2};
  // AVX2: 16 registers, so at most 8 sums a tile; x as float32 (bfloat16 widened once here: each
  // tile would widen it again for every weight row)
  using Avx2Tile = void (*)(const float*, int, const uint8_t*, int64_t, int, int64_t, float*);
  constexpr bool kRound = !std::is_same_v<scalar_t, float>;
  static constexpr Avx2Tile kAvx2[kMaxFusedRows] = {
      packed_avx2::packed_tile<T, 1, 4, kRound>, packed_avx2::packed_tile<T, 2, 4, kRound>,
      packed_avx2::packed_tile<T, 3, 2, kRound>, packed_avx2::packed_tile<T, 4, 2, kRound>,
      packed_avx2::packed_tile<T, 5, 1, kRound>, packed_avx2::packed_tile<T, 6, 1, kRound>,
      packed_avx2::packed_tile<T, 7, 1, kRound>, packed_avx2::packed_tile<T, 8, 1, kRound>};
  static constexpr int kAvx2Widths[kMaxFusedRows] = {4, 4, 2, 2, 1, 1, 1, 1};
  const int mr = static_cast<int>(M);
  const bool avx2 = path == SmallTiles::kAvx2;
  Tile tile = kFma[mr - 1];
  int width = kFmaWidths[mr - 1];
  if constexpr (!std::is_same_v<scalar_t, float>) {
    static constexpr Tile kVdp[kMaxFusedRows] = {
        packed_tile_vdp<T, 1, 8, scalar_t>, packed_tile_vdp<T, 2, 4, scalar_t>, packed_tile_vdp<T, 3, 4, scalar_t>,
        packed_tile_vdp<T, 4, 4, scalar_t>, packed_tile_vdp<T, 5, 4, scalar_t>, packed_tile_vdp<T, 6, 3, scalar_t>,
        packed_tile_vdp<T, 7, 3, scalar_t>, packed_tile_vdp<T, 8, 3, scalar_t>};
    static constexpr int kVdpWidths[kMaxFusedRows] = {8, 4, 4, 4, 4, 3, 3, 3};
    if (path == SmallTiles::kVdpbf16) tile = kVdp[mr - 1], width = kVdpWidths[mr - 1];
  }
  if (avx2) width = kAvx2Widths[mr - 1];
  std::vector<float> widened;
  const float* x32 = nullptr;
  if (avx2) {
    if constexpr (kRound) {
      widened.resize(static_cast<size_t>(M * K));
      packed_avx2::widen_bf16(reinterpret_cast<const uint16_t*>(x), M * K, widened.data());
      x32 = widened.data();
    } else {
      x32 = x;
    }
  }
  const exact_lin::RowBlocks blocks(N, par.threads());
  par(0, blocks.count, 1, [&](int64_t begin, int64_t end) {
    float acc[8 * 4];  // [mr][width]: at most 1 x 8, 4 x 4, 5 x 4, 8 x 3, 9 x 2
    for (int64_t n0 = blocks.begin(begin), n_end = blocks.begin(end); n0 < n_end; n0 += width) {
      const int nr = static_cast<int>(std::min<int64_t>(width, n_end - n0));
      if (avx2) kAvx2[mr - 1](x32, mr, rows + n0 * row_bytes, row_bytes, nr, K, acc);
      else tile(x, mr, rows + n0 * row_bytes, row_bytes, nr, K, acc);
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j) {
          float v = acc[i * width + j];
          if (bias != nullptr) v += static_cast<float>(bias[n0 + j]);
          out[i * N + n0 + j] = static_cast<scalar_t>(v);
        }
    }
  });
}

// Rows of one block type into float32 scratch [rows, K].
template <int T>
DARTREE_AVX512 void fill_rows(const uint8_t* rows, int64_t row_bytes, int64_t count, int64_t K, float* dst) {
  for (int64_t r = 0; r < count; ++r) {
    const uint8_t* row[1] = {rows + r * row_bytes};
    RowScales<T, 1> scales;
    for (int64_t k = 0; k < K; k += 32) {
      scales.at_k(row, k);
      __m512 lo, hi;
      dq32<T>(row[0], k, lo, hi, scales.of(0));
      _mm512_storeu_ps(dst + r * K + k, lo);
      _mm512_storeu_ps(dst + r * K + k + 16, hi);
    }
  }
}

// Rows of one block type into bfloat16 scratch [rows, K], rounded as c10::BFloat16(float) rounds
// (the scratch path's weights for bfloat16 activations) in one pass: dq32<T, true>'s rounded
// values, whose bits are their top halves; with AVX512-BF16, dq32_bf16's (the same bits, the
// tables rounded once a block).
template <int T>
DARTREE_AVX512 void fill_rows_bf16(const uint8_t* rows, int64_t row_bytes, int64_t count, int64_t K, uint16_t* dst) {
  for (int64_t r = 0; r < count; ++r) {
    const uint8_t* row[1] = {rows + r * row_bytes};
    RowScales<T, 1> scales;
    for (int64_t k = 0; k < K; k += 32) {
      scales.at_k(row, k);
      __m512 lo, hi;
      dq32<T, true>(row[0], k, lo, hi, scales.of(0));
      uint16_t* out = dst + r * K + k;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(lo), 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(hi), 16)));
    }
  }
}
template <int T>
DARTREE_AVX512BF16 void fill_rows_bf16_vdp(const uint8_t* rows, int64_t row_bytes, int64_t count, int64_t K,
                                           uint16_t* dst) {
  for (int64_t r = 0; r < count; ++r) {
    const uint8_t* row[1] = {rows + r * row_bytes};
    RowScales<T, 1> scales;
    for (int64_t k = 0; k < K; k += 32) {
      scales.at_k(row, k);
      _mm512_storeu_si512(dst + r * K + k, dq32_bf16<T>(row[0], k, scales.of(0)));
    }
  }
}

// The launcher's switch from a GGML type number to the kernels above.
template <typename F>
decltype(auto) with_type(int type, const F& f) {
  switch (type) {
    case gguf::Q4_0: return f(std::integral_constant<int, gguf::Q4_0>());
    case gguf::Q4_1: return f(std::integral_constant<int, gguf::Q4_1>());
    case gguf::Q5_0: return f(std::integral_constant<int, gguf::Q5_0>());
    case gguf::Q5_1: return f(std::integral_constant<int, gguf::Q5_1>());
    case gguf::Q8_0: return f(std::integral_constant<int, gguf::Q8_0>());
    case gguf::Q4_K: return f(std::integral_constant<int, gguf::Q4_K>());
    case gguf::Q5_K: return f(std::integral_constant<int, gguf::Q5_K>());
    default: return f(std::integral_constant<int, gguf::Q6_K>());  // the checks admit no other
  }
}
#endif  // DARTREE_X86

}  // namespace packed
}  // namespace cpu
}  // namespace dartree
