// CUDA launcher for csrc/include/dartree/sample_keyed.cuh: one block per logits row. Shapes are
// checked on the host; no value is read back (no sync). Any int64 position is a valid key.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../sample_checks.h"
#include "dartree/sample_keyed.cuh"

namespace dartree {

void sample_keyed_cuda(const at::Tensor& logits, const at::Tensor& positions, int64_t seed,
                       double temperature, at::Tensor tokens) {
  const float inv_t = check_sample_keyed(logits, positions, temperature, tokens);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (rows == 0) return;
  TORCH_CHECK_VALUE(rows < (1ll << 31), "sample_keyed: ", rows, " rows is too many for one launch");
  const c10::cuda::CUDAGuard guard(logits.device());
  constexpr int kThreads = 256;
  const uint64_t key = keyed::seed_key(static_cast<uint64_t>(seed));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "sample_keyed_cuda", [&] {
    sample_keyed_kernel<scalar_t, kThreads>
        <<<static_cast<unsigned>(rows), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            logits.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(), vocab, key, inv_t,
            temperature == 0, tokens.data_ptr<int64_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

TORCH_LIBRARY_IMPL(dartree, CUDA, m) { m.impl("sample_keyed", &sample_keyed_cuda); }

}  // namespace dartree
