// AVX2/FMA helpers for the CPU draft-tree kernels, compiled per function with
// __attribute__((target("avx2,fma"))) and chosen at run time (has_avx2()), so the extension still
// loads on a CPU without AVX2 and takes the portable loops there.
//
// exp8 / sigmoid8 / tanh8 are float32 approximations (<= 3 ulp for exp, a few 1e-7 absolute for
// sigmoid and tanh): tests compare float32 results with a float32 tolerance; float64 always takes
// the exact std:: functions.
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#define DARTREE_X86 1
#include <immintrin.h>
#else
#define DARTREE_X86 0
#endif

namespace dartree {
namespace cpu {

inline bool has_avx2() {
#if DARTREE_X86 && defined(__GNUC__)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

// The 16-bit float storage types, named without torch: the launchers specialise Bits16Of for
// torch's bfloat16 and float16 (csrc/cpu/torch_types.h), so that a kernel templated on the storage
// type can take the conversions below.
enum class Bits16 { kNone, kBFloat16, kFloat16 };
template <typename S>
struct Bits16Of {
  static constexpr Bits16 value = Bits16::kNone;
};

// Scalar conversions of the 16-bit float formats (bit patterns), for any compiler.
inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float out;
  __builtin_memcpy(&out, &u, 4);
  return out;
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t u;
  if (exponent == 0x1f) {
    u = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    u = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    u = sign;
  } else {  // subnormal half: normalise
    exponent = 113;
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      --exponent;
    }
    u = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float out;
  __builtin_memcpy(&out, &u, 4);
  return out;
}

#if DARTREE_X86 && defined(__GNUC__)
#define DARTREE_AVX2 __attribute__((target("avx2,fma,f16c")))
// A hot kernel's entry on a 64-byte boundary, so that its loops sit at the same offsets from the
// cache lines in every build: where the linker happened to place the same code, a one-row Q4_1
// packed tile ran 0.67-0.73x (bfloat16, EPYC Zen 4) after an unrelated change moved it.
#define DARTREE_HOT __attribute__((aligned(64)))

// a * b, which the compiler cannot fuse into a following add (GCC contracts vector intrinsics
// too; an FMA rounds once): the empty asm hides the product's value.
DARTREE_AVX2 inline __m256 product8(__m256 a, __m256 b) {
  __m256 p = _mm256_mul_ps(a, b);
  asm("" : "+x"(p));
  return p;
}
// bfloat16 bits of 8 floats (in the low halves of 32-bit lanes), rounded as c10::BFloat16(float)
// rounds: nearest even, NaN -> 0x7FC0.
DARTREE_AVX2 inline __m256i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

DARTREE_AVX2 inline float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

DARTREE_AVX2 inline float hmax8(__m256 v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// Mask selecting the first n (0..8) lanes, for tail loads and stores.
DARTREE_AVX2 inline __m256i tail_mask(int64_t n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes);
}

// Cephes expf core for v in [-87.3, 88.7]: exp(v) = p * 2^n with v = n ln2 + r, |r| <= ln2 / 2;
// returns p and writes n.
DARTREE_AVX2 inline __m256 exp8_core(__m256 v, __m256i* n) {
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  v = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), v);
  v = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), v);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(5.0000001201E-1f));
  *n = _mm256_cvtps_epi32(fx);
  return _mm256_fmadd_ps(y, _mm256_mul_ps(v, v), _mm256_add_ps(v, _mm256_set1_ps(1.0f)));
}

// exp(x) for 8 floats: inputs below -87.3 give 0, above 88.7 give +inf, NaN stays NaN.
DARTREE_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.7228391f), lo = _mm256_set1_ps(-87.3365447f);
  const __m256 too_small = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 too_big = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  __m256i n;
  __m256 y = exp8_core(_mm256_min_ps(_mm256_max_ps(x, lo), hi), &n);
  // y * 2^n with n in [-126, 128]: 2^128 is not a float, so scale by two halves of n.
  const __m256i half = _mm256_srai_epi32(n, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(n, half), bias), 23));
  y = _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
  y = _mm256_andnot_ps(too_small, y);
  y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), too_big);
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // NaN in, NaN out
}

// exp(x) for x <= 0 (x - max in a softmax): no overflow handling; x < -87.3 (masked -inf
// included) gives exactly 0, NaN stays NaN (max returns its second operand for NaN).
DARTREE_AVX2 inline __m256 exp8_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3365447f);
  const __m256 too_small = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  __m256i n;
  const __m256 y = exp8_core(_mm256_max_ps(lo, x), &n);
  // n in [-126, 0]: 2^n is one normal float
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(too_small, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

DARTREE_AVX2 inline __m256 sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

// x * sigmoid(x) written as PyTorch does: x / (1 + exp(-x)).
DARTREE_AVX2 inline __m256 silu8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

// tanh as a 13/6 rational function on [-9, 9] (Eigen's fast tanh), exact sign, |x| > 9 -> +-1.
DARTREE_AVX2 inline __m256 tanh8(__m256 x) {
  const __m256 clamp = _mm256_set1_ps(7.90531110763549805f);
  __m256 v = _mm256_min_ps(_mm256_max_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), clamp)), clamp);
  const __m256 tiny = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x),
                                    _mm256_set1_ps(0.0004f), _CMP_LT_OQ);
  const __m256 v2 = _mm256_mul_ps(v, v);
  __m256 p = _mm256_set1_ps(-2.76076847742355e-16f);
  p = _mm256_fmadd_ps(v2, p, _mm256_set1_ps(2.00018790482477e-13f));
  p = _mm256_fmadd_ps(v2, p, _mm256_set1_ps(-8.60467152213735e-11f));
  p = _mm256_fmadd_ps(v2, p, _mm256_set1_ps(5.12229709037114e-08f));
  p = _mm256_fmadd_ps(v2, p, _mm256_set1_ps(1.48572235717979e-05f));
  p = _mm256_fmadd_ps(v2, p, _mm256_set1_ps(6.37261928875436e-04f));
  p = _mm256_fmadd_ps(v2, p, _mm256_set1_ps(4.89352455891786e-03f));
  p = _mm256_mul_ps(v, p);
  __m256 q = _mm256_set1_ps(1.19825839466702e-06f);
  q = _mm256_fmadd_ps(v2, q, _mm256_set1_ps(1.18534705686654e-04f));
  q = _mm256_fmadd_ps(v2, q, _mm256_set1_ps(2.26843463243900e-03f));
  q = _mm256_fmadd_ps(v2, q, _mm256_set1_ps(4.89352518554385e-03f));
  const __m256 out = _mm256_div_ps(p, q);
  return _mm256_blendv_ps(out, x, _mm256_or_ps(tiny, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

// 8 consecutive elements as floats, from float, bfloat16 or float16 storage.
DARTREE_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
DARTREE_AVX2 inline __m256 load8_bf16(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
DARTREE_AVX2 inline __m256 load8_fp16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif  // DARTREE_X86

}  // namespace cpu
}  // namespace dartree
