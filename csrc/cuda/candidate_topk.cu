// CUDA launcher of candidate_topk (kernel and launch: dartree/candidate_topk.cuh): checks, the
// dtype dispatch, the stream. No host sync.
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <climits>

#include "../tree_checks.h"
#include "dartree/candidate_topk.cuh"
#include "launcher.h"

namespace dartree {

template <typename In>
static void topk_rows(StreamLauncher& launcher, const at::Tensor& logits, at::Tensor& values,
                      at::Tensor& ids, at::Tensor& lse, int count) {
  using Acc = typename AccOf<In>::type;
  launch_candidate_topk<In>(launcher, reinterpret_cast<const In*>(logits.data_ptr()), logits.size(0),
                            logits.size(1), count, values.data_ptr<Acc>(), ids.data_ptr<int64_t>(),
                            lse.numel() ? lse.data_ptr<Acc>() : nullptr);
}

void candidate_topk_cuda(const at::Tensor& logits, at::Tensor values, at::Tensor ids, at::Tensor lse) {
  const int64_t count = check_candidate_topk(logits, values, ids, lse);
  TORCH_CHECK_VALUE(count <= kMaxSelect, "candidate_topk: the CUDA kernel selects at most ",
                    kMaxSelect, " candidates, got ", count);
  TORCH_CHECK_VALUE(logits.size(0) < INT_MAX, "candidate_topk: too many rows for the CUDA kernel");
  if (logits.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  StreamLauncher launcher(logits.device());
  const int c = static_cast<int>(count);
  switch (logits.scalar_type()) {
    case at::kFloat: topk_rows<float>(launcher, logits, values, ids, lse, c); break;
    case at::kDouble: topk_rows<double>(launcher, logits, values, ids, lse, c); break;
    case at::kHalf: topk_rows<__half>(launcher, logits, values, ids, lse, c); break;
    default: topk_rows<__nv_bfloat16>(launcher, logits, values, ids, lse, c); break;
  }
}

TORCH_LIBRARY_IMPL(dartree, CUDA, m) { m.impl("candidate_topk", &candidate_topk_cuda); }

}  // namespace dartree
