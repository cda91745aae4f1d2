// Tree attention: T draft-tree queries over a static KV cache (prefix + the tree's own keys), GQA,
// split over the keys (flash-decoding) so that one long context still fills the GPU.
//
//   q    [B, Hq, T, D]   rows of D contiguous (16-bit: 4-byte aligned)      (any other strides)
//   k, v [B, Hkv, S, D]  rows of D contiguous and 16-byte aligned; rows >= P + T are never read
//   mask [B, T, T] bool  contiguous; True where tree key j is query i itself or an ancestor
//   out  [B, Hq, T, D]   in q's dtype
//   out[b, h, i] = softmax_j(scale * q[b, h, i] . k[b, h / g, j]) v[b, h / g, j] over the visible
//   keys j: [0, P) and P + j' for mask[b, i, j']. g = Hq / Hkv. A row with no visible key gets 0.
//
// Work split. The g query heads of one KV head share its keys, so their g*T query rows form one
// row block of M = g*T rows (row r = query r % T of head h*g + r / T). Split kernel grid:
// (ceil(M / 64) row tiles, splits, B * Hkv); 128 threads = 4 warps of 16 rows each. A block walks
// its split's key tiles (64 keys for 16-bit inputs, 32 for fp32) through double-buffered shared
// memory (cp.async, zero-filled past P + T), so each K/V element it loads serves all 64 rows.
// Per warp and tile: S = Q K^T (mma.sync m16n8k16, fp32 accumulators; SIMT FMAs for fp32 inputs),
// scale and mask (the mask is read only in tiles that reach the tree keys [P, P + T)), online
// softmax in registers (base-2 exponent, running max m and sum l per row), O += P V with P
// re-packed from the S accumulators into the A operand. With one split the block writes out
// directly; otherwise it writes its unnormalised rows, m and l (fp32) and the combine kernel
// (one warp per row) merges the splits: out = sum_s 2^(m_s - m*) o_s / sum_s 2^(m_s - m*) l_s.
//
// Bytes. HBM reads: every K and V element of rows [0, P + T) once, 2 * B * Hkv * (P + T) * D * es
// (es = element size; this is the bench's bandwidth figure); the ceil(M / 64) row tiles of one
// split read the same tiles back to back, from L2. Plus q (B*Hq*T*D*es) and the mask rows of tree
// tiles. Writes: out, B*Hq*T*D*es; with splits > 1 also B*Hkv*splits*M*(D + 2)*4 bytes of partial
// rows, read once by the combine kernel. FLOPs: 4 * B * Hq * T * (P + T) * D.
//
// Assumes: D in {64, 128}; sm_80 or newer (mma.sync.m16n8k16, cp.async); B * Hkv <= 65535 and
// S < 2^31 (grid and int indexing). T is unbounded: rows are tiled, the mask is read from global.
//
// Built with DARTREE_CUDA_EMULATION defined, the same code compiles as plain C++ against a host
// emulator of the few CUDA features used here (tests/cuda_emu/cuda_emulation.h): the tests run
// these kernels on a CPU, warp-synchronous fragments and all.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#ifdef DARTREE_CUDA_EMULATION
#include "cuda_emulation.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace dartree {
namespace tree_attn {

// Element tags: the kernels move 16-bit inputs as raw bits and only convert P and the output.
struct Half { using Storage = uint16_t; };
struct BFloat16 { using Storage = uint16_t; };
struct Float32 { using Storage = float; };

// ------------------------------------------------------------------------------------------------
// Device primitives (each has a host stand-in under emulation).

template <typename E>
__device__ __forceinline__ typename E::Storage from_float(float x);

template <>
__device__ __forceinline__ uint16_t from_float<Half>(float x) {
#ifdef DARTREE_CUDA_EMULATION
  return emu::float_to_half(x);
#else
  return __half_as_ushort(__float2half_rn(x));
#endif
}

template <>
__device__ __forceinline__ uint16_t from_float<BFloat16>(float x) {
#ifdef DARTREE_CUDA_EMULATION
  return emu::float_to_bfloat16(x);
#else
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
#endif
}

template <>
__device__ __forceinline__ float from_float<Float32>(float x) {
  return x;
}

// Two floats rounded to E and packed low-first: one f16x2 / bf16x2 MMA operand register.
template <typename E>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return static_cast<uint32_t>(from_float<E>(lo)) | (static_cast<uint32_t>(from_float<E>(hi)) << 16);
}

