// CPU launcher of sample_keyed (kernel: dartree/cpu/sample_keyed.h): checks, the dtype dispatch,
// rows split over threads for large calls only.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "../sample_checks.h"
#include "torch_types.h"
#include "dartree/cpu/sample_keyed.h"
#include "launchers.h"
#include "tree_parallel.h"

namespace dartree {

void sample_keyed_cpu(const at::Tensor& logits, const at::Tensor& positions, int64_t seed,
                      double temperature, at::Tensor tokens) {
  const float inv_t = check_sample_keyed(logits, positions, temperature, tokens);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const uint64_t key = keyed::seed_key(static_cast<uint64_t>(seed));
  const bool avx2 = exact_isa_cap() >= 1 && cpu::has_avx2();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "sample_keyed_cpu", [&] {
    const scalar_t* data = logits.data_ptr<scalar_t>();
    // ~8 units per token sampled (a skipped token costs 2, a scored one ~40), 1 for an argmax:
    // small calls stay on one thread
    cpu::Parallel{}(rows, (temperature == 0 ? 1 : 8) * vocab, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = data + t * vocab;
        out[t] = temperature == 0 ? cpu::argmax_row(row, vocab, avx2)
                                  : cpu::sample_row(row, vocab, keyed::row_key(key, pos[t]), inv_t);
      }
    });
  });
}

TORCH_LIBRARY_IMPL(dartree, CPU, m) { m.impl("sample_keyed", &sample_keyed_cpu); }

}  // namespace dartree
