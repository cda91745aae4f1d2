// How the CPU draft-tree kernels use threads: only for chunks of at least kMinParallelWork
// multiply-adds (or elements). The per-level work of a realistic tree build is a few hundred
// microseconds in total, and a parallel region there costs more than it saves -- much more on a
// loaded machine, where the OpenMP workers are descheduled.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace dartree {
namespace cpu {

constexpr int64_t kMinParallelWork = 1 << 22;

// fn(begin, end) over [0, n), each item costing about `cost` units.
struct Parallel {
  template <typename F>
  void operator()(int64_t n, int64_t cost, const F& fn) const {
    const int64_t grain = std::max<int64_t>(1, kMinParallelWork / std::max<int64_t>(1, cost));
    if (n <= grain || at::get_num_threads() <= 1) {
      if (n > 0) fn(0, n);
      return;
    }
    at::parallel_for(0, n, grain, fn);
  }
};

}  // namespace cpu
}  // namespace dartree
