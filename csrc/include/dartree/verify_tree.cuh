// The verify walk of a draft tree, one tiny kernel instead of a host loop:
//
// in   parents, tokens, target_tokens [T] int64; optional first_child / next_sibling [T] int64
// out  accepted [T] int64 (the path from the root, then -1), num_accepted [] int64, bonus [] int64
// From the root, move to the lowest-index child whose token equals target_tokens[cur] while one
// exists; bonus = target_tokens[last accepted].
//
// Work split: one block of 256 threads. All threads check parents (parents[0] == -1,
// 0 <= parents[i] < i) and load them into shared memory; without given links, thread 0 builds
// first-child / next-sibling lists there in one O(T) sweep (children in index order); thread 0
// walks (every step moves to a higher index, so at most T steps; links are checked against
// parents as they are followed); all threads pad `accepted`.
// A malformed tree (bad parents, or links that disagree) gives num_accepted = 0, bonus = -1 and
// accepted all -1: the caller sees it without a host sync. Bytes: reads <= 5 T int64, writes T + 2.
// Assumes T <= kMaxVerifyNodes (4000): shared memory 3 * 4 * T bytes.
// launch_verify_tree (host) is the launch itself, through the caller's launcher (csrc/cuda/launcher.h).
#pragma once
#include <cstdint>

namespace dartree {

constexpr int kMaxVerifyNodes = 4000;
constexpr int kVerifyThreads = 256;

__global__ void __launch_bounds__(kVerifyThreads) verify_tree_kernel(int T, const int64_t* __restrict__ parents,
                                   const int64_t* __restrict__ tokens,
                                   const int64_t* __restrict__ target,
                                   const int64_t* __restrict__ first_child_in,
                                   const int64_t* __restrict__ next_sibling_in,
                                   int64_t* __restrict__ accepted, int64_t* __restrict__ num_accepted,
                                   int64_t* __restrict__ bonus) {
  extern __shared__ __align__(16) int verify_smem[];
  int* parent = verify_smem;
  int* first_child = parent + T;
  int* next_sibling = first_child + T;
  __shared__ int path_length;
  const int tid = threadIdx.x, threads = blockDim.x;
  bool bad = false;
  for (int i = tid; i < T; i += threads) {
    const int64_t p = parents[i];
    bad |= i == 0 ? p != -1 : (p < 0 || p >= i);
    parent[i] = static_cast<int>(p);
    if (first_child_in != nullptr) {
      const int64_t fc = first_child_in[i], ns = next_sibling_in[i];
      // a link is -1 or a later node; anything else is treated as a malformed tree
      bad |= (fc != -1 && (fc <= i || fc >= T)) || (ns != -1 && (ns <= i || ns >= T));
      first_child[i] = static_cast<int>(fc);
      next_sibling[i] = static_cast<int>(ns);
    } else {
      first_child[i] = -1;
      next_sibling[i] = -1;
    }
  }
  bad = __syncthreads_or(bad);
  if (tid == 0) {
    int length = 0;
    if (!bad) {
      if (first_child_in == nullptr) {
        for (int i = T - 1; i >= 1; --i) {
          next_sibling[i] = first_child[parent[i]];
          first_child[parent[i]] = i;
        }
      }
      int cur = 0;
      accepted[length++] = 0;
      for (;;) {
        const int64_t want = target[cur];
        int next = -1;
        for (int c = first_child[cur], prev = cur; c != -1; prev = c, c = next_sibling[c]) {
          if (c <= prev || parent[c] != cur) {  // links in range were checked above
            bad = true;
            break;
          }
          if (tokens[c] == want) {
            next = c;
            break;
          }
        }
        if (bad || next < 0) break;
        accepted[length++] = next;
        cur = next;
      }
      *bonus = bad ? -1 : target[cur];
    } else {
      *bonus = -1;
    }
    if (bad) length = 0;
    *num_accepted = length;
    path_length = length;
  }
  __syncthreads();
  for (int i = path_length + tid; i < T; i += threads) accepted[i] = -1;
}

template <typename Launcher>
void launch_verify_tree(Launcher& launcher, int T, const int64_t* parents, const int64_t* tokens,
                        const int64_t* target, const int64_t* first_child,
                        const int64_t* next_sibling, int64_t* accepted, int64_t* num_accepted,
                        int64_t* bonus) {
  launcher.launch(dim3(1), dim3(kVerifyThreads), 3 * sizeof(int) * static_cast<size_t>(T),
                  verify_tree_kernel, T, parents, tokens, target, first_child, next_sibling, accepted,
                  num_accepted, bonus);
}

}  // namespace dartree
