// Pruning + verify layout of a draft tree, in one block (no host sync anywhere):
//
// in   parents [M] int64 (parents[0] == -1, 0 <= parents[i] < i), depths [M] int64, scores [M] T
// out  kept [N] (ascending), new_parents [N], new_depths [N], first_child / next_sibling [N]
//      (-1 = none; children in index order), ancestors int32 [N, ceil(N / 32)] (bit j of row i:
//      j is i or an ancestor of i), status int32 [1]; optionally tokens_out[n] = tokens[kept[n]]
//      and scores_out[n] = scores[kept[n]] (the whole build's final gather).
// status: 0 ok; 1 a kept node's parent was pruned (its new_parents entry is -1); 2 parents are
// not a tree (then kept = 0..N-1, new_parents = -1 and nothing is read out of bounds). The
// launcher never reads it: the CUDA prefix-closure check is this flag, read by the caller only
// if it wants to (ops.prune_tree_layout(check=True)).
//
// Work split: keys[i] = scores[i] + bonus * depth[i] (product rounded first, as the reference)
// into scratch, block_topk picks the N - 1 best non-root nodes, an ordered block scan over the M
// flags gives kept and the old -> new remap; sibling links by an O(N) scan per node; each thread
// builds the ancestor rows of its nodes by walking up (<= depth steps).
// Bytes: reads M * (16 + sizeof(T)), writes N * (40 + 4 * ceil(N / 32)); scratch keys [M] T,
// flags [M] int32, picked [N] int64, picked_keys [N] T.
// Assumes N - 1 <= kMaxSelect (1024), M < 2^31, blockDim a multiple of 32 (1024 used).
// launch_prune_tree (host) allocates that scratch and launches, through the caller's launcher
// (csrc/cuda/launcher.h).
#pragma once
#include "block_topk.cuh"

