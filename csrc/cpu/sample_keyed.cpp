// CPU twin of csrc/include/dartree/sample_keyed.cuh: the same noise and order, one row per task.
//
// Tokens that cannot win are skipped, so a peaked row pays for the hash and the two logs only
// near its top: the row's best score is at least max_v fl(l_v * inv_t) + kGumbelLo and at least
// every score seen so far, and token v scores at most l_v * inv_t + kGumbelHi (both bounds
// widened by the rounding of the final add). The skip never changes the answer: it equals the
// full scan of the CUDA kernel and the reference.
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

template <typename In>
int64_t sample_row(const In* logits, int64_t vocab, uint64_t row, float inv_t) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < vocab; ++v) {
    const float a = keyed::rn_mul(static_cast<float>(logits[v]), inv_t);
    if (a != a) return v;  // a NaN beats everything: the first one wins
    if (a > top) top = a;
  }
  double lower = -kInf;  // a lower bound of the row's best score
  if (std::isfinite(top)) lower = top + keyed::kGumbelLo - 0x1p-22 * (std::fabs(top) + 3.0);
  float best = 0.0f;
  int64_t index = -1;
  for (int64_t v = 0; v < vocab; ++v) {
    const float a = keyed::rn_mul(static_cast<float>(logits[v]), inv_t);
    if (lower > -kInf) {
      const double x = a;
      if (x == -kInf || x + keyed::kGumbelHi + 0x1p-22 * (std::fabs(x) + std::fabs(lower)) < lower) {
        continue;
      }
    }
    const float s = keyed::rn_add(a, keyed::gumbel(row, v));
    if (index < 0 || s > best) {  // ascending v: an equal score keeps the lower id
      best = s;
      index = v;
      if (s > lower) lower = s;
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
