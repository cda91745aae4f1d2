// Block-wide building blocks of the draft-tree kernels (no torch headers):
//   ranks_before   the order shared with the CPU kernels and dartree/reference.py: larger value
//                  first, NaN before every number, equal values (and NaN vs NaN) by lower index;
//   block_topk     the `count` best of x[0, n) by that order, best first, by one thread block;
//   block reductions (sum, max) over all threads of a block.
//
// block_topk, for n entries and count <= kMaxSelect selections:
//   1. radix select on order-preserving integer keys (8 bits per pass: 4 passes for 32-bit keys,
//      8 for float64), each pass a shared-memory histogram of the entries matching the digits
//      chosen so far (warp-aggregated atomics) -> the key of the count-th best entry and how many
//      entries equal to it to take;
//   2. one ordered pass: entries above that key take a slot by atomicAdd, equal ones by their
//      rank in index order (ballot + block scan), so ties keep the lower indices;
//   3. a rank sort of the count selected entries in shared memory (count^2 / threads compares).
//   Reads x (1 + passes) times (L2-resident after the first), writes count values and indices.
//   Shared memory: count * (sizeof(Acc) + 8) bytes, passed as `selected` by the caller.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace dartree {

constexpr int kMaxSelect = 1024;
// The block of every block_topk kernel (candidate_topk, level select, prune): launched with it and
// bounded by it (__launch_bounds__), so the compiler keeps registers within 64 a thread.
constexpr int kSelectThreads = 1024;

template <typename T>
__device__ __forceinline__ bool ranks_before(T a, int64_t ia, T b, int64_t ib) {
  const bool nan_a = a != a, nan_b = b != b;
  if (nan_a != nan_b) return nan_a;
  if (!nan_a && a != b) return a > b;
  return ia < ib;
}

// Element loads in the accumulation type: float for float/half/bfloat16, double for double.
template <typename In>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