// c += A B for one m16n8k16 tile, fp32 accumulate. a: 4 registers of the row-major A fragment;
// b0, b1: the two registers of the col-major B fragment (PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type").
template <typename E>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef DARTREE_CUDA_EMULATION
  emu::mma_m16n8k16(std::is_same<E, BFloat16>::value, c, a, b0, b1);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same<E, BFloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // the launcher refuses devices below sm_80
#endif
}

// Four 8x8 b16 matrices from shared memory, one per register: lanes 8j..8j+7 give the row addresses
// of matrix j (16-byte aligned). Lane l receives row l / 4, elements 2(l % 4), 2(l % 4) + 1 of each
// matrix; with Trans, column l / 4, rows 2(l % 4), 2(l % 4) + 1 (PTX ISA, "ldmatrix").
template <bool Trans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#ifdef DARTREE_CUDA_EMULATION
  emu::ldmatrix_x4(r, row, Trans);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// 16-byte global -> shared copy, asynchronous; zero-fills the destination when !valid (src is then
// not read).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
#ifdef DARTREE_CUDA_EMULATION
  emu::cp_async_16(smem, gmem, valid);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem),
               "r"(valid ? 16 : 0));
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if !defined(DARTREE_CUDA_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most `Pending` committed groups are still in flight.
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
#if !defined(DARTREE_CUDA_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
#endif
}

__device__ __forceinline__ float shfl_xor(float x, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, x, lane_mask);
}

#ifdef DARTREE_CUDA_EMULATION
#define DARTREE_DYNAMIC_SMEM(name) unsigned char* name = emu::dynamic_smem()
#else
#define DARTREE_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// ------------------------------------------------------------------------------------------------
// Parameters, tile configuration, launch plan (host and device).

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const uint8_t* mask;  // [B, T, T] contiguous
  void* out;
  float* part_o;   // [B * Hkv, splits, M, D]   (splits > 1 only)
  float* part_ml;  // [B * Hkv, splits, M, 2]   running max (base 2) and sum per row
  int64_t q_sb, q_sh, q_st;  // element strides of q over b, h, t (d stride 1)
  int64_t k_sb, k_sh, k_ss;
  int64_t v_sb, v_sh, v_ss;
  int64_t o_sb, o_sh, o_st;
  int kv_heads, group, tree, rows, prefix, keys;
  int splits, tiles_per_split;
  float scale_log2;  // softmax scale * log2(e)
};

template <typename E, int D>
struct Config {
  static_assert(D == 64 || D == 128, "head dim must be 64 or 128");
  using Storage = typename E::Storage;
  static constexpr bool kMma = !std::is_same<E, Float32>::value;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockRows = 16 * kWarps;
  static constexpr int kTileKeys = kMma ? 64 : 32;
  static constexpr int kElemBytes = static_cast<int>(sizeof(Storage));
  static constexpr int kVec = 16 / kElemBytes;          // elements per 16-byte chunk
  static constexpr int kRowStride = D + kVec;           // one chunk of padding: no bank conflicts
  static constexpr int kTileElems = kTileKeys * kRowStride;
  static constexpr int kChunksPerRow = D / kVec;
  static constexpr int kKeyFrags = kTileKeys / 8;       // n8 tiles of S per warp
  static constexpr int kDimFrags = D / 8;               // n8 tiles of O per warp
  // fp32 path only: each warp's 16 Q rows and its P tile live in shared memory.
  static constexpr int kQStride = D + 4;
  static constexpr int kPStride = kTileKeys + 4;
  static constexpr size_t kKvBytes = size_t(2) * 2 * kTileElems * kElemBytes;  // 2 stages x K, V
  static constexpr size_t kSmemBytes =
      kKvBytes + (kMma ? 0 : size_t(kWarps) * 16 * (kQStride + kPStride) * sizeof(float));
};

struct Plan {
  dim3 split_grid, combine_grid;
  int threads;
  size_t smem_bytes;
  int splits, tiles_per_split;
};

