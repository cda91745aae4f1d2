// CUDA launcher for csrc/include/dartree/kv_commit.cuh. Values of `accepted` are not read on the
// host (no sync in the decode loop): the kernel skips rows outside the cache; the Python wrapper
// validates values when asked.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../checks.h"
#include "dartree/kv_commit.cuh"

namespace dartree {

template <typename Word>
static void launch_kv_commit(at::Tensor& kv, int64_t groups, int64_t prefix_len,
                             const at::Tensor& accepted) {
  const int64_t seq = kv.size(-2);
  const int64_t words = kv.size(-1) * kv.element_size() / static_cast<int64_t>(sizeof(Word));
  const int64_t threads = groups * words;
  if (threads == 0) return;
  const int64_t blocks = (threads + kCommitThreads - 1) / kCommitThreads;
  kv_commit_kernel<Word><<<blocks, kCommitThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<Word*>(kv.data_ptr()), accepted.data_ptr<int64_t>(), groups, seq, words,
      prefix_len, accepted.numel());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void kv_commit_cuda(at::Tensor kv, int64_t prefix_len, const at::Tensor& accepted) {
  const int64_t groups = check_kv_commit(kv, prefix_len, accepted, /*check_values=*/false);
  const c10::cuda::CUDAGuard guard(kv.device());
  const int64_t row_bytes = kv.size(-1) * kv.element_size();
  const auto address = reinterpret_cast<uintptr_t>(kv.data_ptr());
  // Widest word that divides a row and the base address: 16-byte moves for every usual head dim.
  if (row_bytes % 16 == 0 && address % 16 == 0) {
    launch_kv_commit<uint4>(kv, groups, prefix_len, accepted);
  } else if (row_bytes % 4 == 0 && address % 4 == 0) {
    launch_kv_commit<uint32_t>(kv, groups, prefix_len, accepted);
  } else {
    launch_kv_commit<uint8_t>(kv, groups, prefix_len, accepted);
  }
}

TORCH_LIBRARY_IMPL(dartree, CUDA, m) { m.impl("kv_commit", &kv_commit_cuda); }

}  // namespace dartree
