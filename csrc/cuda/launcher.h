// The launcher the torch-free launch code of the kernel headers (dartree/*.cuh: launch_*) runs
// through on a GPU. That code is also run, unchanged, by the CUDA emulator test
// (tests/cuda_emu/tree_ops_emu.cpp) with a launcher of the same three members:
//
//   launch(grid, block, smem_bytes, kernel, args...)  kernel<<<grid, block, smem, stream>>>(args...)
//   scratch<T>(count, name) -> T*                     device memory for count T, alive as long
//                                                     as the launcher (the caching allocator)
//   zero(ptr, bytes)                                  an async memset on the stream
//
// Nothing here synchronises with the host.
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

namespace dartree {

class StreamLauncher {
 public:
  // Call it under the op's CUDAGuard: it takes the current stream of the current device.
  explicit StreamLauncher(const at::Device& device)
      : stream_(c10::cuda::getCurrentCUDAStream()),
        bytes_(at::TensorOptions().dtype(at::kByte).device(device)) {}

  template <typename Kernel, typename... Args>
  void launch(dim3 grid, dim3 block, size_t smem_bytes, Kernel kernel, Args... args) {
    kernel<<<grid, block, smem_bytes, stream_>>>(args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename T>
  T* scratch(int64_t count, const char* /*name*/) {
    held_.push_back(at::empty({count * static_cast<int64_t>(sizeof(T))}, bytes_));
    return reinterpret_cast<T*>(held_.back().data_ptr());
  }

  void zero(void* data, size_t bytes) {
    if (bytes > 0) C10_CUDA_CHECK(cudaMemsetAsync(data, 0, bytes, stream_));
  }

 private:
  cudaStream_t stream_;
  at::TensorOptions bytes_;
  std::vector<at::Tensor> held_;  // scratch, released (stream-ordered) with the launcher
};

}  // namespace dartree
