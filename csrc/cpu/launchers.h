// CPU launchers that other launchers call directly, without the dispatcher: decoder_stack.cpp runs
// a whole decoder stack through them. Each is the CPU kernel of the op of the same name (schemas
// and contracts: csrc/ops.cpp), checks included.
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace dartree {

// The rank of the most capable instruction set DARTREE_EXACT_ISA allows the exact kernels
// (cpu::exact_lin::isa_rank; unset: all of them), read once per process.
int exact_isa_cap();

at::Tensor exact_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t K,
                             const std::optional<at::Tensor>& bias);
at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& tree_mask, int64_t prefix_len, std::optional<double> scale);
at::Tensor exact_tree_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& tree_mask, int64_t prefix_len, std::optional<double> scale);

}  // namespace dartree
