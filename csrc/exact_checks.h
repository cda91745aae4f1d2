// Argument checks of the batch-invariant ("exact") ops, shared by the CPU and CUDA launchers.
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace dartree {

// x [M, K], weight [N, K], bias [N] or None, one float dtype (float32, float64, float16, bfloat16),
// one device. Strides are free: launchers copy what their kernel cannot read in place.
inline void check_exact_linear(const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() == 2, "exact_linear: x must be [M, K], got ", x.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2, "exact_linear: weight must be [N, K], got ", weight.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
                        dtype == at::kBFloat16,
                    "exact_linear: x must be float32, float64, float16 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(weight.scalar_type() == dtype, "exact_linear: weight must have x's dtype ", dtype,
                    ", got ", weight.scalar_type());
  TORCH_CHECK_VALUE(weight.device() == x.device(), "exact_linear: weight is on ", weight.device(),
                    " but x is on ", x.device());
  TORCH_CHECK_VALUE(weight.size(1) == x.size(1), "exact_linear: x has K = ", x.size(1),
                    " but weight is ", weight.sizes(), " ([N, K])");
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), "exact_linear: bias must be [",
                      weight.size(0), "], got ", bias->sizes());
    TORCH_CHECK_VALUE(bias->scalar_type() == dtype, "exact_linear: bias must have x's dtype ", dtype,
                      ", got ", bias->scalar_type());
    TORCH_CHECK_VALUE(bias->device() == x.device(), "exact_linear: bias is on ", bias->device(),
                      " but x is on ", x.device());
  }
}

}  // namespace dartree
