// CPU launcher of candidate_topk (kernel: dartree/cpu/candidate_topk.h): checks, the dtype
// dispatch, and rows split over threads for large vocabularies only.
#include <torch/library.h>

#include <vector>

#include "../tree_checks.h"
#include "dartree/cpu/candidate_topk.h"
#include "tree_parallel.h"

namespace dartree {

template <typename In>
static void topk_rows(const at::Tensor& logits, at::Tensor& values, at::Tensor& ids, at::Tensor& lse,
                      int64_t count) {
  using Acc = typename cpu::Load<In>::Acc;
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const In* x = reinterpret_cast<const In*>(logits.data_ptr());
  Acc* out_values = values.data_ptr<Acc>();
  int64_t* out_ids = ids.data_ptr<int64_t>();
  Acc* out_lse = lse.numel() ? lse.data_ptr<Acc>() : nullptr;
  // per entry: ~1 compare without the lse, an exp (~16 multiply-adds' worth) with it
  const int64_t cost = vocab * (out_lse != nullptr ? 16 : 1);
  cpu::Parallel()(rows, cost, [&](int64_t begin, int64_t end) {
    std::vector<cpu::Ranked<Acc>> pool(4 * count);
    for (int64_t row = begin; row < end; ++row) {
      cpu::candidate_topk_row<In>(x + row * vocab, vocab, count, out_values + row * count,
                                  out_ids + row * count, out_lse ? out_lse + row : nullptr,
                                  pool.data());
    }
  });
}

void candidate_topk_cpu(const at::Tensor& logits, at::Tensor values, at::Tensor ids, at::Tensor lse) {
  const int64_t count = check_candidate_topk(logits, values, ids, lse);
  switch (logits.scalar_type()) {
    case at::kFloat: topk_rows<float>(logits, values, ids, lse, count); break;
    case at::kDouble: topk_rows<double>(logits, values, ids, lse, count); break;
    case at::kHalf: topk_rows<cpu::Fp16>(logits, values, ids, lse, count); break;
    default: topk_rows<cpu::Bf16>(logits, values, ids, lse, count); break;
  }
}

TORCH_LIBRARY_IMPL(dartree, CPU, m) { m.impl("candidate_topk", &candidate_topk_cpu); }

}  // namespace dartree