namespace dartree {

__device__ __forceinline__ float key_product(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double key_product(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float key_sum(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double key_sum(double a, double b) { return __dadd_rn(a, b); }

template <typename T>
struct PruneArgs {
  int M, N;
  const int64_t* parents;
  const int64_t* depths;
  const T* scores;
  T bonus;
  int64_t* kept;
  int64_t* new_parents;
  int64_t* new_depths;      // or null
  int32_t* ancestors;       // or null
  int64_t* first_child;     // or null (with next_sibling)
  int64_t* next_sibling;
  int32_t* status;
  bool raise_status;        // only raise status to 1 (a whole build: earlier kernels may set 2)
  const int64_t* tokens;    // or null: no gather
  int64_t* tokens_out;
  T* scores_out;
  T* keys;         // scratch [M]
  int32_t* flags;  // scratch [M]: 1 kept, then the new index
  int64_t* picked;  // scratch [N]
  T* picked_keys;   // scratch [N]
};

template <typename T>
__global__ void __launch_bounds__(kSelectThreads) prune_tree_kernel(PruneArgs<T> a) {
  __shared__ TopkShared<T> sh;
  __shared__ unsigned int warp_counts[32];
  __shared__ int running;
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  const int tid = threadIdx.x, threads = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const int warps = threads >> 5;
  const int M = a.M, N = a.N, K = N - 1;
  // 0. a tree? (the only check that reads values; everything below relies on it)
  bool bad = false;
  for (int i = tid; i < M; i += threads) {
    const int64_t p = a.parents[i];
    bad |= i == 0 ? p != -1 : (p < 0 || p >= i);
  }
  if (__syncthreads_or(bad)) {
    for (int n = tid; n < N; n += threads) {
      a.kept[n] = n;
      a.new_parents[n] = -1;
      if (a.new_depths != nullptr) a.new_depths[n] = 0;
      if (a.first_child != nullptr) a.first_child[n] = a.next_sibling[n] = -1;
      if (a.tokens != nullptr) {
        a.tokens_out[n] = a.tokens[n];
        a.scores_out[n] = a.scores[n];
      }
    }
    if (a.ancestors != nullptr) {
      const int words = (N + 31) / 32;
      for (int w = tid; w < N * words; w += threads) a.ancestors[w] = 0;
    }
    if (tid == 0) {
      if (a.raise_status) {
        atomicMax(a.status, 2);
      } else {
        *a.status = 2;
      }
    }
    return;
  }
  // 1. keys of the non-root nodes, and the K best of them
  for (int i = tid; i < M; i += threads) {
    a.flags[i] = i == 0 ? 1 : 0;
    if (i > 0) {
      a.keys[i - 1] = key_sum(a.scores[i], key_product(a.bonus, static_cast<T>(a.depths[i])));
    }
  }
  __syncthreads();
  if (K > 0) {
    int64_t* sel_idx = reinterpret_cast<int64_t*>(dynamic_smem);
    T* sel_val = reinterpret_cast<T*>(sel_idx + K);
    block_topk<T>(a.keys, M - 1, K, a.picked_keys, a.picked, sh, sel_val, sel_idx);
    for (int n = tid; n < K; n += threads) a.flags[a.picked[n] + 1] = 1;
  }
  __syncthreads();
  // 2. ordered compaction of the flags: kept ascending, flags[old] = new index
  if (tid == 0) running = 0;
  __syncthreads();
  for (int base = 0; base < M; base += threads) {
    const int i = base + tid;
    const bool keep = i < M && a.flags[i] == 1;
    const unsigned ballot = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < warps; ++w) {
      before += w < warp ? static_cast<int>(warp_counts[w]) : 0;
      total += warp_counts[w];
    }
    const int slot = running + before + __popc(ballot & ((1u << lane) - 1u));
    if (keep) {
      a.kept[slot] = i;
      a.flags[i] = slot + 2;  // 2 + new index: never confused with the 0/1 flags still unread
    }
    __syncthreads();
    if (tid == 0) running += total;
  }
  __syncthreads();
  // 3. parents, depths, gather
  bool orphan = false;
  for (int n = tid; n < N; n += threads) {
    const int64_t old = a.kept[n];
    int64_t parent = -1;
    if (n > 0) {
      const int flag = a.flags[a.parents[old]];
      parent = flag >= 2 ? flag - 2 : -1;
      orphan |= parent < 0;
    }
    a.new_parents[n] = parent;
    if (a.new_depths != nullptr) a.new_depths[n] = a.depths[old];
    if (a.tokens != nullptr) {
      a.tokens_out[n] = a.tokens[old];
      a.scores_out[n] = a.scores[old];
    }
  }
  orphan = __syncthreads_or(orphan);
  if (tid == 0) {
    if (a.raise_status) {
      if (orphan) atomicMax(a.status, 1);
    } else {
      *a.status = orphan ? 1 : 0;
    }
  }
  // 4. sibling links: next_sibling[n] = next m > n with the same parent; first_child[p] = the
  //    first such n
  if (a.first_child != nullptr) {
    for (int n = tid; n < N; n += threads) a.first_child[n] = -1;
    __syncthreads();
    for (int n = tid; n < N; n += threads) {
      const int64_t parent = a.new_parents[n];
      int64_t next = -1;
      if (n > 0 && parent >= 0) {
        for (int m = n + 1; m < N; ++m) {
          if (a.new_parents[m] == parent) {
            next = m;
            break;
          }
        }
        bool first = true;
        for (int64_t m = parent + 1; m < n && first; ++m) first = a.new_parents[m] != parent;
        if (first) a.first_child[parent] = n;
      }
      a.next_sibling[n] = next;
    }
  }
  // 5. ancestor rows: walk up from each node (parents come first, so at most n steps)
  if (a.ancestors != nullptr) {
    const int words = (N + 31) / 32;
    for (int n = tid; n < N; n += threads) {
      int32_t* row = a.ancestors + static_cast<int64_t>(n) * words;
      for (int w = 0; w < words; ++w) row[w] = 0;
      int64_t node = n;
      for (int steps = 0; node >= 0 && steps <= n; ++steps) {
        row[node >> 5] |= static_cast<int32_t>(1u << (node & 31));
        node = a.new_parents[node];
      }
    }
  }
}

template <typename T, typename Launcher>
void launch_prune_tree(Launcher& launcher, PruneArgs<T> a) {
  a.keys = launcher.template scratch<T>(a.M, "keys");
  a.flags = launcher.template scratch<int32_t>(a.M, "flags");
  a.picked = launcher.template scratch<int64_t>(a.N, "picked");
  a.picked_keys = launcher.template scratch<T>(a.N, "picked_keys");
  const size_t smem = static_cast<size_t>(a.N > 1 ? a.N - 1 : 1) * (sizeof(T) + sizeof(int64_t));
  launcher.launch(dim3(1), dim3(kSelectThreads), smem, prune_tree_kernel<T>, a);
}

}  // namespace dartree