// Fills p.splits / p.tiles_per_split (and nothing else) and returns the grids. `slots` is how many
// split-kernel blocks the GPU runs at once (SMs x blocks per SM): the keys are split into as many
// parts as fit in one wave (a second, partial wave would double the time), at most one per tile.
template <typename E, int D>
inline Plan make_plan(Params& p, int batch, int slots) {
  using C = Config<E, D>;
  const int row_tiles = (p.rows + C::kBlockRows - 1) / C::kBlockRows;
  const int heads = batch * p.kv_heads;
  const int tiles = (p.keys + C::kTileKeys - 1) / C::kTileKeys;
  const int blocks = row_tiles * heads;
  int splits = slots / blocks;
  splits = splits < 1 ? 1 : (splits > tiles ? tiles : splits);
  const int per_split = (tiles + splits - 1) / splits;
  splits = (tiles + per_split - 1) / per_split;
  p.splits = splits;
  p.tiles_per_split = per_split;
  Plan plan;
  plan.split_grid = dim3(row_tiles, splits, heads);
  plan.combine_grid = dim3((p.rows + C::kWarps - 1) / C::kWarps, heads, 1);
  plan.threads = C::kThreads;
  plan.smem_bytes = C::kSmemBytes;
  plan.splits = splits;
  plan.tiles_per_split = per_split;
  return plan;
}

// ------------------------------------------------------------------------------------------------
// Warp math: S = Q K^T and O += P V for one warp's 16 rows, in the m16n8 accumulator layout
// (lane = 4 * g + t holds rows g and g + 8, columns 2t and 2t + 1 of every n8 tile).

template <typename E>
__device__ __forceinline__ const typename E::Storage* q_row(const Params& p, int b, int kvh, int row) {
  const int head = kvh * p.group + row / p.tree;
  return static_cast<const typename E::Storage*>(p.q) + b * p.q_sb + head * p.q_sh +
         static_cast<int64_t>(row % p.tree) * p.q_st;
}

template <typename E, int D, bool Mma = Config<E, D>::kMma>
struct WarpMath;

// 16-bit inputs on tensor cores: Q stays in registers as A fragments for the whole key range.
template <typename E, int D>
struct WarpMath<E, D, true> {
  using C = Config<E, D>;
  uint32_t qa[D / 16][4];

  __device__ __forceinline__ void load_q(const Params& p, int b, int kvh, int warp_row, int lane,
                                         float* /*q_smem*/) {
    const int g = lane >> 2, t = lane & 3;
    const int r0 = warp_row + g, r1 = r0 + 8;
    const uint16_t* q0 = r0 < p.rows ? q_row<E>(p, b, kvh, r0) : nullptr;
    const uint16_t* q1 = r1 < p.rows ? q_row<E>(p, b, kvh, r1) : nullptr;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int c = kk * 16 + 2 * t;
      qa[kk][0] = q0 ? *reinterpret_cast<const uint32_t*>(q0 + c) : 0u;
      qa[kk][1] = q1 ? *reinterpret_cast<const uint32_t*>(q1 + c) : 0u;
      qa[kk][2] = q0 ? *reinterpret_cast<const uint32_t*>(q0 + c + 8) : 0u;
      qa[kk][3] = q1 ? *reinterpret_cast<const uint32_t*>(q1 + c + 8) : 0u;
    }
  }

  // B = K^T (k = dim, n = key) is K row-major: one ldmatrix.x4 gives b0, b1 of two n8 key tiles.
  // Lane l addresses key 16 n2 + 8 (l / 16) + l % 8 at dims 16 kk + 8 ((l / 8) % 2).
  __device__ __forceinline__ void qk(float (&s)[C::kKeyFrags][4], const uint16_t* ks, int lane) const {
#pragma unroll
    for (int n = 0; n < C::kKeyFrags; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    const uint16_t* base = ks + ((lane / 16) * 8 + lane % 8) * C::kRowStride + ((lane / 8) % 2) * 8;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int n2 = 0; n2 < C::kKeyFrags / 2; ++n2) {
        uint32_t b[4];
        ldmatrix_x4<false>(b, base + n2 * 16 * C::kRowStride + kk * 16);
        mma_16816<E>(s[2 * n2], qa[kk], b[0], b[1]);
        mma_16816<E>(s[2 * n2 + 1], qa[kk], b[2], b[3]);
      }
    }
  }

  // s holds P (fp32) in the accumulator layout; its two n8 tiles per k16 step are exactly the A
  // fragment of P V (rows g, g + 8; columns 2t, 2t + 1 and 8 + 2t, 9 + 2t).
  // B = V (k = key, n = dim) is V row-major read by columns: one ldmatrix.x4.trans gives b0, b1 of
  // two n8 dim tiles. Lane l addresses key 16 kk + 8 ((l / 8) % 2) + l % 8 at dims 16 n2 + 8 (l / 16).
  __device__ __forceinline__ void pv(float (&o)[C::kDimFrags][4], const float (&s)[C::kKeyFrags][4],
                                     const uint16_t* vs, int lane, float* /*p_smem*/) const {
    const uint16_t* base = vs + (((lane / 8) % 2) * 8 + lane % 8) * C::kRowStride + (lane / 16) * 8;
#pragma unroll
    for (int kk = 0; kk < C::kTileKeys / 16; ++kk) {
      const uint32_t a[4] = {pack2<E>(s[2 * kk][0], s[2 * kk][1]), pack2<E>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<E>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2<E>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int n2 = 0; n2 < C::kDimFrags / 2; ++n2) {
        uint32_t b[4];
        ldmatrix_x4<true>(b, base + kk * 16 * C::kRowStride + n2 * 16);
        mma_16816<E>(o[2 * n2], a, b[0], b[1]);
        mma_16816<E>(o[2 * n2 + 1], a, b[2], b[3]);
      }
    }
  }
};

