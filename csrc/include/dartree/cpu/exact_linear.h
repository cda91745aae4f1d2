// CPU batch-invariant linear (op exact_linear, csrc/ops.cpp; the CUDA twin: dartree/exact.cuh):
// out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n]).
//
// x [M, K], weight [N, K], bias [N] | None, out [M, N], all one dtype (float32, float64, float16,
// bfloat16); float32 accumulation (float64 for float64).
//
// Why: a vendor GEMM picks its blocking, its kernel and its split of K from M, so row m of a batch
// rounds differently from the same row computed alone. Here every output element is one dot
// product whose reduction order is fixed by K alone: W-lane partial sums over k = lane (mod W) in
// increasing k, the last partial step zero-padded, then a fixed horizontal sum, then the bias. Tiles
// of MR rows x NR columns only decide which dot products share their loads, never how any one of
// them is summed, so a row's bits do not depend on M, on its place in the batch, on the tile it
// falls in, or on the thread count (work is split over N only, never over K).
//
// One arithmetic per machine and dtype, chosen at load time from the CPU's features:
//   bfloat16 with AMX-BF16:     TDPBF16PS tiles (below), for every M, M = 1 included
//   bfloat16 with AVX512-BF16: VDPBF16PS on 32 k at a time (pairs of products into 16 float lanes)
//   AVX-512F (+BW):            16 float lanes, FMA (16-bit inputs widened)
//   AVX2 + FMA + F16C:          8 float lanes, FMA
//   otherwise (and float64):    one sequential sum over k
// DARTREE_EXACT_ISA=amx|avx512-bf16|avx512|avx2|portable caps the choice (the launcher reads it:
// `cap`, isa_rank; tests use it to check every path on one machine).
//
// AMX: out^T tiles C[16 n][16 m] += W[16 n][32 k] (loaded in place, row stride K) x X^T, where X is
// packed per call into VNNI tiles [16 k-pairs][16 m][2]. Every C element is one dot product of a
// weight row and an x row, summed by the hardware in one fixed order over its k-steps; the rows of
// x only share tiles, never sums. Zero padding fills the last k-step (K % 32) and the last x tile
// (M % 16); the last weight tile (N % 16) is copied into a zero-padded buffer. No weight cache.
//
// Work split: blocks of about kBlockN weight rows per task (`par`: at::parallel_for; RowBlocks
// gives every thread the same number of rows); inside a task every
// MR-row tile of x meets every NR-column tile of the block, so a block's weights are read from
// memory once per call (M = 1 reads each weight once: the decode case is memory-bound) and stay in
// L2 while the tiles of x pass over them.
// Reads x and weight once per call (x stays in cache), writes out once. Assumes contiguous inputs
// and K >= 1 (the launcher, csrc/cpu/exact_linear.cpp, handles K = 0 and the AMX choice).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__linux__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "exact_simd.h"

