// CPU pruning of a draft tree and its verify layout (the CUDA twin: dartree/prune_tree.cuh).
//
// in   parents [M] (parents[0] == -1, 0 <= parents[i] < i, checked by the caller), depths [M],
//      scores [M] T, bonus, N (1 <= N <= M)
// out  kept [N]: the root and the N - 1 nodes with the largest key = score + bonus * depth (ties:
//      lower index), ascending; new_parents [N] (-1 for the root, and for a kept node whose parent
//      was pruned: then the return value is 1); optional new_depths [N], ancestors int32
//      [N, ceil(N / 32)] (bit j of row i: j is i or an ancestor of i), first_child / next_sibling
//      [N] (-1 = none, children in index order).
// Work: one thread; a TopN heap of N - 1 keys over the M nodes, a sort of the kept indices, then
// O(N) passes for the remap and links and O(N * N / 32) words for the ancestor rows. Keys round
// the product before the sum (no fused multiply-add), as the reference does.
// Scratch: M + 2N int64 and N T from the caller's vectors (grown, never shrunk).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "ranking.h"

namespace dartree {
namespace cpu {

// Keep the root and the N - 1 nodes with the largest key = score + bonus * depth (ties: lower
// index), in index order. Writes kept/new_parents (and each optional layout output when not null).
// Returns 0, or 1 when a kept node's parent was pruned (new_parents then holds -1 there).
// parents must satisfy parents[0] == -1, 0 <= parents[i] < i (checked by the caller).
template <typename T>
int prune_tree(int64_t M, const int64_t* parents, const int64_t* depths, const T* scores, T bonus,
               int64_t N, int64_t* kept, int64_t* new_parents, int64_t* new_depths,
               int32_t* ancestors, int64_t* first_child, int64_t* next_sibling,
               std::vector<int64_t>& scratch, std::vector<T>& heap_scratch) {
  scratch.assign(M + 2 * N, 0);
  int64_t* remap = scratch.data();
  int64_t* order = remap + M;
  int64_t* heap_idx = order + N;
  heap_scratch.resize(N);
  const int64_t K = N - 1;
  kept[0] = 0;
  if (K > 0) {
    TopN<T> top(heap_scratch.data(), heap_idx, K);
    for (int64_t i = 1; i < M; ++i) {
      // the product is rounded before the sum, as in the reference (no fused multiply-add)
      volatile T step = bonus * static_cast<T>(depths[i]);
      top.push(scores[i] + step, i);
    }
    std::copy(heap_idx, heap_idx + K, kept + 1);
    std::sort(kept + 1, kept + N);
  }
  std::fill(remap, remap + M, -1);
  for (int64_t n = 0; n < N; ++n) remap[kept[n]] = n;
  int status = 0;
  new_parents[0] = -1;
  for (int64_t n = 1; n < N; ++n) {
    new_parents[n] = remap[parents[kept[n]]];
    if (new_parents[n] < 0) status = 1;
  }
  if (new_depths != nullptr) {
    for (int64_t n = 0; n < N; ++n) new_depths[n] = depths[kept[n]];
  }
  if (first_child != nullptr) {
    std::fill(first_child, first_child + N, -1);
    std::fill(next_sibling, next_sibling + N, -1);
    for (int64_t n = N - 1; n >= 1; --n) {  // descending: lists come out in index order
      const int64_t p = new_parents[n];
      if (p < 0) continue;
      next_sibling[n] = first_child[p];
      first_child[p] = n;
    }
  }
  if (ancestors != nullptr) {
    const int64_t words = (N + 31) / 32;
    std::fill(ancestors, ancestors + N * words, 0);
    for (int64_t n = 0; n < N; ++n) {
      int32_t* row = ancestors + n * words;
      const int64_t p = new_parents[n];
      if (p >= 0) std::copy(ancestors + p * words, ancestors + (p + 1) * words, row);
      row[n / 32] |= static_cast<int32_t>(1u << (n % 32));
    }
  }
  return status;
}

}  // namespace cpu
}  // namespace dartree
