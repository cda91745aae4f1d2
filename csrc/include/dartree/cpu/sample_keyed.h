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

#include "../sample_keyed.cuh"

namespace dartree {
namespace cpu {

template <typename In>
int64_t argmax_row(const In* logits, int64_t vocab) {
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
