// Argument checks of packed_linear, shared by the CPU and CUDA launchers.
#pragma once
#include <ATen/ATen.h>

#include <optional>

#include "dartree/gguf_blocks.h"

namespace dartree {

// x [M, K] float32 / float16 / bfloat16; packed [N, (K / block values) * block bytes] uint8 rows
// of GGUF blocks of type `qtype` (a GGML type number), K a multiple of the block's values;
// bias [N] in x's dtype or None; one device.
inline void check_packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t K,
                                const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(gguf::supported(static_cast<int>(qtype)), "packed_linear: GGUF block type ", qtype,
                    " is not supported (Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)");
  const int values = gguf::block_values(static_cast<int>(qtype));
  TORCH_CHECK_VALUE(K > 0 && K % values == 0, "packed_linear: K must be a positive multiple of ", values,
                    " for block type ", qtype, ", got ", K);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == K, "packed_linear: x must be [M, ", K, "], got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                    "packed_linear: x must be float32, float16 or bfloat16, got ", dtype);
  const int64_t row_bytes = K / values * gguf::block_bytes(static_cast<int>(qtype));
  TORCH_CHECK_VALUE(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.size(1) == row_bytes,
                    "packed_linear: packed must be uint8 [N, ", row_bytes, "] (block type ", qtype, ", K = ", K,
                    "), got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK_VALUE(packed.device() == x.device(), "packed_linear: packed is on ", packed.device(),
                    " but x is on ", x.device());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == packed.size(0), "packed_linear: bias must be [",
                      packed.size(0), "], got ", bias->sizes());
    TORCH_CHECK_VALUE(bias->scalar_type() == dtype, "packed_linear: bias must have x's dtype ", dtype, ", got ",
                      bias->scalar_type());
    TORCH_CHECK_VALUE(bias->device() == x.device(), "packed_linear: bias is on ", bias->device(),
                      " but x is on ", x.device());
  }
}

}  // namespace dartree
