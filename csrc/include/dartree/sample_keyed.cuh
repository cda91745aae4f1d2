// Position-keyed sampling: Gumbel-max whose noise depends on (seed, position, token id) alone.
//
// logits [T, V] (float32 / float64 / float16 / bfloat16, read as float32), positions int64 [T]
// tokens[t] = argmax_v  fl(fl(logits[t, v] * inv_t) + gumbel(seed, positions[t], v))
//             inv_t = float32(1 / temperature), computed once on the host
//             temperature 0: argmax_v logits[t, v] (no noise)
//             order: a NaN beats every number, then larger, then the lower token id
// gumbel(seed, p, v) = -log(-log(u)),   u = (2k + 1) * 2^-24,   k = top 23 bits of
//             mix64(row + (v + 1) * kGolden),   row = mix64(mix64(seed ^ kSeedSalt) + p * kGolden)
// mix64 is SplitMix64's finaliser, so (row, v) -> k is SplitMix64 run as a counter-based
// generator: no state, no [T, V] noise tensor, any row or token computable alone. Row t's token
// depends on its logits row, seed, positions[t] and temperature only: a verify row equals the
// one-token step at that position whatever tree or batch surrounds it.
//
// Bitwise reproducible: the hash is integer arithmetic; the float part is IEEE add, sub, mul and
// div only, each rounded once in a fixed order (log_keyed is fdlibm's logf, written out), so the
// CPU kernel, this CUDA kernel and dartree.reference.sample_keyed (separate torch ops) agree bit
// for bit. Device code uses the __f*_rn intrinsics, which nvcc never fuses into FMAs; host code
// rounds each product through a volatile when the compiler could emit FMAs.
//
// u lies in [2^-24, 1 - 2^-24], so every noise value lies in [-2.8115, 16.6355], below kGumbelHi
// (a bound with margin). The CPU kernel uses it to skip tokens that cannot win; CUDA computes
// every token (one block per row, a strided loop + block reduction).
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DT_HD __host__ __device__ __forceinline__
#else
#define DT_HD inline
#endif