__device__ __forceinline__ float load_acc(const float* p) { return *p; }
__device__ __forceinline__ double load_acc(const double* p) { return *p; }
__device__ __forceinline__ float load_acc(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load_acc(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// Order-preserving keys: key(a) > key(b) iff a ranks before b ignoring indices; every NaN maps to
// the largest key and -0.0 to the key of +0.0 (they compare equal).
__device__ __forceinline__ uint32_t radix_key(float v) {
  if (v != v) return 0xffffffffu;
  if (v == 0.0f) v = 0.0f;
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ unsigned long long radix_key(double v) {
  if (v != v) return 0xffffffffffffffffull;
  if (v == 0.0) v = 0.0;
  const unsigned long long u = static_cast<unsigned long long>(__double_as_longlong(v));
  return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
}

template <typename Acc>
struct KeyOf {
  using type = uint32_t;
};
template <>
struct KeyOf<double> {
  using type = unsigned long long;
};

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block (every thread gets it). scratch: 32 T of shared memory.
template <typename T>
__device__ T block_sum(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

// Max over the block, NaN if any thread holds NaN (every thread gets it). scratch: 32 T.
template <typename T>
__device__ T block_max_nan(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) {
    const T other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = (v != v || other != other) ? (v != v ? v : other) : (other > v ? other : v);
  }
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T m = scratch[0];
  for (int w = 1; w < warps; ++w) {
    const T o = scratch[w];
    m = (m != m || o != o) ? (m != m ? m : o) : (o > m ? o : m);
  }
  return m;
}

template <typename Acc>
struct TopkShared {
  unsigned int hist[256];
  unsigned int warp_counts[32];
  typename KeyOf<Acc>::type prefix;
  int remaining;
  int greater_slots;
  int equal_base;
};

// The `count` best entries of x[0, n) (1 <= count <= min(n, kMaxSelect)), best first: values (as
// Acc) into out_val and indices into out_idx (either may be global memory). Every thread of the
// block must call it. sh: shared state; sel_val/sel_idx: shared arrays of `count` entries.
template <typename In>
__device__ void block_topk(const In* __restrict__ x, int64_t n, int count,
                           typename AccOf<In>::type* out_val, int64_t* out_idx,
                           TopkShared<typename AccOf<In>::type>& sh,
                           typename AccOf<In>::type* sel_val, int64_t* sel_idx) {
  using Acc = typename AccOf<In>::type;
  using Key = typename KeyOf<Acc>::type;
  constexpr int kBits = 8 * sizeof(Key);
  const int tid = threadIdx.x, threads = blockDim.x;
  Key prefix = 0, mask = 0;
  int remaining = count;
  for (int shift = kBits - 8; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += threads) sh.hist[i] = 0;
    __syncthreads();
    // warp-aggregated: lanes with the same digit add once (logits crowd a few exponent bins)
    for (int64_t base = 0; base < n; base += threads) {
      const int64_t i = base + tid;
      int digit = 256;  // no bin
      if (i < n) {
        const Key key = radix_key(load_acc(x + i));
        if ((key & mask) == prefix) digit = static_cast<int>((key >> shift) & 0xff);
      }
      const unsigned peers = __match_any_sync(0xffffffffu, digit);
      if (digit < 256 && (threadIdx.x & 31) == __ffs(peers) - 1) {
        atomicAdd(&sh.hist[digit], static_cast<unsigned>(__popc(peers)));
      }
    }
    __syncthreads();
    if (tid == 0) {
      int above = 0, digit = 255;
      for (; digit > 0; --digit) {  // the digit holding the remaining-th best of the matches
        if (above + static_cast<int>(sh.hist[digit]) >= remaining) break;
        above += sh.hist[digit];
      }
      sh.remaining = remaining - above;
      sh.prefix = prefix | (static_cast<Key>(digit) << shift);
    }
    __syncthreads();
    prefix = sh.prefix;
    remaining = sh.remaining;
    mask |= static_cast<Key>(0xff) << shift;
  }
  // prefix: key of the count-th best; take every entry above it and the first `remaining` equal
  const int above_total = count - remaining;
  if (tid == 0) {
    sh.greater_slots = 0;
    sh.equal_base = 0;
  }
  __syncthreads();
  const int lane = tid & 31, warp = tid >> 5, warps = (threads + 31) >> 5;
  for (int64_t base = 0; base < n; base += threads) {
    const int64_t i = base + tid;
    Acc v = Acc(0);
    Key key = 0;
    if (i < n) {
      v = load_acc(x + i);
      key = radix_key(v);
    }
    const bool greater = i < n && key > prefix;
    const bool equal = i < n && key == prefix;
    if (greater) {
      const int slot = atomicAdd(&sh.greater_slots, 1);
      if (slot < above_total) {  // always true; the bound keeps a bad input from writing past
        sel_val[slot] = v;
        sel_idx[slot] = i;
      }
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, equal);
    if (lane == 0) sh.warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, tile_total = 0;
    for (int w = 0; w < warps; ++w) {
      const int c = static_cast<int>(sh.warp_counts[w]);
      before += w < warp ? c : 0;
      tile_total += c;
    }
    const int rank = sh.equal_base + before + __popc(ballot & ((1u << lane) - 1u));
    if (equal && rank < remaining) {
      sel_val[above_total + rank] = v;
      sel_idx[above_total + rank] = i;
    }
    __syncthreads();
    if (tid == 0) sh.equal_base += tile_total;
  }
  __syncthreads();
  // rank sort: distinct (value, index) pairs get distinct ranks
  for (int e = tid; e < count; e += threads) {
    const Acc ve = sel_val[e];
    const int64_t ie = sel_idx[e];
    int rank = 0;
    for (int j = 0; j < count; ++j) rank += ranks_before(sel_val[j], sel_idx[j], ve, ie) ? 1 : 0;
    out_val[rank] = ve;
    out_idx[rank] = ie;
  }
  __syncthreads();
}

}  // namespace dartree
