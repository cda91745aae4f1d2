// Argument checks of sample_keyed, shared by the CPU and CUDA launchers.
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace dartree {

// logits [T, V] float32/float64/float16/bfloat16 with V >= 1; positions int64 [T] and tokens
// int64 [T] contiguous on logits' device; temperature 0 or finite > 0 with 1 / temperature a
// normal float32. Returns inv_t = float32(1 / temperature) (0 for temperature 0: argmax).
inline float check_sample_keyed(const at::Tensor& logits, const at::Tensor& positions,
                                double temperature, const at::Tensor& tokens) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "sample_keyed: logits must be [T, V], got ", logits.sizes());
  const auto dtype = logits.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
                        dtype == at::kBFloat16,
                    "sample_keyed: logits must be float32, float64, float16 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(logits.size(1) >= 1, "sample_keyed: logits must have at least one token (V >= 1)");
  const int64_t rows = logits.size(0);
  for (const auto* t : {&positions, &tokens}) {
    const char* name = t == &positions ? "positions" : "tokens";
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == rows, "sample_keyed: ", name, " must be [",
                      rows, "] (one per logits row), got ", t->sizes());
    TORCH_CHECK_VALUE(t->scalar_type() == at::kLong, "sample_keyed: ", name, " must be int64, got ",
                      t->scalar_type());
    TORCH_CHECK_VALUE(t->device() == logits.device(), "sample_keyed: ", name, " is on ", t->device(),
                      " but logits is on ", logits.device());
    TORCH_CHECK_VALUE(t->is_contiguous(), "sample_keyed: ", name, " must be contiguous");
  }
  TORCH_CHECK_VALUE(logits.is_contiguous(), "sample_keyed: logits must be contiguous");
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature >= 0,
                    "sample_keyed: temperature must be a finite number >= 0, got ", temperature);
  if (temperature == 0) return 0.0f;
  const float inv_t = static_cast<float>(1.0 / temperature);
  TORCH_CHECK_VALUE(std::isfinite(inv_t) && inv_t >= std::numeric_limits<float>::min(),
                    "sample_keyed: temperature ", temperature,
                    " is out of range: 1 / temperature must be a normal float32");
  return inv_t;
}

}  // namespace dartree
