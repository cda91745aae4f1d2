// CPU verify walk of a draft tree (the CUDA twin: dartree/verify_tree.cuh).
//
// in   parents, tokens, target [T] int64; optional first_child / next_sibling [T] (null: built
//      from parents into the caller's scratch of 2T)
// out  accepted [T] (the path from the root, then -1), *count, *bonus = target[last accepted]
// From the root, move to the lowest-index child whose token equals target[cur] while one exists.
// Work: one thread, O(T) to check parents and build links, then at most T steps (links only move
// to higher indices, so a malformed link list cannot loop).
// Returns 0; 1 for parents that are not a tree; 2 for links that disagree with parents.
#pragma once
#include <cstdint>
#include <vector>

namespace dartree {
namespace cpu {

// From the root, move to the lowest-index child whose token equals target[cur] while one exists.
// Links (first_child/next_sibling) are built from parents when null. Writes accepted[0, a) and -1
// after, *count = a, *bonus = target[last]. Returns 0, or 1 for parents that are not a tree
// (parents[0] != -1 or parents[i] outside [0, i)), 2 for links that disagree with parents.
inline int verify_tree(int64_t T, const int64_t* parents, const int64_t* tokens,
                       const int64_t* target, const int64_t* first_child,
                       const int64_t* next_sibling, int64_t* accepted, int64_t* count,
                       int64_t* bonus, std::vector<int64_t>& scratch) {
  if (parents[0] != -1) return 1;
  for (int64_t i = 1; i < T; ++i) {
    if (parents[i] < 0 || parents[i] >= i) return 1;
  }
  if (first_child != nullptr) {  // links are -1 or a later node (as the CUDA kernel checks)
    for (int64_t i = 0; i < T; ++i) {
      const int64_t fc = first_child[i], ns = next_sibling[i];
      if ((fc != -1 && (fc <= i || fc >= T)) || (ns != -1 && (ns <= i || ns >= T))) return 2;
    }
  } else {
    scratch.assign(2 * T, -1);
    int64_t* fc = scratch.data();
    int64_t* ns = fc + T;
    for (int64_t i = T - 1; i >= 1; --i) {
      ns[i] = fc[parents[i]];
      fc[parents[i]] = i;
    }
    first_child = fc;
    next_sibling = ns;
  }
  int64_t a = 0, cur = 0;
  accepted[a++] = 0;
  for (;;) {
    const int64_t want = target[cur];
    int64_t next = -1;
    // links only move to higher indices, so the walk ends after at most T steps
    for (int64_t c = first_child[cur], prev = cur; c != -1; prev = c, c = next_sibling[c]) {
      if (c <= prev || c >= T || parents[c] != cur) return 2;
      if (tokens[c] == want) {
        next = c;
        break;
      }
    }
    if (next < 0) break;
    accepted[a++] = next;
    cur = next;
  }
  for (int64_t i = a; i < T; ++i) accepted[i] = -1;
  *count = a;
  *bonus = target[cur];
  return 0;
}

}  // namespace cpu
}  // namespace dartree
