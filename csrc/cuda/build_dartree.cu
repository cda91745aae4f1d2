// CUDA launcher of build_dartree (launch: dartree/build_dartree.cuh, the same code the CUDA
// emulator test runs; the op body shared with the CPU: csrc/tree_ops.h): the kernels' limits, the
// stream. No value is read on the host: bad ids and a pruned parent come back through `status`,
// so the engine's draft step never synchronises.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../tree_ops.h"
#include "dartree/build_dartree.cuh"
#include "launcher.h"
#include "level_limits.h"

namespace dartree {

struct CudaBuild {
  static void check_build_dartree(const BuildShape& s, const at::Tensor&, const at::Tensor&,
                                  int64_t) {
    check_level_limits(s.max_width, s.C, s.E, s.max_width, s.r, s.G, "build_dartree");
    check_int_range(1 + s.total, "build_dartree", "tree size");
    TORCH_CHECK_VALUE(s.N - 1 <= kMaxSelect, "build_dartree: the CUDA kernel keeps at most ",
                      kMaxSelect, " nodes besides the root, got ", s.N - 1);
  }

  template <typename T>
  static void build_dartree(const at::Device& device, const BuildShape& s, const BuildInputs<T>& in,
                            const BuildOutputs<T>& out) {
    const c10::cuda::CUDAGuard guard(device);
    StreamLauncher launcher(device);
    launch_build_dartree(launcher, s, in, out);
  }
};

TORCH_LIBRARY_IMPL(dartree, CUDA, m) { m.impl("build_dartree", &build_dartree_op<CudaBuild>); }

}  // namespace dartree
