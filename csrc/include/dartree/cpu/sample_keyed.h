// CPU position-keyed sampling (op sample_keyed; the CUDA twin and the noise: dartree/sample_keyed.cuh):
// the same noise and order. sample_row / argmax_row: one row of logits [V] -> a token id; the
// launcher (csrc/cpu/sample_keyed.cpp) runs one row per task.
//
// Tokens that cannot win are skipped, so a peaked row pays for the hash and the two logs only
// near its top: the row's top logit is scored first, and token v, whose score is at most
// l_v * inv_t + kGumbelHi (widened by the rounding of the final add), is skipped when that is
// below the best score so far. The skip never changes the answer: it equals the full scan of
// the CUDA kernel and the reference. Per row: two cheap passes over V, the hash and two logs
// for the tokens within ~kGumbelHi / inv_t of the best.
// Assumes V >= 1 and a finite inv_t > 0 (the launcher's checks); reads the row 2-3 times.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../sample_keyed.cuh"
#include "simd.h"

namespace dartree {
namespace cpu {

// keyed::beats' order over the row (a NaN wins, then the largest, ties: the lowest id): the
// reference loop, and below it the same answer in two vector passes (the top, then its first
// index): a SmolLM2 row of 49,152 float32 took ~35 us in this loop or in torch.argmax.
template <typename In>
int64_t argmax_row_portable(const In* logits, int64_t vocab) {
  float best = static_cast<float>(logits[0]);
  int64_t index = 0;
  for (int64_t v = 1; v < vocab; ++v) {
    const float a = static_cast<float>(logits[v]);
    if (keyed::beats(a, v, best, index)) {
      best = a;
      index = v;
    }
  }
  return index;
}

#if DARTREE_X86 && defined(__GNUC__)
// row[0..8) as float32: float32, bfloat16 or float16 storage.
template <typename In>
DARTREE_AVX2 inline __m256 load8_as_float(const In* row) {
  if constexpr (Bits16Of<In>::value == Bits16::kBFloat16) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  } else if constexpr (Bits16Of<In>::value == Bits16::kFloat16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row));
  }
}

template <typename In>
DARTREE_AVX2 int64_t argmax_row_avx2(const In* row, int64_t vocab) {
  const int64_t body = vocab / 8 * 8;
  __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan8 = _mm256_setzero_ps();
  for (int64_t v = 0; v < body; v += 8) {
    const __m256 a = load8_as_float(row + v);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    top8 = _mm256_max_ps(top8, a);  // (a NaN lane is flagged above; the top is then unused)
  }
  bool nan = _mm256_movemask_ps(nan8) != 0;
  float top = hmax8(top8);
  for (int64_t v = body; v < vocab; ++v) {
    const float a = static_cast<float>(row[v]);
    nan |= a != a;
    top = a > top ? a : top;
  }
  if (nan) return argmax_row_portable(row, vocab);  // the first NaN, found by the reference
  const __m256 want = _mm256_set1_ps(top);  // (+0 == -0: the first zero of either sign, as beats)
  for (int64_t v = 0; v < body; v += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8_as_float(row + v), want, _CMP_EQ_OQ));
    if (hit) return v + __builtin_ctz(hit);
  }
  int64_t index = body;
  while (static_cast<float>(row[index]) != top) ++index;
  return index;
}
#endif

// avx2: the launcher's choice (the CPU has it and DARTREE_EXACT_ISA allows it).
template <typename In>
int64_t argmax_row(const In* logits, int64_t vocab, bool avx2) {
#if DARTREE_X86 && defined(__GNUC__)
  if constexpr (std::is_same_v<In, float> || Bits16Of<In>::value != Bits16::kNone) {
    if (avx2) return argmax_row_avx2(logits, vocab);
  }
#endif
  return argmax_row_portable(logits, vocab);
}

// The largest float c such that a scaled logit a < c cannot beat or tie a score of `best` for any
// noise value g: fl(a + g) <= a + kGumbelHi + 2^-22 |a| < best (see the header's noise range).
// -inf, skipping nothing, unless best is finite.
inline float skip_below(float best) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  if (!std::isfinite(best)) return -kInf;
  const double cut = static_cast<double>(best) - keyed::kGumbelHi -
                     0x1p-21 * (std::fabs(static_cast<double>(best)) + keyed::kGumbelHi);
  const float c = static_cast<float>(cut);
  return c > cut ? std::nextafter(c, -kInf) : c;
}

template <typename In>
int64_t sample_row(const In* logits, int64_t vocab, uint64_t row, float inv_t) {
  const auto scaled = [&](int64_t v) { return keyed::rn_mul(static_cast<float>(logits[v]), inv_t); };
  float top = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t v = 0; v < vocab; ++v) {  // branch-free: vectorises
    const float a = scaled(v);
    nan |= a != a;
    top = a > top ? a : top;
  }
  if (nan) {  // a NaN beats everything: the first one wins
    for (int64_t v = 0; v < vocab; ++v) {
      if (scaled(v) != scaled(v)) return v;
    }
  }
  // Score the first top logit first: its score makes the skip bound tight from the start.
  int64_t index = 0;
  while (scaled(index) != top) ++index;
  float best = keyed::rn_add(top, keyed::gumbel(row, index));
  float cut = skip_below(best);
  for (int64_t v = 0; v < vocab; ++v) {
    const float a = scaled(v);
    if (a < cut || v == index) continue;
    const float s = keyed::rn_add(a, keyed::gumbel(row, v));
    if (s > best || (s == best && v < index)) {
      best = s;
      index = v;
      cut = skip_below(best);
    }
  }
  return index;
}


}  // namespace cpu
}  // namespace dartree