namespace dartree {
namespace cpu {
namespace exact_lin {

constexpr int64_t kBlockN = 64;  // weight rows per task, at most
constexpr int64_t kRowUnit = 8;  // a task's first row is a multiple of this (and of every NR below)

// The tasks of an N-row call on `threads` threads: at most kBlockN rows each, their count a multiple
// of the thread count where there are enough rows, their bounds multiples of kRowUnit. at::parallel_for
// hands each thread an equal run of tasks, so each thread gets the same rows within one unit: 64-row
// tasks split a 576-row projection 5:4 over 2 threads (the second thread idle for 1/9 of the call).
struct RowBlocks {
  int64_t N, units, count;
  RowBlocks(int64_t rows, int64_t threads) : N(rows), units((rows + kRowUnit - 1) / kRowUnit) {
    const int64_t t = std::max<int64_t>(threads, 1), per = t * (kBlockN / kRowUnit);
    count = std::min(units, t * ((units + per - 1) / per));
  }
  int64_t begin(int64_t block) const { return std::min(N, block * units / count * kRowUnit); }
};

// One tile: out rows x[0..mr) against weight rows w[0..nr); pointers per row, strides in elements.
struct Tile {
  const void* x;
  int64_t ldx;
  const void* w;
  int64_t ldw;
  int64_t K;
  float* out;  // [mr, ldo] float results before the bias
  int64_t ldo;
  int mr, nr;
};

// ------------------------------------------------------------------------------------------------
// Portable: one sequential sum per output (also the float64 path).

template <typename scalar_t, typename acc_t>
acc_t dot_portable(const scalar_t* a, const scalar_t* b, int64_t K) {
  acc_t sum = 0;
  for (int64_t k = 0; k < K; ++k) sum += static_cast<acc_t>(a[k]) * static_cast<acc_t>(b[k]);
  return sum;
}

#if DARTREE_X86 && defined(__GNUC__)
// Weight row j of the next tile (rows NR.. after this tile's), at element k: its cache line is
// requested into L2 while this tile computes. A call of few rows is bound by the weight stream,
// and over rows of a few KB the hardware prefetcher alone keeps too few lines in flight. Measured
// (EPYC, 2 threads, bench/results/gemv_routing.md): into L1 (prefetcht0) it gained little, at 1
// to 8 tiles ahead alike; into L2 a one-row bfloat16 LM head reads 21-28 GB/s instead of 14-17.
// A hint only: past the tensor's end it reads nothing and never faults.
inline void prefetch_next(const char* next, int j, int64_t ldw, int64_t k, size_t element) {
  __builtin_prefetch(next + (j * ldw + k) * int64_t(element), 0, 2);  // into L2 (prefetcht1)
}

// ---- AVX-512: 16 float lanes. Loaders widen 16 elements (n < 16: the first n, zeros after).
struct F32x16 {
  DARTREE_AVX512 static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  DARTREE_AVX512 static __m512 load(const float* p, int64_t n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
};
struct Bf16x16 {
  DARTREE_AVX512 static __m512 widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  DARTREE_AVX512 static __m512 load(const void* p) {
    return widen(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  }
  DARTREE_AVX512 static __m512 load(const void* p, int64_t n) {
    return widen(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p));
  }
};
struct F16x16 {
  DARTREE_AVX512 static __m512 load(const void* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  }
  DARTREE_AVX512 static __m512 load(const void* p, int64_t n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p));
  }
};

template <typename scalar_t, Bits16 kBits = Bits16Of<scalar_t>::value> struct Avx512Loader;
template <> struct Avx512Loader<float, Bits16::kNone> : F32x16 {};
template <typename scalar_t> struct Avx512Loader<scalar_t, Bits16::kBFloat16> : Bf16x16 {};
template <typename scalar_t> struct Avx512Loader<scalar_t, Bits16::kFloat16> : F16x16 {};

template <int MR, int NR, typename scalar_t>
DARTREE_AVX512 void tile_avx512(const Tile& t) {
  using L = Avx512Loader<scalar_t>;
  const scalar_t* x[MR];
  const scalar_t* w[NR];
  // Rows past mr / columns past nr repeat the last real one: their results are dropped.
  for (int i = 0; i < MR; ++i)
    x[i] = static_cast<const scalar_t*>(t.x) + std::min(i, t.mr - 1) * t.ldx;
  for (int j = 0; j < NR; ++j)
    w[j] = static_cast<const scalar_t*>(t.w) + std::min(j, t.nr - 1) * t.ldw;
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const char* next = static_cast<const char*>(t.w) + NR * t.ldw * int64_t(sizeof(scalar_t));
  int64_t k = 0;
  for (; k + 16 <= t.K; k += 16) {
    __m512 b[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) b[j] = L::load(w[j] + k);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) prefetch_next(next, j, t.ldw, k, sizeof(scalar_t));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 a = L::load(x[i] + k);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
    }
  }
  if (k < t.K) {
    const int64_t n = t.K - k;
    __m512 b[NR];
    for (int j = 0; j < NR; ++j) b[j] = L::load(w[j] + k, n);
    for (int i = 0; i < MR; ++i) {
      const __m512 a = L::load(x[i] + k, n);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
    }
  }
  for (int i = 0; i < t.mr; ++i)
    for (int j = 0; j < t.nr; ++j) t.out[i * t.ldo + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// ---- AVX512-BF16: VDPBF16PS, lane l of a step adds x[k+2l] w[k+2l] + x[k+2l+1] w[k+2l+1].
DARTREE_AVX512BF16 inline __m512bh load_bf16x32(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}
DARTREE_AVX512BF16 inline __m512bh load_bf16x32(const uint16_t* p, int64_t n) {
  const __mmask32 mask = n >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << n) - 1);
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

template <int MR, int NR>
DARTREE_AVX512BF16 void tile_avx512_bf16(const Tile& t) {
  const uint16_t* x[MR];  // bfloat16 bits
  const uint16_t* w[NR];
  for (int i = 0; i < MR; ++i)
    x[i] = static_cast<const uint16_t*>(t.x) + std::min(i, t.mr - 1) * t.ldx;
  for (int j = 0; j < NR; ++j)
    w[j] = static_cast<const uint16_t*>(t.w) + std::min(j, t.nr - 1) * t.ldw;
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const char* next = static_cast<const char*>(t.w) + NR * t.ldw * int64_t(sizeof(uint16_t));
  int64_t k = 0;
  for (; k + 32 <= t.K; k += 32) {
    __m512bh b[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) b[j] = load_bf16x32(w[j] + k);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) prefetch_next(next, j, t.ldw, k, sizeof(uint16_t));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = load_bf16x32(x[i] + k);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
  if (k < t.K) {
    const int64_t n = t.K - k;
    __m512bh b[NR];
    for (int j = 0; j < NR; ++j) b[j] = load_bf16x32(w[j] + k, n);
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = load_bf16x32(x[i] + k, n);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
  for (int i = 0; i < t.mr; ++i)
    for (int j = 0; j < t.nr; ++j) t.out[i * t.ldo + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// ---- AVX2: 8 float lanes. Tails go through a zero-padded copy.
template <typename scalar_t>
DARTREE_AVX2 inline __m256 load8_any(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) return _mm256_loadu_ps(p);
  else if constexpr (Bits16Of<scalar_t>::value == Bits16::kBFloat16)
    return load8_bf16(reinterpret_cast<const uint16_t*>(p));
  else return load8_fp16(reinterpret_cast<const uint16_t*>(p));
}
template <typename scalar_t>
DARTREE_AVX2 inline __m256 load8_any(const scalar_t* p, int64_t n) {
  scalar_t pad[8];
  std::memset(static_cast<void*>(pad), 0, sizeof(pad));
  std::memcpy(static_cast<void*>(pad), p, n * sizeof(scalar_t));
  return load8_any(pad);
}

template <int MR, int NR, typename scalar_t>
DARTREE_AVX2 void tile_avx2(const Tile& t) {
  const scalar_t* x[MR];
  const scalar_t* w[NR];
  for (int i = 0; i < MR; ++i)
    x[i] = static_cast<const scalar_t*>(t.x) + std::min(i, t.mr - 1) * t.ldx;
  for (int j = 0; j < NR; ++j)
    w[j] = static_cast<const scalar_t*>(t.w) + std::min(j, t.nr - 1) * t.ldw;
  __m256 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= t.K; k += 8) {
    __m256 b[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) b[j] = load8_any(w[j] + k);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 a = load8_any(x[i] + k);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(a, b[j], acc[i][j]);
    }
  }
  if (k < t.K) {
    const int64_t n = t.K - k;
    __m256 b[NR];
    for (int j = 0; j < NR; ++j) b[j] = load8_any(w[j] + k, n);
    for (int i = 0; i < MR; ++i) {
      const __m256 a = load8_any(x[i] + k, n);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(a, b[j], acc[i][j]);
    }
  }
  for (int i = 0; i < t.mr; ++i)
    for (int j = 0; j < t.nr; ++j) t.out[i * t.ldo + j] = hsum8(acc[i][j]);
}
#endif  // DARTREE_X86


// ---- AMX-BF16 (see the header comment).
#if DARTREE_X86 && defined(__GNUC__) && defined(__linux__)
#define DARTREE_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

inline bool has_amx_bf16() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!has_avx512() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;  // AMX-TILE, AMX-BF16
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // ask Linux for tile state
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kAmxGroup = 4;  // x tiles (of 16 rows) per pass over a weight tile: C in tmm0..3

// C tiles tmm0..MT-1 for one weight tile: a [16 n][K] bf16 with row stride lda bytes for the full
// k-steps; `tail` a [16][32] zero-padded copy of the last partial k-step (or null); xp the packed
// x tiles of this group, k_steps tiles of 1 KiB each per x tile.
template <int MT>
DARTREE_AMX void amx_weight_tile(const uint16_t* a, int64_t lda, int64_t full_steps, const uint16_t* tail,
                                 const uint16_t* xp, int64_t k_steps, float* c) {
  _tile_zero(0);
  if constexpr (MT > 1) _tile_zero(1);
  if constexpr (MT > 2) _tile_zero(2);
  if constexpr (MT > 3) _tile_zero(3);
  for (int64_t ks = 0; ks < k_steps; ++ks) {
    if (ks < full_steps) {
      _tile_loadd(4, a + ks * 32, lda);
    } else {
      _tile_loadd(4, tail, 64);
    }
    _tile_loadd(5, xp + ks * 512, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (MT > 1) {
      _tile_loadd(6, xp + (k_steps + ks) * 512, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (MT > 2) {
      _tile_loadd(5, xp + (2 * k_steps + ks) * 512, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (MT > 3) {
      _tile_loadd(6, xp + (3 * k_steps + ks) * 512, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (MT > 1) _tile_stored(1, c + 256, 64);
  if constexpr (MT > 2) _tile_stored(2, c + 512, 64);
  if constexpr (MT > 3) _tile_stored(3, c + 768, 64);
}

// tmm0..6 all 16 rows x 64 bytes. A constant in memory: GCC drops stores to a stack config as dead
// (it does not see ldtilecfg read them), which leaves the tiles unconfigured.
constexpr TileConfig make_tile_config() {
  TileConfig cfg{};
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  return cfg;
}
inline constexpr TileConfig kTileConfig = make_tile_config();

DARTREE_AMX inline void amx_configure() { _tile_loadconfig(&kTileConfig); }

DARTREE_AMX inline void amx_release() { _tile_release(); }

// x rows [begin, end) of [M, K] into the zeroed VNNI tiles xp (layout in run_amx): the pair
// (k, k + 1) of row m is the 32-bit word (k % 32) / 2 * 16 + m % 16 of tile (m / 16, k / 32), so a
// full k-step of a row is one 16-word scatter.
DARTREE_AMX inline void amx_pack_rows(const uint16_t* x, int64_t K, int64_t k_steps, int64_t begin, int64_t end,
                               uint16_t* xp) {
  const __m512i words = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
  for (int64_t m = begin; m < end; ++m) {
    const uint16_t* row = x + m * K;
    uint16_t* tile_row = xp + (m / 16) * k_steps * 512 + (m % 16) * 2;
    const int64_t full = K / 32;
    for (int64_t ks = 0; ks < full; ++ks)
      _mm512_i32scatter_epi32(tile_row + ks * 512, words, _mm512_loadu_si512(row + ks * 32), 4);
    for (int64_t k = full * 32; k < K; ++k) tile_row[(k / 32) * 512 + ((k % 32) / 2) * 32 + (k % 2)] = row[k];
  }
}

// One stored C tile c[n][m] (16 x 16 floats) -> out rows m < mr, columns n < nr (row stride ldo):
// + bias[n], rounded to bfloat16 as c10::BFloat16(float) rounds (nearest even, NaN -> 0x7FC0), so
// the bits are those of the scalar `static_cast<BFloat16>(c + float(bias))`. One 16-column
// gather per output row: a scalar loop here cost 1.4-2.6 ns per output element, a third of a
// 16-row verify's linear time and more than the weights' read at 64 rows (bench/exact_linear.py).
DARTREE_AMX inline void amx_store_tile(const float* c, const uint16_t* bias, int64_t mr, int64_t nr, uint16_t* out,
                                int64_t ldo) {
  const __mmask16 cols = static_cast<__mmask16>((1u << nr) - 1);
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  __m512 b = _mm512_setzero_ps();
  if (bias != nullptr)
    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cols, bias)), 16));
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF), nan = _mm512_set1_epi32(0x7FC0);
  for (int64_t m = 0; m < mr; ++m) {
    __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), cols, _mm512_add_epi32(column, _mm512_set1_epi32(m)),
                                        c, 4);
    if (bias != nullptr) v = _mm512_add_ps(v, b);
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, half)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
    _mm256_mask_storeu_epi16(out + m * ldo, cols, _mm512_cvtepi32_epi16(r));
  }
}

// x, w, bias, out: bfloat16 bits.
// rows(n0, n1, scratch): weight rows [n0, n1) as bfloat16 bits, row stride K (see DenseRows below).
template <typename Rows, typename Par>
void run_amx_rows(const uint16_t* x, const Rows& rows, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                  uint16_t* out, const Par& par) {
  const int64_t k_steps = (K + 31) / 32, full_steps = K / 32, m_tiles = (M + 15) / 16;
  // x^T in VNNI tiles: xp[((mt * k_steps + ks) * 16 + kp) * 32 + (m % 16) * 2 + k % 2]
  std::vector<uint16_t> xp(m_tiles * k_steps * 512, 0);
  par(0, M, 16, [&](int64_t begin, int64_t end) {
    amx_pack_rows(x, K, k_steps, begin, end, xp.data());
  });
  const int64_t n_tiles = (N + 15) / 16;
  par(0, n_tiles, 1, [&](int64_t begin, int64_t end) {
    amx_configure();
    alignas(64) uint16_t tail[16 * 32];
    alignas(64) float c[kAmxGroup * 256];
    std::vector<uint16_t> padded;  // the last, partial weight tile: [16][k_steps * 32]
    std::vector<uint16_t> scratch;
    for (int64_t nt = begin; nt < end; ++nt) {
      const int64_t n0 = nt * 16, nr = std::min<int64_t>(16, N - n0);
      const uint16_t* a = rows(n0, n0 + nr, scratch);
      int64_t lda = K * 2, full = full_steps;
      if (nr < 16) {
        padded.assign(16 * k_steps * 32, 0);
        for (int64_t r = 0; r < nr; ++r) std::memcpy(padded.data() + r * k_steps * 32, a + r * K, K * 2);
        a = padded.data();
        lda = k_steps * 64;
        full = k_steps;
      } else if (full < k_steps) {
        std::memset(tail, 0, sizeof(tail));
        for (int64_t r = 0; r < 16; ++r) std::memcpy(tail + r * 32, a + r * K + full * 32, (K - full * 32) * 2);
      }
      for (int64_t mt0 = 0; mt0 < m_tiles; mt0 += kAmxGroup) {
        const int64_t group = std::min(kAmxGroup, m_tiles - mt0);
        const uint16_t* xg = xp.data() + mt0 * k_steps * 512;
        switch (group) {
          case 1: amx_weight_tile<1>(a, lda, full, tail, xg, k_steps, c); break;
          case 2: amx_weight_tile<2>(a, lda, full, tail, xg, k_steps, c); break;
          case 3: amx_weight_tile<3>(a, lda, full, tail, xg, k_steps, c); break;
          default: amx_weight_tile<4>(a, lda, full, tail, xg, k_steps, c); break;
        }
        for (int64_t j = 0; j < group; ++j) {
          const int64_t m_base = (mt0 + j) * 16, mr = std::min<int64_t>(16, M - m_base);
          amx_store_tile(c + j * 256, b == nullptr ? nullptr : b + n0, mr, nr, out + m_base * N + n0, N);
        }
      }
    }
    amx_release();
  });
}
#else
inline bool has_amx_bf16() { return false; }
template <typename Rows, typename Par>
void run_amx_rows(const uint16_t*, const Rows&, const uint16_t*, int64_t, int64_t, int64_t, uint16_t*,
                  const Par&) {}
#endif

template <typename scalar_t>
void tile_portable(const Tile& t) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  for (int i = 0; i < t.mr; ++i)
    for (int j = 0; j < t.nr; ++j)
      t.out[i * t.ldo + j] = static_cast<float>(dot_portable<scalar_t, acc_t>(
          static_cast<const scalar_t*>(t.x) + i * t.ldx, static_cast<const scalar_t*>(t.w) + j * t.ldw, t.K));
}

