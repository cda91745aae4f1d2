// CUDA launcher of expand_level, one DARTree level (kernels and launch: dartree/expand_level.cuh;
// the op body shared with the CPU: csrc/tree_ops.h): the kernels' limits, the stream. Unlike every
// other tree op it reads device memory: the candidate ids the GRU reads are checked on the host,
// as on the CPU (the same error instead of NaN states) -- one sync, in this standalone op only;
// the engine's fused build_dartree reads none.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../tree_ops.h"
#include "dartree/expand_level.cuh"
#include "launcher.h"
#include "level_limits.h"

namespace dartree {

struct CudaLevel {
  static void check_expand_level(const LevelShape& s, const at::Tensor& cand_ids) {
    check_level_limits(s.f, s.C, s.E, s.Q, s.r, s.G, "expand_level");
    if (s.gru) {
      const at::Tensor ids = cand_ids.slice(0, 0, s.E).cpu();
      check_ids_in_vocab(ids.data_ptr<int64_t>(), s.E, s.vocab, "expand_level", "input_table");
    }
  }

  template <typename T>
  static void expand_level(const at::Device& device, const LevelArgs<T>& a) {
    const c10::cuda::CUDAGuard guard(device);
    StreamLauncher launcher(device);
    launch_expand_level(launcher, a);
  }
};

TORCH_LIBRARY_IMPL(dartree, CUDA, m) { m.impl("expand_level", &expand_level_op<CudaLevel>); }

}  // namespace dartree
