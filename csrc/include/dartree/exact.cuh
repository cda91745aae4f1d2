// Batch-invariant ("exact") kernels: every output row is a function of that row's inputs alone.
// Twins of csrc/cpu/exact_linear.cpp and csrc/cpu/exact_tree_attention.cpp; contracts in
// csrc/ops.cpp. Element types: float, __half, __nv_bfloat16 (storage), float32 arithmetic.
//
// exact_linear_kernel: out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]), w read through a loader:
//   DenseW reads w in place; PackedW rebuilds w[n, k] from GGUF blocks (dartree/gguf_blocks.h) and
//   rounds it to E first, so packed_linear's outputs are exact_linear's on the dequantised weights
//   in E, bit for bit (the CPU twin: cpu/packed_rows.h).
//   Block 16 x 16 threads = a 16 x 16 output tile; x and w tiles of 32 k staged in shared memory.
//   Each thread owns one output and adds its K products with fmaf in increasing k: the order is
//   fixed by K alone (no split of K, no M-dependent kernel choice), so row m's bits do not depend
//   on M or on its neighbours. Reads x and w once per tile (16x reuse each): simple, not fast.
//
// exact_tree_attention_kernel: one block of kAttnThreads per query row (b, query head, i).
//   The row's logical key list is the prefix 0..P-1, then its visible tree keys in index order;
//   score_j = fmaf chain over d; max (exact); p_j = expf(score_j - max) into `scores`; the sum is
//   per-thread partial sums over j = t (mod kAttnThreads) then a fixed tree; o_d = fmaf chain over
//   the logical j. Nothing depends on T, on P as a split point or on the other rows.
//   scores: float workspace [B * Hq * T, P + T].
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "gguf_blocks.h"