// ------------------------------------------------------------------------------------------------
// The machine's arithmetic for a dtype: a tile function per row count mr = 1..MR (NR fixed).

// The rank of a path named by DARTREE_EXACT_ISA (the launcher's cap on the choice): portable 0,
// avx2 1, avx512 2, avx512-bf16 3, amx 4 (unset or empty: 4, every path); -1 for another name.
inline int isa_rank(const char* name) {
  if (name == nullptr || *name == 0) return 4;
  for (const auto& [label, rank] : {std::pair<const char*, int>{"portable", 0}, {"avx2", 1},
                                    {"avx512", 2}, {"avx512-bf16", 3}, {"amx", 4}})
    if (std::strcmp(name, label) == 0) return rank;
  return -1;
}

// Whether bfloat16 takes the AMX path under the cap.
inline bool use_amx(int cap) {
  static const bool ok = cap >= 4 && has_amx_bf16();
  return ok;
}

// Whether bfloat16 takes the VDPBF16PS tiles under the cap (AMX aside).
inline bool use_vdpbf16(int cap) { return cap >= 3 && has_avx512_bf16(); }

using TileFn = void (*)(const Tile&);
struct Kernel {
  int MR;           // rows per tile
  TileFn tiles[4];  // tiles[mr - 1] for a tile of mr <= MR rows ...
  int widths[4];    // ... and widths[mr - 1] columns
};

