// Weight rows of a packed GGUF matrix, dequantised on demand for exact_linear's tiles (op
// packed_linear, csrc/ops.cpp; the plain-PyTorch twin: dartree/reference.py::packed_linear).
//
// packed [N, row_bytes] uint8: row n is K / block_values blocks of `type` (dartree/gguf_blocks.h).
// exact_lin::run_rows asks for the rows of one block of kBlockN outputs at a time; PackedRows
// rebuilds them into the task's scratch [rows, K] in the activation dtype (float32 values from
// gguf::dequantize_block, then rounded to scalar_t as torch's .to(dtype) rounds: nearest even),
// so the tiles see exactly the weights exact_linear(x, dequantize(packed).to(x.dtype)) sees and
// every output has the same bits. Reads each packed row once per call (4.5-8.5 bits a weight
// instead of 16 or 32), writes and rereads the scratch in L2.
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../gguf_blocks.h"

namespace dartree {
namespace cpu {

template <typename scalar_t>
struct PackedRows {
  const uint8_t* packed;
  int64_t row_bytes;
  int type;
  int64_t K;

  // Rows [n_begin, n_end) as a [n_end - n_begin, K] matrix (in `scratch`).
  const scalar_t* operator()(int64_t n_begin, int64_t n_end, std::vector<scalar_t>& scratch) const {
    const int values = gguf::block_values(type), bytes = gguf::block_bytes(type);
    const int64_t blocks = K / values;
    scratch.resize(static_cast<size_t>((n_end - n_begin) * K));
    float buf[256];
    for (int64_t n = n_begin; n < n_end; ++n) {
      const uint8_t* row = packed + n * row_bytes;
      scalar_t* dst = scratch.data() + (n - n_begin) * K;
      for (int64_t b = 0; b < blocks; ++b) {
        if constexpr (std::is_same_v<scalar_t, float>) {
          gguf::dequantize_block(type, row + b * bytes, dst + b * values);
        } else {
          gguf::dequantize_block(type, row + b * bytes, buf);
          for (int i = 0; i < values; ++i) dst[b * values + i] = static_cast<scalar_t>(buf[i]);
        }
      }
    }
    return scratch.data();
  }
};

}  // namespace cpu
}  // namespace dartree
