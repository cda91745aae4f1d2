// CPU twin of csrc/include/dartree/sample_keyed.cuh: the same noise and order, one row per task.
//
// Tokens that cannot win are skipped, so a peaked row pays for the hash and the two logs only
// near its top: the row's top logit is scored first, and token v, whose score is at most
// l_v * inv_t + kGumbelHi (widened by the rounding of the final add), is skipped when that is
// below the best score so far. The skip never changes the answer: it equals the full scan of
// the CUDA kernel and the reference. Per row: two cheap passes over V, the hash and two logs
// for the tokens within ~kGumbelHi / inv_t of the best.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "../sample_checks.h"
#include "tree_parallel.h"
#include "dartree/sample_keyed.cuh"

namespace dartree {
namespace {

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
float skip_below(float best) {
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

}  // namespace

void sample_keyed_cpu(const at::Tensor& logits, const at::Tensor& positions, int64_t seed,
                      double temperature, at::Tensor tokens) {
  const float inv_t = check_sample_keyed(logits, positions, temperature, tokens);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const uint64_t key = keyed::seed_key(static_cast<uint64_t>(seed));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "sample_keyed_cpu", [&] {
    const scalar_t* data = logits.data_ptr<scalar_t>();
    // ~8 units per token (a skipped token costs 2, a scored one ~40): small calls stay on one thread
    cpu::Parallel{}(rows, 8 * vocab, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = data + t * vocab;
        out[t] = temperature == 0 ? argmax_row(row, vocab)
                                  : sample_row(row, vocab, keyed::row_key(key, pos[t]), inv_t);
      }
    });
  });
}

TORCH_LIBRARY_IMPL(dartree, CPU, m) { m.impl("sample_keyed", &sample_keyed_cpu); }

}  // namespace dartree