template <typename scalar_t>
Kernel select_kernel(int cap) {
#if DARTREE_X86 && defined(__GNUC__)
  if constexpr (!std::is_same_v<scalar_t, double>) {
    if constexpr (Bits16Of<scalar_t>::value == Bits16::kBFloat16) {
      if (use_vdpbf16(cap))
        return {4, {tile_avx512_bf16<1, 8>, tile_avx512_bf16<2, 4>, tile_avx512_bf16<3, 4>,
                    tile_avx512_bf16<4, 4>}, {8, 4, 4, 4}};
    }
    if (cap >= 2 && has_avx512())
      return {4, {tile_avx512<1, 8, scalar_t>, tile_avx512<2, 4, scalar_t>, tile_avx512<3, 4, scalar_t>,
                  tile_avx512<4, 4, scalar_t>}, {8, 4, 4, 4}};
    if (cap >= 1 && has_avx2())
      return {2, {tile_avx2<1, 4, scalar_t>, tile_avx2<2, 4, scalar_t>, nullptr, nullptr}, {4, 4, 0, 0}};
  }
#endif
  return {4, {tile_portable<scalar_t>, tile_portable<scalar_t>, tile_portable<scalar_t>,
              tile_portable<scalar_t>}, {4, 4, 4, 4}};
}

