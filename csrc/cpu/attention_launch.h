// What the two CPU tree-attention launchers (tree_attention.cpp, exact_tree_attention.cpp) do
// alike: the checks, the output, the layouts the kernels read, the scale and the dtype dispatch;
// the kernel gets the problem of dartree/cpu/attention_rows.h.
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <optional>

#include "../checks.h"
#include "dartree/cpu/attention_rows.h"
#include "torch_types.h"

namespace dartree {

// kernel(problem, batch, out) for the dtype of q (one of four: check_tree_attention): out
// [B, Hq, T, D] contiguous, returned.
template <typename Kernel>
at::Tensor launch_tree_attention(const at::Tensor& q, const at::Tensor& k_in,
                                 const at::Tensor& v_in, const at::Tensor& tree_mask,
                                 int64_t prefix_len, std::optional<double> scale,
                                 const Kernel& kernel) {
  check_tree_attention(q, k_in, v_in, tree_mask, prefix_len);
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  // Rows of K and V are read as contiguous vectors; anything else is copied once (rare).
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  const at::Tensor mask = tree_mask.contiguous();
  const int64_t dim = q.size(3);
  const double softmax_scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(dim));

  const auto run = [&](auto dtype_tag) {
    using scalar_t = decltype(dtype_tag);
    cpu::AttentionProblem<scalar_t> p;
    p.q = q.const_data_ptr<scalar_t>();
    p.k = k.const_data_ptr<scalar_t>();
    p.v = v.const_data_ptr<scalar_t>();
    p.mask = mask.const_data_ptr<bool>();
    for (int i = 0; i < 4; ++i) p.q_stride[i] = q.stride(i);
    for (int i = 0; i < 3; ++i) {
      p.k_stride[i] = k.stride(i);
      p.v_stride[i] = v.stride(i);
    }
    p.kv_heads = k.size(1);
    p.group = q.size(1) / k.size(1);
    p.size = q.size(2);
    p.dim = dim;
    p.prefix = prefix_len;
    p.keys = prefix_len + p.size;
    p.rows = p.group * p.size;
    p.scale = softmax_scale;
    kernel(p, q.size(0), out.data_ptr<scalar_t>());
  };
  switch (q.scalar_type()) {
    case at::kDouble: run(double{}); break;
    case at::kHalf: run(at::Half{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    default: run(float{}); break;
  }
  return out;
}

}  // namespace dartree