// fp32 inputs: the same accumulator layout computed with FMAs from shared memory, so masking,
// softmax and the epilogue are shared with the tensor-core path. Tensor cores would round the
// inputs (tf32), which fp32 callers do not expect.
template <typename E, int D>
struct WarpMath<E, D, false> {
  using C = Config<E, D>;
  const float* q_rows;  // this warp's 16 rows in shared memory, stride kQStride

  __device__ __forceinline__ void load_q(const Params& p, int b, int kvh, int warp_row, int lane,
                                         float* q_smem) {
    for (int idx = lane; idx < 16 * D; idx += 32) {
      const int r = idx / D, d = idx % D, row = warp_row + r;
      q_smem[r * C::kQStride + d] = row < p.rows ? q_row<E>(p, b, kvh, row)[d] : 0.f;
    }
    q_rows = q_smem;
    __syncwarp();
  }

  __device__ __forceinline__ void qk(float (&s)[C::kKeyFrags][4], const float* ks, int lane) const {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < C::kKeyFrags; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    const float* qa = q_rows + g * C::kQStride;
    const float* qb = qa + 8 * C::kQStride;
    const float* k0 = ks + 2 * t * C::kRowStride;
#pragma unroll 4
    for (int d = 0; d < D; ++d) {
      const float x0 = qa[d], x1 = qb[d];
#pragma unroll
      for (int n = 0; n < C::kKeyFrags; ++n) {
        const float y0 = k0[n * 8 * C::kRowStride + d], y1 = k0[(n * 8 + 1) * C::kRowStride + d];
        s[n][0] = fmaf(x0, y0, s[n][0]);
        s[n][1] = fmaf(x0, y1, s[n][1]);
        s[n][2] = fmaf(x1, y0, s[n][2]);
        s[n][3] = fmaf(x1, y1, s[n][3]);
      }
    }
  }

  __device__ __forceinline__ void pv(float (&o)[C::kDimFrags][4], const float (&s)[C::kKeyFrags][4],
                                     const float* vs, int lane, float* p_smem) const {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < C::kKeyFrags; ++n) {
      p_smem[g * C::kPStride + n * 8 + 2 * t] = s[n][0];
      p_smem[g * C::kPStride + n * 8 + 2 * t + 1] = s[n][1];
      p_smem[(g + 8) * C::kPStride + n * 8 + 2 * t] = s[n][2];
      p_smem[(g + 8) * C::kPStride + n * 8 + 2 * t + 1] = s[n][3];
    }
    __syncwarp();
    const float* pa = p_smem + g * C::kPStride;
    const float* pb = pa + 8 * C::kPStride;
#pragma unroll 4
    for (int j = 0; j < C::kTileKeys; ++j) {
      const float x0 = pa[j], x1 = pb[j];
      const float* vrow = vs + j * C::kRowStride + 2 * t;
#pragma unroll
      for (int n = 0; n < C::kDimFrags; ++n) {
        const float y0 = vrow[n * 8], y1 = vrow[n * 8 + 1];
        o[n][0] = fmaf(x0, y0, o[n][0]);
        o[n][1] = fmaf(x0, y1, o[n][1]);
        o[n][2] = fmaf(x1, y0, o[n][2]);
        o[n][3] = fmaf(x1, y1, o[n][3]);
      }
    }
    __syncwarp();  // P is rewritten by the next tile
  }
};

// ------------------------------------------------------------------------------------------------
// Kernels.