// The weight rows a block of outputs reads: a [n_end - n_begin, K] matrix with row stride K. Dense
// weights are read in place; packed ones (cpu/packed_rows.h) are rebuilt into the task's scratch.
template <typename scalar_t>
struct DenseRows {
  const scalar_t* w;
  int64_t K;
  const scalar_t* operator()(int64_t n_begin, int64_t, std::vector<scalar_t>&) const { return w + n_begin * K; }
};

template <typename scalar_t, typename Rows, typename Par>
void run_rows(const scalar_t* x, const Rows& rows, const scalar_t* bias, int64_t M, int64_t N, int64_t K,
              scalar_t* out, int cap, const Par& par) {
  static const Kernel kern = select_kernel<scalar_t>(cap);
  const RowBlocks blocks(N, par.threads());
  par(0, blocks.count, 1, [&](int64_t begin, int64_t end) {
    float acc[4 * 8];
    // kept by the thread from call to call: a new one was zero-filled at every call (64 rows x K,
    // 0.4 MB at K = 1536 in float32) before the rows overwrite it
    thread_local std::vector<scalar_t> scratch;
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n_begin = blocks.begin(blk), n_end = blocks.begin(blk + 1);
      const scalar_t* w = rows(n_begin, n_end, scratch) - n_begin * K;  // indexed by n below
      for (int64_t m0 = 0; m0 < M; m0 += kern.MR) {
        const int mr = static_cast<int>(std::min<int64_t>(kern.MR, M - m0));
        const int width = kern.widths[mr - 1];
        for (int64_t n0 = n_begin; n0 < n_end; n0 += width) {
          const int nr = static_cast<int>(std::min<int64_t>(width, n_end - n0));
          const Tile tile{x + m0 * K, K, w + n0 * K, K, K, acc, width, mr, nr};
          kern.tiles[mr - 1](tile);
          for (int i = 0; i < mr; ++i) {
            scalar_t* dst = out + (m0 + i) * N + n0;
            for (int j = 0; j < nr; ++j) {
              float v = acc[i * width + j];
              if (bias != nullptr) v += static_cast<float>(bias[n0 + j]);
              dst[j] = static_cast<scalar_t>(v);
            }
          }
        }
      }
    }
  });
}

template <typename scalar_t, typename Par>
void run(const scalar_t* x, const scalar_t* w, const scalar_t* bias, int64_t M, int64_t N, int64_t K,
         scalar_t* out, int cap, const Par& par) {
  run_rows(x, DenseRows<scalar_t>{w, K}, bias, M, N, K, out, cap, par);
}

// float64 keeps its own accumulator (the float buffer above would round it).
template <typename Par>
void run(const double* x, const double* w, const double* bias, int64_t M, int64_t N, int64_t K,
         double* out, int /*cap*/, const Par& par) {
  par(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = begin; n < end; ++n) {
        double v = dot_portable<double, double>(x + m * K, w + n * K, K);
        if (bias != nullptr) v += bias[n];
        out[m * N + n] = v;
      }
  });
}

}  // namespace exact_lin
}  // namespace cpu
}  // namespace dartree
