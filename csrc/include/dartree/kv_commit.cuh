// KV commit: keep only the accepted branch of a verified draft tree.
//
// kv       [R, S, W]  every (layer, k|v, batch, kv-head) row group of the static cache, each row
//                     seen as W machine words (uint4 when a row is a multiple of 16 bytes)
// accepted [A] int64  tree indices of the accepted path, strictly increasing, accepted[0] == 0
// For every group r and j in [0, A): kv[r, prefix + j, :] = kv[r, prefix + accepted[j], :]
//
// Work split: one thread owns one word column of one group and walks j = 0..A-1 in order. The row
// read at step j' (prefix + accepted[j'] >= prefix + j') is never a row written at an earlier step
// (prefix + j < prefix + j'), and each thread touches only its own column, so the in-place move
// needs no barrier. It is a plain copy, so the element dtype does not matter: only the word size.
// Bytes moved: 2 * R * (A - a0) * W * sizeof(Word), a0 = rows already in place (accepted[j] == j).
// Assumes: kv contiguous; indices validated by the caller (rows outside [0, S) are skipped, never
// read or written, so a bad index cannot fault).
#pragma once
#include <cstdint>

namespace dartree {

constexpr int kCommitThreads = 256;

template <typename Word>
__global__ void __launch_bounds__(kCommitThreads) kv_commit_kernel(Word* __restrict__ kv, const int64_t* __restrict__ accepted,
                                 int64_t num_groups, int64_t seq, int64_t words, int64_t prefix,
                                 int64_t num_accepted) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= num_groups * words) return;
  Word* column = kv + (t / words) * seq * words + (t % words);
  for (int64_t j = 0; j < num_accepted; ++j) {
    const int64_t src = prefix + accepted[j];
    const int64_t dst = prefix + j;
    if (src == dst || src < 0 || src >= seq || dst >= seq) continue;
    column[dst * words] = column[src * words];
  }
}

}  // namespace dartree
