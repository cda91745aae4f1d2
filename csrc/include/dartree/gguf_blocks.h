// GGUF quantisation blocks -> float32 weights, with the arithmetic of gguf-py's dequantize
// (what transformers' GGUF loader runs), bit for bit. Torch-free; host and device.
//
// A packed row of K values is K / kBlockValues blocks of kBlockBytes bytes (layouts in
// dartree/gguf_blocks.py, the plain-PyTorch twin). Every value is rebuilt as numpy does it:
// float16 scales widened exactly, then separate multiplies and adds, each rounded to float32.
// A fused multiply-add would round once and differ in the last bit, so nothing here may be
// contracted: device code uses __fmul_rn / __fadd_rn, host code lives in functions compiled with
// contraction off and never inlined (DT_NO_CONTRACT).
//
//   dequantize_block(type, block, out): the block's kBlockValues floats (CPU kernels fill a
//     scratch of weight rows with it, then run exact_linear's own tiles over the scratch);
//   dequantize_value(type, row, k): value k of a packed row (the CUDA kernel stages its tiles
//     with it). Both give the same bits.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DT_GGUF_HD __host__ __device__ __forceinline__
#else
#define DT_GGUF_HD inline
#endif

namespace dartree {
namespace gguf {

// GGML type numbers, as stored in the file.
enum Type : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

DT_GGUF_HD constexpr bool supported(int type) {
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 ||
         type == Q4_K || type == Q5_K || type == Q6_K;
}
DT_GGUF_HD constexpr int block_values(int type) { return type >= Q4_K ? 256 : 32; }
DT_GGUF_HD constexpr int block_bytes(int type) {
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

// IEEE half -> float, exactly (subnormals, infinities and NaNs included).
DT_GGUF_HD float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((man & 0x400u) == 0) { man <<= 1; --exp; }
    bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

DT_GGUF_HD uint16_t load_u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
DT_GGUF_HD float load_half(const uint8_t* p) { return half_to_float(load_u16(p)); }

#if defined(__CUDA_ARCH__)
#define DT_MUL(a, b) __fmul_rn(a, b)
#define DT_ADD(a, b) __fadd_rn(a, b)
#define DT_SUB(a, b) __fsub_rn(a, b)
#define DT_NO_CONTRACT
#else
#define DT_MUL(a, b) ((a) * (b))
#define DT_ADD(a, b) ((a) + (b))
#define DT_SUB(a, b) ((a) - (b))
// Host: the functions that compute values are compiled with contraction off and never inlined
// (an inlined copy would take its caller's flags, and a caller built for FMA could fuse).
#if defined(__clang__)
#define DT_NO_CONTRACT __attribute__((noinline))
#define DT_NO_CONTRACT_BODY _Pragma("clang fp contract(off)")
#else
#define DT_NO_CONTRACT __attribute__((noinline, optimize("fp-contract=off")))
#endif
#endif
#ifndef DT_NO_CONTRACT_BODY
#define DT_NO_CONTRACT_BODY
#endif

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 scale bytes.
DT_GGUF_HD void k_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Value i (0 <= i < block_values(type)) of one block.
#if defined(__CUDACC__)
__host__ __device__
#endif
DT_NO_CONTRACT inline float block_value(int type, const uint8_t* b, int i) {
  DT_NO_CONTRACT_BODY
  switch (type) {
    case Q4_0: {
      const int q = (i < 16 ? b[2 + i] & 0x0F : b[2 + i - 16] >> 4) - 8;
      return DT_MUL(load_half(b), float(q));
    }
    case Q4_1: {
      const int q = i < 16 ? b[4 + i] & 0x0F : b[4 + i - 16] >> 4;
      return DT_ADD(DT_MUL(load_half(b), float(q)), load_half(b + 2));
    }
    case Q5_0: {
      const uint32_t qh = uint32_t(b[2]) | uint32_t(b[3]) << 8 | uint32_t(b[4]) << 16 | uint32_t(b[5]) << 24;
      const int lo = i < 16 ? b[6 + i] & 0x0F : b[6 + i - 16] >> 4;
      return DT_MUL(load_half(b), float((lo | int((qh >> i) & 1u) << 4) - 16));
    }
    case Q5_1: {
      const uint32_t qh = uint32_t(b[4]) | uint32_t(b[5]) << 8 | uint32_t(b[6]) << 16 | uint32_t(b[7]) << 24;
      const int lo = i < 16 ? b[8 + i] & 0x0F : b[8 + i - 16] >> 4;
      return DT_ADD(DT_MUL(load_half(b), float(lo | int((qh >> i) & 1u) << 4)), load_half(b + 2));
    }
    case Q8_0:
      return DT_MUL(static_cast<float>(static_cast<int8_t>(b[2 + i])), load_half(b));
    case Q4_K:
    case Q5_K: {
      const int j = i / 32, r = i % 32;  // sub-block, place in it
      int sc, mn;
      k_scale_min(b + 4, j, &sc, &mn);
      const uint8_t* qs = b + (type == Q4_K ? 16 : 48);
      int q = (j % 2 == 0) ? qs[(j / 2) * 32 + r] & 0x0F : qs[(j / 2) * 32 + r] >> 4;
      if (type == Q5_K) q |= ((b[16 + r] >> j) & 1) << 4;
      const float scale = DT_MUL(load_half(b), float(sc)), offset = DT_MUL(load_half(b + 2), float(mn));
      return DT_SUB(DT_MUL(scale, float(q)), offset);
    }
    case Q6_K: {
      // ql: 2 halves of 64 bytes, each: low nibbles = values 0..63 of the half, high = 64..127;
      // qh: 2 halves of 32 bytes, 2-bit fields at shifts 0, 2, 4, 6 = groups of 32 values
      const int half = i / 128, r = i % 128, group = r / 32, c = r % 32;
      const uint8_t l = b[half * 64 + (group % 2) * 32 + c];
      const int lo = group < 2 ? l & 0x0F : l >> 4;
      const int hi = (b[128 + half * 32 + c] >> (2 * group)) & 3;
      const int q = (lo | hi << 4) - 32;
      const float d = DT_MUL(load_half(b + 208), static_cast<float>(static_cast<int8_t>(b[192 + i / 16])));
      return DT_MUL(d, float(q));
    }
    default:
      return 0.0f;
  }
}

DT_GGUF_HD float dequantize_value(int type, const uint8_t* row, int64_t k) {
  const int64_t block = k / block_values(type);
  return block_value(type, row + block * block_bytes(type), int(k - block * block_values(type)));
}

// The block's kBlockValues floats, the same bits as block_value; a loop per type that the
// compiler vectorises (host only).
DT_NO_CONTRACT inline void dequantize_block(int type, const uint8_t* b, float* out) {
  DT_NO_CONTRACT_BODY
  switch (type) {
    case Q4_0: {
      const float d = load_half(b);
      for (int i = 0; i < 16; ++i) {
        out[i] = d * float((b[2 + i] & 0x0F) - 8);
        out[i + 16] = d * float((b[2 + i] >> 4) - 8);
      }
      return;
    }
    case Q4_1: {
      const float d = load_half(b), m = load_half(b + 2);
      for (int i = 0; i < 16; ++i) {
        out[i] = d * float(b[4 + i] & 0x0F) + m;
        out[i + 16] = d * float(b[4 + i] >> 4) + m;
      }
      return;
    }
    case Q8_0: {
      const float d = load_half(b);
      for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
      return;
    }
    case Q4_K: {
      const float d = load_half(b), dmin = load_half(b + 2);
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        const float scale = d * float(sc), offset = dmin * float(mn);
        const uint8_t* qs = b + 16 + (j / 2) * 32;
        const int shift = (j % 2) * 4;
        for (int r = 0; r < 32; ++r) out[j * 32 + r] = scale * float((qs[r] >> shift) & 0x0F) - offset;
      }
      return;
    }
    case Q6_K: {
      const float d = load_half(b + 208);
      for (int g = 0; g < 16; ++g) {
        const float scale = d * static_cast<float>(static_cast<int8_t>(b[192 + g]));
        for (int r = 0; r < 16; ++r) {
          const int i = g * 16 + r, half = i / 128, rr = i % 128, group = rr / 32, c = rr % 32;
          const uint8_t l = b[half * 64 + (group % 2) * 32 + c];
          const int lo = group < 2 ? l & 0x0F : l >> 4;
          const int hi = (b[128 + half * 32 + c] >> (2 * group)) & 3;
          out[i] = scale * float((lo | hi << 4) - 32);
        }
      }
      return;
    }
    default:  // Q5_0, Q5_1, Q5_K: value by value
      for (int i = 0, n = block_values(type); i < n; ++i) out[i] = block_value(type, b, i);
  }
}

}  // namespace gguf
}  // namespace dartree