template <typename E, int D>
__device__ __forceinline__ void load_tile(const Params& p, int b, int kvh, int tile,
                                          typename E::Storage* ks, typename E::Storage* vs) {
  using C = Config<E, D>;
  using S = typename E::Storage;
  const S* kbase = static_cast<const S*>(p.k) + b * p.k_sb + kvh * p.k_sh;
  const S* vbase = static_cast<const S*>(p.v) + b * p.v_sb + kvh * p.v_sh;
  const int key0 = tile * C::kTileKeys;
  for (int c = threadIdx.x; c < C::kTileKeys * C::kChunksPerRow; c += C::kThreads) {
    const int r = c / C::kChunksPerRow, col = (c % C::kChunksPerRow) * C::kVec;
    const bool valid = key0 + r < p.keys;  // rows past P + T: zeros, never a read
    const int64_t key = valid ? key0 + r : 0;
    cp_async_16(ks + r * C::kRowStride + col, kbase + key * p.k_ss + col, valid);
    cp_async_16(vs + r * C::kRowStride + col, vbase + key * p.v_ss + col, valid);
  }
  cp_async_commit();
}

template <typename E, int D>
__global__ void __launch_bounds__(Config<E, D>::kThreads) tree_attention_split_kernel(const Params p) {
  using C = Config<E, D>;
  using S = typename E::Storage;
  constexpr float kNegInf = -INFINITY;
  DARTREE_DYNAMIC_SMEM(smem);
  S* kv_smem = reinterpret_cast<S*>(smem);  // [stage][K, V][kTileKeys][kRowStride]
  float* q_smem = reinterpret_cast<float*>(smem + C::kKvBytes);  // fp32 path only
  float* p_smem = q_smem + C::kWarps * 16 * C::kQStride;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  const int bh = blockIdx.z, b = bh / p.kv_heads, kvh = bh % p.kv_heads;
  const int split = blockIdx.y;
  const int num_tiles = (p.keys + C::kTileKeys - 1) / C::kTileKeys;
  const int tile_begin = split * p.tiles_per_split;
  const int tile_end = imin(tile_begin + p.tiles_per_split, num_tiles);
  const int warp_row = blockIdx.x * C::kBlockRows + warp * 16;
  const bool active = warp_row < p.rows;  // warp-uniform: idle warps still load and sync
  const int row0 = warp_row + g;          // this lane's rows: row0 and row0 + 8

  WarpMath<E, D> math;
  if (active) math.load_q(p, b, kvh, warp_row, lane, q_smem + warp * 16 * C::kQStride);

  float o[C::kDimFrags][4];
#pragma unroll
  for (int n = 0; n < C::kDimFrags; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};

  if (tile_begin < tile_end) load_tile<E, D>(p, b, kvh, tile_begin, kv_smem, kv_smem + C::kTileElems);
  for (int tile = tile_begin; tile < tile_end; ++tile) {
    const int stage = (tile - tile_begin) & 1;
    S* ks = kv_smem + stage * 2 * C::kTileElems;
    S* vs = ks + C::kTileElems;
    if (tile + 1 < tile_end) {  // prefetch the next tile into the other stage
      S* next = kv_smem + (stage ^ 1) * 2 * C::kTileElems;
      load_tile<E, D>(p, b, kvh, tile + 1, next, next + C::kTileElems);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    if (active) {
      float s[C::kKeyFrags][4];
      math.qk(s, ks, lane);

      // Scale into the base-2 domain; mask keys past P + T and, in tree tiles, by the mask.
      const int key0 = tile * C::kTileKeys;
      const bool plain = key0 + C::kTileKeys <= p.prefix;
      const uint8_t* mrow0 = p.mask + (static_cast<int64_t>(b) * p.tree + row0 % p.tree) * p.tree;
      const uint8_t* mrow1 = p.mask + (static_cast<int64_t>(b) * p.tree + (row0 + 8) % p.tree) * p.tree;
#pragma unroll
      for (int n = 0; n < C::kKeyFrags; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x = s[n][e] * p.scale_log2;
          if (plain) {
            s[n][e] = x;
          } else {
            const int key = key0 + n * 8 + 2 * t + (e & 1);
            const uint8_t* mrow = e < 2 ? mrow0 : mrow1;
            const bool visible = key < p.keys && (key < p.prefix || mrow[key - p.prefix] != 0);
            s[n][e] = visible ? x : kNegInf;
          }
        }
      }

      // Online softmax for rows row0 (e = 0, 1) and row0 + 8 (e = 2, 3); a row's 4 lanes agree.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = m[h];
#pragma unroll
        for (int n = 0; n < C::kKeyFrags; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
        mx = fmaxf(mx, shfl_xor(mx, 1));
        mx = fmaxf(mx, shfl_xor(mx, 2));
        const float base = mx == kNegInf ? 0.f : mx;  // nothing visible yet: every p is 0
        const float alpha = exp2f(m[h] - base);
        m[h] = mx;
        l[h] *= alpha;
#pragma unroll
        for (int n = 0; n < C::kDimFrags; ++n) {
          o[n][2 * h] *= alpha;
          o[n][2 * h + 1] *= alpha;
        }
#pragma unroll
        for (int n = 0; n < C::kKeyFrags; ++n) {
          s[n][2 * h] = exp2f(s[n][2 * h] - base);
          s[n][2 * h + 1] = exp2f(s[n][2 * h + 1] - base);
          l[h] += s[n][2 * h] + s[n][2 * h + 1];  // this lane's columns; summed over the quad below
        }
      }
      math.pv(o, s, vs, lane, p_smem + warp * 16 * C::kPStride);
    }
    __syncthreads();  // this stage is refilled by the next iteration's prefetch
  }

  if (!active) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += shfl_xor(l[h], 1);
    l[h] += shfl_xor(l[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 8 * h;
    if (row >= p.rows) continue;
    if (p.splits == 1) {
      const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
      const int head = kvh * p.group + row / p.tree;
      S* dst = static_cast<S*>(p.out) + b * p.o_sb + head * p.o_sh +
               static_cast<int64_t>(row % p.tree) * p.o_st;
#pragma unroll
      for (int n = 0; n < C::kDimFrags; ++n) {
        const int col = n * 8 + 2 * t;
        if constexpr (C::kMma) {
          *reinterpret_cast<uint32_t*>(dst + col) = pack2<E>(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
        } else {
          dst[col] = o[n][2 * h] * inv;
          dst[col + 1] = o[n][2 * h + 1] * inv;
        }
      }
    } else {
      const int64_t at = (static_cast<int64_t>(bh) * p.splits + split) * p.rows + row;
      float* dst = p.part_o + at * D;
#pragma unroll
      for (int n = 0; n < C::kDimFrags; ++n) {
        dst[n * 8 + 2 * t] = o[n][2 * h];
        dst[n * 8 + 2 * t + 1] = o[n][2 * h + 1];
      }
      if (t == 0) {
        p.part_ml[2 * at] = m[h];
        p.part_ml[2 * at + 1] = l[h];
      }
    }
  }
}

// One warp per (KV head, row): merge the splits' partial rows by their base-2 log-sum-exp.
template <typename E, int D>
__global__ void __launch_bounds__(Config<E, D>::kThreads) tree_attention_combine_kernel(const Params p) {
  using C = Config<E, D>;
  using S = typename E::Storage;
  constexpr int kPer = D / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * C::kWarps + warp, bh = blockIdx.y;
  if (row >= p.rows) return;  // whole warps only; no block-wide sync below
  const int b = bh / p.kv_heads, kvh = bh % p.kv_heads;
  const int64_t first = static_cast<int64_t>(bh) * p.splits * p.rows + row;
  float best = -INFINITY;
  for (int s = 0; s < p.splits; ++s) best = fmaxf(best, p.part_ml[2 * (first + int64_t(s) * p.rows)]);
  float acc[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) acc[u] = 0.f;
  float total = 0.f;
  if (best != -INFINITY) {
    for (int s = 0; s < p.splits; ++s) {
      const int64_t at = first + int64_t(s) * p.rows;
      const float ls = p.part_ml[2 * at + 1];
      if (ls == 0.f) continue;  // nothing visible in this split (m is -inf)
      const float w = exp2f(p.part_ml[2 * at] - best);
      total += w * ls;
      const float* src = p.part_o + at * D + lane * kPer;
#pragma unroll
      for (int u = 0; u < kPer; ++u) acc[u] += w * src[u];
    }
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
  const int head = kvh * p.group + row / p.tree;
  S* dst = static_cast<S*>(p.out) + b * p.o_sb + head * p.o_sh + static_cast<int64_t>(row % p.tree) * p.o_st +
           lane * kPer;
#pragma unroll
  for (int u = 0; u < kPer; ++u) dst[u] = from_float<E>(acc[u] * inv);
}

}  // namespace tree_attn
}  // namespace dartree
