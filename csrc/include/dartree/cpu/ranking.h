// The order every CPU draft-tree kernel ranks by, shared with dartree/reference.py and the CUDA
// kernels (dartree/block_topk.cuh):
//   ranks_before(a, i, b, j): a larger value first, NaN before every number, equal values (and NaN
//   against NaN) by the lower index -- the order of a stable descending sort.
// TopN keeps the best n of a stream in that order: a binary heap of n (value, index) pairs whose
// root ranks last, so an entry costs one comparison unless it enters (O(log n) when it does).
// Reads nothing but what it is fed; writes the caller's val[n] / idx[n] arrays. Assumes indices are
// fed in increasing order when ties must go to the lower index.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace dartree {
namespace cpu {

template <typename T>
inline bool ranks_before(T a, int64_t ia, T b, int64_t ib) {
  const bool nan_a = std::isnan(a), nan_b = std::isnan(b);
  if (nan_a != nan_b) return nan_a;
  if (!nan_a && a != b) return a > b;
  return ia < ib;
}

// The best `n` entries of a stream fed in increasing index order: a binary heap whose root is the
// entry ranked last, so a new entry costs one comparison unless it enters.
template <typename T>
struct TopN {
  T* val;
  int64_t* idx;
  int64_t n;
  int64_t size = 0;

  TopN(T* v, int64_t* i, int64_t count) : val(v), idx(i), n(count) {}

  bool full() const { return size == n; }

  void push(T v, int64_t i) {
    if (size < n) {
      int64_t pos = size++;
      while (pos > 0) {  // sift up: parents rank after children
        const int64_t up = (pos - 1) / 2;
        if (!ranks_before(val[up], idx[up], v, i)) break;
        val[pos] = val[up];
        idx[pos] = idx[up];
        pos = up;
      }
      val[pos] = v;
      idx[pos] = i;
      return;
    }
    if (!ranks_before(v, i, val[0], idx[0])) return;
    int64_t pos = 0;
    for (;;) {  // sift down from the root
      const int64_t left = 2 * pos + 1;
      if (left >= n) break;
      int64_t worst = left;
      if (left + 1 < n && ranks_before(val[left], idx[left], val[left + 1], idx[left + 1])) {
        worst = left + 1;
      }
      if (!ranks_before(v, i, val[worst], idx[worst])) break;
      val[pos] = val[worst];
      idx[pos] = idx[worst];
      pos = worst;
    }
    val[pos] = v;
    idx[pos] = i;
  }

  // Best first. `order` is scratch of n int64.
  void sorted(int64_t* order) const {
    for (int64_t j = 0; j < size; ++j) order[j] = j;
    std::sort(order, order + size, [&](int64_t x, int64_t y) {
      return ranks_before(val[x], idx[x], val[y], idx[y]);
    });
  }
};

}  // namespace cpu
}  // namespace dartree