namespace dartree {
namespace exact {

template <typename E> __device__ __forceinline__ float to_float(E x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename E> __device__ __forceinline__ E from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

constexpr int kTile = 16, kTileK = 32;

// w[n, k] of a dense [N, K] weight.
template <typename E>
struct DenseW {
  const E* __restrict__ w;
  int64_t K;
  __device__ __forceinline__ float operator()(int64_t n, int64_t k) const { return to_float(w[n * K + k]); }
};

// w[n, k] of a weight kept as GGUF blocks: packed [N, row_bytes], rounded to E as .to(E) rounds.
template <typename E>
struct PackedW {
  const uint8_t* __restrict__ packed;
  int64_t row_bytes;
  int type;
  __device__ __forceinline__ float operator()(int64_t n, int64_t k) const {
    return to_float(from_float<E>(gguf::dequantize_value(type, packed + n * row_bytes, k)));
  }
};

template <typename E, typename W>
__global__ void __launch_bounds__(kTile * kTile) exact_linear_kernel(const E* __restrict__ x, W w,
                                    const E* __restrict__ bias, E* __restrict__ out, int64_t M,
                                    int64_t N, int64_t K) {
  __shared__ float xs[kTile][kTileK + 1];
  __shared__ float ws[kTile][kTileK + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t m = blockIdx.y * static_cast<int64_t>(kTile) + ty;
  const int64_t n = blockIdx.x * static_cast<int64_t>(kTile) + tx;
  const int64_t m_row = blockIdx.y * static_cast<int64_t>(kTile), n_row = blockIdx.x * static_cast<int64_t>(kTile);
  float acc = 0.0f;
  for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
    // 256 threads stage 16 x 32 elements of each operand: two per thread.
    for (int e = ty * kTile + tx; e < kTile * kTileK; e += kTile * kTile) {
      const int r = e / kTileK, c = e % kTileK;
      const int64_t k = k0 + c;
      xs[r][c] = (m_row + r < M && k < K) ? to_float(x[(m_row + r) * K + k]) : 0.0f;
      ws[r][c] = (n_row + r < N && k < K) ? w(n_row + r, k) : 0.0f;
    }
    __syncthreads();
    const int steps = static_cast<int>(K - k0 < kTileK ? K - k0 : kTileK);
    for (int c = 0; c < steps; ++c) acc = fmaf(xs[ty][c], ws[tx][c], acc);
    __syncthreads();
  }
  if (m < M && n < N) {
    if (bias != nullptr) acc += to_float(bias[n]);
    out[m * N + n] = from_float<E>(acc);
  }
}

constexpr int kAttnThreads = 128;

// q [B, Hq, T, D] (strides q_stride), k/v [B, Hkv, S, D] (strides, unit d stride), mask [B, T, T],
// out [B, Hq, T, D] contiguous. Dynamic shared memory: D floats (q) + T ints (the row's tree keys).
template <typename E>
__global__ void __launch_bounds__(kAttnThreads) exact_tree_attention_kernel(const E* __restrict__ q, const E* __restrict__ k,
                                            const E* __restrict__ v, const bool* __restrict__ mask,
                                            E* __restrict__ out, float* __restrict__ scores,
                                            int64_t qs0, int64_t qs1, int64_t qs2, int64_t qs3,
                                            int64_t ks0, int64_t ks1, int64_t ks2,
                                            int64_t vs0, int64_t vs1, int64_t vs2,
                                            int heads, int group, int size, int dim, int64_t prefix,
                                            float scale) {
  extern __shared__ float smem[];
  float* qrow = smem;
  int* tree_keys = reinterpret_cast<int*>(smem + dim);
  __shared__ float reduce[kAttnThreads];
  __shared__ int count;
  const int t = threadIdx.x;
  const int64_t row = blockIdx.x;  // (b * Hq + hq) * T + i
  const int i = static_cast<int>(row % size);
  const int hq = static_cast<int>((row / size) % heads);
  const int64_t b = row / (static_cast<int64_t>(size) * heads);
  const int hk = hq / group;
  for (int d = t; d < dim; d += kAttnThreads)
    qrow[d] = static_cast<float>(static_cast<double>(to_float(q[b * qs0 + hq * qs1 + i * qs2 + d * qs3])) * scale);
  if (t == 0) {
    int c = 0;
    const bool* allowed = mask + (b * size + i) * static_cast<int64_t>(size);
    for (int j = 0; j < size; ++j)
      if (allowed[j]) tree_keys[c++] = j;
    count = c;
  }
  __syncthreads();
  const int64_t length = prefix + count;
  const E* kh = k + b * ks0 + hk * ks1;
  const E* vh = v + b * vs0 + hk * vs1;
  float* s = scores + row * (prefix + size);
  float best = -INFINITY;
  for (int64_t j = t; j < length; j += kAttnThreads) {
    const int64_t key = j < prefix ? j : prefix + tree_keys[j - prefix];
    const E* kr = kh + key * ks2;
    float acc = 0.0f;
    for (int d = 0; d < dim; ++d) acc = fmaf(qrow[d], to_float(kr[d]), acc);
    s[j] = acc;
    best = fmaxf(best, acc);
  }
  reduce[t] = best;
  __syncthreads();
  for (int half = kAttnThreads / 2; half > 0; half /= 2) {
    if (t < half) reduce[t] = fmaxf(reduce[t], reduce[t + half]);
    __syncthreads();
  }
  best = reduce[0];
  __syncthreads();
  float part = 0.0f;
  for (int64_t j = t; j < length; j += kAttnThreads) {
    const float p = length > 0 ? expf(s[j] - best) : 0.0f;
    s[j] = p;
    part += p;
  }
  reduce[t] = part;
  __syncthreads();
  for (int half = kAttnThreads / 2; half > 0; half /= 2) {
    if (t < half) reduce[t] = reduce[t] + reduce[t + half];
    __syncthreads();
  }
  const float total = reduce[0];
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int d = t; d < dim; d += kAttnThreads) {
    float o = 0.0f;
    for (int64_t j = 0; j < length; ++j) {
      const int64_t key = j < prefix ? j : prefix + tree_keys[j - prefix];
      o = fmaf(s[j], to_float(vh[key * vs2 + d]), o);
    }
    out[row * dim + d] = from_float<E>(o * inv);
  }
}

}  // namespace exact
}  // namespace dartree
