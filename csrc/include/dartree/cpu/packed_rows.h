// Weight rows of a packed GGUF matrix, dequantised on demand for exact_linear's tiles (op
// packed_linear, csrc/ops.cpp; the plain-PyTorch twin: dartree/reference.py::packed_linear).
//
// packed [N, row_bytes] uint8: row n is K / block_values blocks of `type` (dartree/gguf_blocks.h).
// exact_lin::run_rows asks for the rows of one block of kBlockN outputs at a time; PackedRows
// rebuilds them into the task's scratch [rows, K] in the activation dtype (float32 values from
// gguf::dequantize_block, then rounded to scalar_t as torch's .to(dtype) rounds: nearest even),
// so the tiles see exactly the weights exact_linear(x, dequantize(packed).to(x.dtype)) sees and
// every output has the same bits. Reads each packed row once per call (4.5-8.5 bits a weight
// instead of 16 or 32), writes and rereads the scratch in L2 (bfloat16: rounded in registers and
// written once, fill_rows_bf16). Calls of at most 16 rows skip the scratch: packed_simd.h's run_small
// dequantises inside the tile (AVX-512, or AVX2: packed_avx2.h; 9-16 rows in two groups). Without
// AVX-512 the scratch is rebuilt 8 values at a time with AVX2 (packed_avx2.h); the scalar loops below
// are the portable path.
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../gguf_blocks.h"
#include "packed_avx2.h"
#include "packed_simd.h"

namespace dartree {
namespace cpu {

template <typename scalar_t>
struct PackedRows {
  const uint8_t* packed;
  int64_t row_bytes;
  int type;
  int64_t K;
  bool simd;     // AVX-512 dequantisation (packed_simd.h): the same bits, 16 values at a time
  bool vdpbf16;  // ... and bfloat16 rounding by VCVTNE2PS2BF16 (AVX512-BF16): the same bits again
  bool avx2;     // without simd: AVX2 dequantisation (packed_avx2.h), 8 values at a time, same bits

  // Rows [n_begin, n_end) as a [n_end - n_begin, K] matrix (in `scratch`).
  const scalar_t* operator()(int64_t n_begin, int64_t n_end, std::vector<scalar_t>& scratch) const {
    const int64_t count = n_end - n_begin;
    scratch.resize(static_cast<size_t>(count * K));
    const uint8_t* rows = packed + n_begin * row_bytes;
    if constexpr (std::is_same_v<scalar_t, float>) {
      fill(rows, count, scratch.data());
      return scratch.data();
    }
#if DARTREE_X86 && defined(__GNUC__)
    if (simd && Bits16Of<scalar_t>::value == Bits16::kBFloat16) {  // rounded in registers, one pass
      uint16_t* dst = reinterpret_cast<uint16_t*>(scratch.data());
      packed::with_type(type, [&](auto t) {
        constexpr int T = decltype(t)::value;
        if (vdpbf16) packed::fill_rows_bf16_vdp<T>(rows, row_bytes, count, K, dst);
        else packed::fill_rows_bf16<T>(rows, row_bytes, count, K, dst);
      });
      return scratch.data();
    }
    if (avx2 && Bits16Of<scalar_t>::value == Bits16::kBFloat16) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(scratch.data());
      packed::with_type(type, [&](auto t) {
        packed_avx2::fill_rows_bf16<decltype(t)::value>(rows, row_bytes, count, K, dst);
      });
      return scratch.data();
    }
#endif
    thread_local std::vector<float> values;  // float32 values, then rounded row by row
    values.resize(static_cast<size_t>(K));
    for (int64_t r = 0; r < count; ++r) {
      fill(rows + r * row_bytes, 1, values.data());
      scalar_t* dst = scratch.data() + r * K;
      for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<scalar_t>(values[k]);
    }
    return scratch.data();
  }

  // `count` rows from `rows` as float32 [count, K].
  void fill(const uint8_t* rows, int64_t count, float* dst) const {
#if DARTREE_X86 && defined(__GNUC__)
    if (simd) {
      packed::with_type(type, [&](auto t) { packed::fill_rows<decltype(t)::value>(rows, row_bytes, count, K, dst); });
      return;
    }
    if (avx2) {
      packed::with_type(type, [&](auto t) {
        packed_avx2::fill_rows<decltype(t)::value>(rows, row_bytes, count, K, dst);
      });
      return;
    }
#endif
    const int values = gguf::block_values(type), bytes = gguf::block_bytes(type);
    for (int64_t r = 0; r < count; ++r)
      for (int64_t b = 0; b < K / values; ++b)
        gguf::dequantize_block(type, rows + r * row_bytes + b * bytes, dst + r * K + b * values);
  }
};

}  // namespace cpu
}  // namespace dartree
