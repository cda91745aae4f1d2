// CPU launcher of exact_tree_attention (kernel: dartree/cpu/exact_tree_attention.h): the shared
// checks and dispatch (attention_launch.h), the kernel's threads on at::parallel_for.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>

#include "attention_launch.h"
#include "launchers.h"
#include "dartree/cpu/exact_tree_attention.h"

namespace dartree {
namespace {

struct AtenParallel {
  template <typename F>
  void operator()(int64_t begin, int64_t end, int64_t grain, const F& fn) const {
    at::parallel_for(begin, end, grain, fn);
  }
  int64_t threads() const { return at::in_parallel_region() ? 1 : at::get_num_threads(); }
};

}  // namespace

at::Tensor exact_tree_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& tree_mask, int64_t prefix_len,
                                    std::optional<double> scale) {
  return launch_tree_attention(q, k, v, tree_mask, prefix_len, scale,
                               [](const auto& p, int64_t batch, auto* out) {
                                 cpu::exact_attn::exact_tree_attention(p, batch, AtenParallel(), out, exact_isa_cap());
                               });
}

TORCH_LIBRARY_IMPL(dartree, CPU, m) { m.impl("exact_tree_attention", &exact_tree_attention_cpu); }

}  // namespace dartree
