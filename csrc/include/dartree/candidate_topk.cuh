// Candidate top-k: the C best tokens of each draft slot and the slot's log-normaliser.
//
// logits [k, V] (float, double, half or bfloat16), contiguous
// values [k, C] Acc (float; double for double input), best first
// ids    [k, C] int64, equal values by lower id (NaN first)
// lse    [k]    Acc, logsumexp over all V (skipped when null)
//
// Work split: one block of 1024 threads per row (block_topk: radix select, ordered gather, rank
// sort; then a max pass folded into a sum of exp(x - max) for the lse). One block per row keeps
// the selection free of cross-block merging; k = 16 rows leave most SMs of a large GPU idle, which
// is fine for a once-per-round op of ~10 microseconds.
// Bytes: every row is read 1 + passes (5 for 32-bit keys, 9 for float64) + 2 (lse) times, from L2
// after the first; writes C * (sizeof(Acc) + 8) + sizeof(Acc) per row.
// Assumes 1 <= C <= min(V, kMaxSelect = 1024); dynamic shared memory C * (sizeof(Acc) + 8).
// launch_candidate_topk (host) is the launch itself, through the caller's launcher (csrc/cuda/launcher.h).
#pragma once
#include "block_topk.cuh"

namespace dartree {

template <typename In>
__global__ void __launch_bounds__(kSelectThreads) candidate_topk_kernel(const In* __restrict__ logits, int64_t vocab, int count,
                                      typename AccOf<In>::type* __restrict__ values,
                                      int64_t* __restrict__ ids,
                                      typename AccOf<In>::type* __restrict__ lse) {
  using Acc = typename AccOf<In>::type;
  __shared__ TopkShared<Acc> sh;
  __shared__ Acc scratch[32];
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  int64_t* sel_idx = reinterpret_cast<int64_t*>(dynamic_smem);
  Acc* sel_val = reinterpret_cast<Acc*>(sel_idx + count);
  const int64_t row = blockIdx.x;
  const In* x = logits + row * vocab;
  block_topk<In>(x, vocab, count, values + row * count, ids + row * count, sh, sel_val, sel_idx);
  if (lse == nullptr) return;
  Acc local_max = -INFINITY;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const Acc v = load_acc(x + i);
    local_max = (v != v || local_max != local_max) ? (v != v ? v : local_max)
                                                   : (v > local_max ? v : local_max);
  }
  const Acc row_max = block_max_nan(local_max, scratch);
  if (row_max != row_max || isinf(row_max)) {  // NaN, +inf, or a row of -inf
    if (threadIdx.x == 0) lse[row] = row_max;
    return;
  }
  Acc local_sum = 0;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) local_sum += exp(load_acc(x + i) - row_max);
  const Acc total = block_sum(local_sum, scratch);
  if (threadIdx.x == 0) lse[row] = row_max + log(total);
}

template <typename In, typename Launcher>
void launch_candidate_topk(Launcher& launcher, const In* logits, int64_t rows, int64_t vocab, int count,
                           typename AccOf<In>::type* values, int64_t* ids,
                           typename AccOf<In>::type* lse) {
  using Acc = typename AccOf<In>::type;
  if (rows == 0) return;
  const size_t smem = static_cast<size_t>(count) * (sizeof(Acc) + sizeof(int64_t));
  launcher.launch(dim3(static_cast<unsigned>(rows)), dim3(kSelectThreads), smem, candidate_topk_kernel<In>,
                  logits, vocab, count, values, ids, lse);
}

}  // namespace dartree