namespace dartree {
namespace keyed {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;
constexpr uint64_t kSeedSalt = 0x5851f42d4c957f2dull;
constexpr float kGumbelHi = 16.7f;

DT_HD uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The per-call part of the key, then the per-row part.
DT_HD uint64_t seed_key(uint64_t seed) { return mix64(seed ^ kSeedSalt); }
DT_HD uint64_t row_key(uint64_t seed_key, int64_t position) {
  return mix64(seed_key + static_cast<uint64_t>(position) * kGolden);
}

// IEEE single operations, each rounded once, never contracted.
#if defined(__CUDA_ARCH__)
DT_HD float rn_add(float a, float b) { return __fadd_rn(a, b); }
DT_HD float rn_sub(float a, float b) { return __fsub_rn(a, b); }
DT_HD float rn_mul(float a, float b) { return __fmul_rn(a, b); }
DT_HD float rn_div(float a, float b) { return __fdiv_rn(a, b); }
DT_HD uint32_t float_bits(float x) { return __float_as_uint(x); }
DT_HD float bits_float(uint32_t x) { return __uint_as_float(x); }
#else
DT_HD float rn_add(float a, float b) { return a + b; }
DT_HD float rn_sub(float a, float b) { return a - b; }
DT_HD float rn_div(float a, float b) { return a / b; }
#if defined(__FMA__) || defined(__FP_FAST_FMAF) || defined(__aarch64__) || defined(__ARM_FEATURE_FMA)
// The compiler may fuse a product into the next add: a volatile forces it to be rounded alone.
DT_HD float rn_mul(float a, float b) {
  volatile float p = a * b;
  return p;
}
#else
DT_HD float rn_mul(float a, float b) { return a * b; }
#endif
DT_HD uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
DT_HD float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
#endif

// Natural log of a positive normal float (fdlibm / musl logf: x = 2^k * m, m in [sqrt(2)/2,
// sqrt(2)), log(m) = 2 atanh(f / (2 + f)) by a degree-8 polynomial; error < 1 ulp).
DT_HD float log_keyed(float x) {
  const uint32_t ix = float_bits(x) + (0x3f800000u - 0x3f3504f3u);
  const int k = static_cast<int>(ix >> 23) - 0x7f;
  const float f = rn_sub(bits_float((ix & 0x007fffffu) + 0x3f3504f3u), 1.0f);
  const float s = rn_div(f, rn_add(2.0f, f));
  const float z = rn_mul(s, s);
  const float w = rn_mul(z, z);
  const float t1 = rn_mul(w, rn_add(0x1.999c26p-2f /* Lg2 */, rn_mul(w, 0x1.f13c4cp-3f /* Lg4 */)));
  const float t2 = rn_mul(z, rn_add(0x1.555554p-1f /* Lg1 */, rn_mul(w, 0x1.23d3dcp-2f /* Lg3 */)));
  const float r = rn_add(t2, t1);
  const float hfsq = rn_mul(rn_mul(0.5f, f), f);
  const float dk = static_cast<float>(k);
  float y = rn_mul(s, rn_add(hfsq, r));
  y = rn_add(y, rn_mul(dk, 0x1.2fefa2p-17f /* ln2_lo */));
  y = rn_sub(y, hfsq);
  y = rn_add(y, f);
  return rn_add(y, rn_mul(dk, 0x1.62e3p-1f /* ln2_hi */));
}

// The Gumbel noise of token v in the row keyed `row`.
DT_HD float gumbel(uint64_t row, int64_t v) {
  const uint64_t bits = mix64(row + (static_cast<uint64_t>(v) + 1u) * kGolden);
  const uint32_t k = static_cast<uint32_t>(bits >> 41);  // 23 bits: (2k + 1) is exact in a float
  const float u = rn_mul(static_cast<float>(2u * k + 1u), 0x1p-24f);
  return -log_keyed(-log_keyed(u));
}

// The selection order: a NaN first, then the larger score, then the lower index.
DT_HD bool beats(float a, int64_t i, float b, int64_t j) {
  const bool a_nan = a != a, b_nan = b != b;
  if (a_nan || b_nan) return a_nan && (!b_nan || i < j);
  return a > b || (a == b && i < j);
}

}  // namespace keyed

#if defined(__CUDACC__)
// One block of kThreads per row; thread i scores tokens i, i + kThreads, ...; then a shared-memory
// tree reduction under `beats` (a total order, so the result does not depend on the split).
// Reads T * V logits once; writes T tokens.
template <typename In, int kThreads>
__global__ void __launch_bounds__(kThreads) sample_keyed_kernel(const In* __restrict__ logits,
                                    const int64_t* __restrict__ positions, int64_t vocab,
                                    uint64_t seed_key, float inv_t, bool greedy,
                                    int64_t* __restrict__ tokens) {
  __shared__ float best_score[kThreads];
  __shared__ int64_t best_index[kThreads];
  const int64_t t = blockIdx.x;
  const In* row_logits = logits + t * vocab;
  const uint64_t row = keyed::row_key(seed_key, positions[t]);
  float score = 0.0f;
  int64_t index = -1;
  for (int64_t v = threadIdx.x; v < vocab; v += kThreads) {
    const float a = static_cast<float>(row_logits[v]);
    const float s = greedy ? a : keyed::rn_add(keyed::rn_mul(a, inv_t), keyed::gumbel(row, v));
    if (index < 0 || keyed::beats(s, v, score, index)) {
      score = s;
      index = v;
    }
  }
  best_score[threadIdx.x] = score;
  best_index[threadIdx.x] = index;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const int other = threadIdx.x + stride;
      const int64_t j = best_index[other];
      if (j >= 0 && (best_index[threadIdx.x] < 0 ||
                     keyed::beats(best_score[other], j, best_score[threadIdx.x],
                                  best_index[threadIdx.x]))) {
        best_score[threadIdx.x] = best_score[other];
        best_index[threadIdx.x] = j;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) tokens[t] = best_index[0];
}
#endif

}  // namespace dartree
