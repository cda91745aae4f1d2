// One DARTree level as three kernels (the launcher runs them back to back on one stream; the
// whole build runs them for every level with no host sync, the plan being known on the host):
//
//  level_mid_kernel     mid [f, r] = SiLU(z + W_s g_p) for the f frontier states g [f, G].
//                       A warp per row t of W_s (lanes stride over G), looping over the f parents:
//                       W_s is read once from memory (r * G * sizeof(T)), g from L1/L2.
//  level_select_kernel  one block: logits [f, C] = base + (W_2[cand] mid_p + b2) (a warp per
//                       candidate, lanes over r; the W_2 rows are read straight from the head's
//                       table by candidate id in a whole build), a warp per parent for the
//                       log-softmax over the C
//                       candidates, flat scores S[p * E + j] = score_p + (logit - lse_p), then the
//                       best Q of the f * E pairs (block_topk: value descending, ties to the lower
//                       flat index) -> parent_pos, tokens = cand_ids[j], scores. In a whole build it
//                       also writes the tree rows (parents = offset + parent_pos, depths).
//  level_gru_kernel     g' [Q, G] = GRUCell(input_table[token_q], g_parent(q)) (PyTorch r, z, n):
//                       a warp per hidden unit j (blocks over G), the three rows j, G + j, 2G + j of
//                       W_hh read once and dotted with the Q parent states; input_table rows are
//                       gathered in their own dtype (float, double, half, bfloat16).
// Scratch (global, from the caller): logits [f * C], flat [f * E] of T.
// Bytes per level: W_s (r G) + W_2 rows (C r) + W_hh (3 G G) + table rows (3 G Q) read once;
// states f G read ~r/8 + 3 G/8 times from cache.
// Assumes: Q <= kMaxSelect (1024) and f * E < 2^31; blockDim a multiple of 32; indices in
// parent_pos < f (written by the select kernel); token ids outside [0, V) give NaN states and
// status 2 instead of an out-of-bounds read.
// Host side: launch_level runs the three kernels of one level (dartree/level_args.h) with the
// caller's scratch, through the caller's launcher (csrc/cuda/launcher.h); launch_expand_level
// allocates that scratch (the standalone op; the whole build: dartree/build_dartree.cuh).
#pragma once
#include <type_traits>

#include "block_topk.cuh"
#include "level_args.h"

namespace dartree {

constexpr int kWarpThreads = 256;  // mid and GRU kernels: 8 warps, a row / unit per warp

template <typename T>
__device__ __forceinline__ T silu(T v) {
  return v / (T(1) + exp(-v));
}

template <typename T>
__device__ __forceinline__ T sigmoid(T v) {
  return T(1) / (T(1) + exp(-v));
}

template <typename T>
__global__ void __launch_bounds__(kWarpThreads)
    level_mid_kernel(int f, int r, int G, const T* __restrict__ states, const T* __restrict__ z,
                     const T* __restrict__ w_s, int64_t ld_ws, T* __restrict__ mid) {
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= r) return;  // whole warps leave together
  const T* row = w_s + t * ld_ws;
  for (int p = 0; p < f; ++p) {
    const T* g = states + static_cast<int64_t>(p) * G;
    T acc = 0;
    for (int k = lane; k < G; k += 32) acc += row[k] * g[k];
    acc = warp_sum(acc);
    if (lane == 0) mid[static_cast<int64_t>(p) * r + t] = silu(z[t] + acc);
  }
}

template <typename T>
struct SelectArgs {
  int f, C, E, Q, r;
  const T* parent_scores;  // [f]
  const T* mid;            // [f, r] or null: an uncorrected level
  const T* w2;             // [C, r] rows ld_w2 apart, or the [w2_rows, r] table when w2_ids is set
  int64_t ld_w2;
  const T* b2;    // [C] (or [w2_rows] with w2_ids) or null
  const int64_t* w2_ids;  // null, or row j of the candidates is w2 row w2_ids[j] (= cand_ids)
  int64_t w2_rows;
  const T* base;  // [C]
  const int64_t* ids;  // [C]
  T* logits;           // scratch [f, C]
  T* flat;             // scratch [f, E]
  int64_t* parent_pos;  // [Q]
  int64_t* tokens;      // [Q]
  T* scores;            // [Q]
  // whole build only (null otherwise): tree rows of the new nodes and of the root
  int64_t* tree_parents;  // [Q]: parent_offset + parent_pos
  int64_t* tree_depths;   // [Q]: depth
  int64_t parent_offset, depth;
  const int64_t* root;  // [1]: when set, row 0 of the tree is written
  int64_t* root_row_token;
  int64_t* root_row_parent;
  int64_t* root_row_depth;
  T* root_row_score;
  int32_t* status;  // or null: raised to 2 by a candidate id outside W_2
};

template <typename T>
__global__ void __launch_bounds__(kSelectThreads) level_select_kernel(SelectArgs<T> a) {
  __shared__ TopkShared<T> sh;
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  int64_t* sel_idx = reinterpret_cast<int64_t*>(dynamic_smem);
  T* sel_val = reinterpret_cast<T*>(sel_idx + a.Q);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (a.root != nullptr) {
    if (threadIdx.x == 0) {
      *a.root_row_token = *a.root;
      *a.root_row_parent = -1;
      *a.root_row_depth = 0;
      *a.root_row_score = T(0);
    }
    __syncthreads();  // parent_scores[0] is that root score (read in step 2)
  }
  // 1. corrected logits [f, C]; an uncorrected level uses the base row for every parent
  const T* logits = a.base;
  int64_t row_stride = 0;
  if (a.mid != nullptr) {
    for (int j = warp; j < a.C; j += warps) {
      int64_t row = j;
      if (a.w2_ids != nullptr) {
        row = a.w2_ids[j];
        if (row < 0 || row >= a.w2_rows) {  // a bad id: NaN logits, status 2, no stray read
          for (int p = lane; p < a.f; p += 32) a.logits[static_cast<int64_t>(p) * a.C + j] = NAN;
          if (lane == 0 && a.status != nullptr) atomicExch(a.status, 2);
          continue;
        }
      }
      const T* w = a.w2 + row * a.ld_w2;
      for (int p = 0; p < a.f; ++p) {
        const T* m = a.mid + static_cast<int64_t>(p) * a.r;
        T acc = 0;
        for (int t = lane; t < a.r; t += 32) acc += w[t] * m[t];
        acc = warp_sum(acc);
        if (lane == 0) {
          const T delta = a.b2 != nullptr ? acc + a.b2[row] : acc;
          a.logits[static_cast<int64_t>(p) * a.C + j] = a.base[j] + delta;
        }
      }
    }
    __syncthreads();
    logits = a.logits;
    row_stride = a.C;
  }
  // 2. log-softmax over the C candidates, plus the parent's score, for the first E
  for (int p = warp; p < a.f; p += warps) {
    const T* row = logits + p * row_stride;
    T m = -INFINITY;
    bool nan = false;
    for (int j = lane; j < a.C; j += 32) {
      const T v = row[j];
      nan |= v != v;
      m = v > m ? v : m;
    }
    for (int offset = 16; offset > 0; offset >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, offset));
    nan = __any_sync(0xffffffffu, nan);
    T lse;
    if (nan) {
      lse = NAN;
    } else if (isinf(m)) {
      lse = m;
    } else {
      T sum = 0;
      for (int j = lane; j < a.C; j += 32) sum += exp(row[j] - m);
      lse = m + log(warp_sum(sum));
    }
    const T score = a.parent_scores[p];
    for (int j = lane; j < a.E; j += 32) a.flat[static_cast<int64_t>(p) * a.E + j] = score + (row[j] - lse);
  }
  __syncthreads();
  // 3. the best Q pairs; out_idx holds the flat index until step 4 splits it
  block_topk<T>(a.flat, static_cast<int64_t>(a.f) * a.E, a.Q, a.scores, a.parent_pos, sh, sel_val,
                sel_idx);
  for (int q = threadIdx.x; q < a.Q; q += blockDim.x) {
    const int64_t flat = a.parent_pos[q];
    const int64_t p = flat / a.E;
    a.parent_pos[q] = p;
    a.tokens[q] = a.ids[flat % a.E];
    if (a.tree_parents != nullptr) {
      a.tree_parents[q] = a.parent_offset + p;
      a.tree_depths[q] = a.depth;
    }
  }
}

template <typename T, typename TableT>
__global__ void __launch_bounds__(kWarpThreads) level_gru_kernel(int Q, int G, const T* __restrict__ states,
                                 const int64_t* __restrict__ parent_pos,
                                 const int64_t* __restrict__ tokens, const TableT* __restrict__ table,
                                 int64_t ld_table, int64_t vocab, const T* __restrict__ w_hh,
                                 int64_t ld_hh, const T* __restrict__ b_hh, T* __restrict__ states_out,
                                 int32_t* status) {
  const int lane = threadIdx.x & 31;
  const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (j >= G) return;
  const T* w_r = w_hh + static_cast<int64_t>(j) * ld_hh;
  const T* w_z = w_hh + static_cast<int64_t>(G + j) * ld_hh;
  const T* w_n = w_hh + static_cast<int64_t>(2 * G + j) * ld_hh;
  for (int q = 0; q < Q; ++q) {
    const T* g = states + parent_pos[q] * G;
    T h_r = 0, h_z = 0, h_n = 0;
    for (int k = lane; k < G; k += 32) {
      const T gk = g[k];
      h_r += w_r[k] * gk;
      h_z += w_z[k] * gk;
      h_n += w_n[k] * gk;
    }
    h_r = warp_sum(h_r);
    h_z = warp_sum(h_z);
    h_n = warp_sum(h_n);
    if (lane != 0) continue;
    if (b_hh != nullptr) {
      h_r += b_hh[j];
      h_z += b_hh[G + j];
      h_n += b_hh[2 * G + j];
    }
    const int64_t token = tokens[q];
    T out;
    if (token < 0 || token >= vocab) {
      out = NAN;
      if (status != nullptr) atomicExch(status, 2);
    } else {
      const TableT* gi = table + token * ld_table;
      const T reset = sigmoid(static_cast<T>(load_acc(gi + j)) + h_r);
      const T update = sigmoid(static_cast<T>(load_acc(gi + G + j)) + h_z);
      const T fresh = tanh(static_cast<T>(load_acc(gi + 2 * G + j)) + reset * h_n);
      out = (T(1) - update) * fresh + update * g[j];
    }
    states_out[static_cast<int64_t>(q) * G + j] = out;
  }
}

// ---- host side

inline int blocks_for_warps(int64_t rows) {
  const int64_t warps = kWarpThreads / 32;
  return static_cast<int>((rows + warps - 1) / warps);
}

// fn(rows) with the GRU input table as a typed pointer.
template <typename F>
void with_table(TableKind kind, const void* table, const F& fn) {
  switch (kind) {
    case TableKind::kFloat: fn(static_cast<const float*>(table)); break;
    case TableKind::kDouble: fn(static_cast<const double*>(table)); break;
    case TableKind::kHalf: fn(static_cast<const __half*>(table)); break;
    default: fn(static_cast<const __nv_bfloat16*>(table)); break;
  }
}

// Scratch of one level: mid [f, r] and logits [f, C] (corrected levels), flat [f, E].
template <typename T>
struct LevelBuffers {
  T* mid;
  T* logits;
  T* flat;
};

// The select kernel's arguments for level `a`; a whole build adds its tree rows (SelectArgs).
template <typename T>
SelectArgs<T> select_args(const LevelArgs<T>& a, const LevelBuffers<T>& buffers) {
  SelectArgs<T> s{};
  s.f = static_cast<int>(a.f), s.C = static_cast<int>(a.C), s.E = static_cast<int>(a.E);
  s.Q = static_cast<int>(a.Q), s.r = static_cast<int>(a.r);
  s.parent_scores = a.parent_scores;
  s.mid = a.z != nullptr ? buffers.mid : nullptr;
  s.w2 = a.w2;
  s.ld_w2 = a.ld_w2;
  s.b2 = a.b2;
  s.w2_ids = a.w2_ids;
  s.w2_rows = a.w2_rows;
  s.base = a.base;
  s.ids = a.ids;
  s.logits = a.z != nullptr ? buffers.logits : nullptr;
  s.flat = buffers.flat;
  s.parent_pos = a.parent_pos;
  s.tokens = a.tokens;
  s.scores = a.scores;
  return s;
}

// mid (a corrected level), select, GRU (with a table) on the launcher's stream. status (or null)
// is raised to 2 by a token id outside the table.
template <typename T, typename Launcher>
void launch_level(Launcher& launcher, const LevelArgs<T>& a, const SelectArgs<T>& select,
                  const LevelBuffers<T>& buffers, int32_t* status) {
  const int f = static_cast<int>(a.f), r = static_cast<int>(a.r), G = static_cast<int>(a.G);
  if (a.z != nullptr) {
    launcher.launch(dim3(blocks_for_warps(r)), dim3(kWarpThreads), 0, level_mid_kernel<T>, f, r, G,
                    a.states, a.z, a.w_s, a.ld_ws, buffers.mid);
  }
  const size_t smem = static_cast<size_t>(a.Q) * (sizeof(T) + sizeof(int64_t));
  launcher.launch(dim3(1), dim3(kSelectThreads), smem, level_select_kernel<T>, select);
  if (a.table == nullptr) return;
  with_table(a.table_kind, a.table, [&](auto* rows) {
    using TableT = std::remove_const_t<std::remove_pointer_t<decltype(rows)>>;
    launcher.launch(dim3(blocks_for_warps(G)), dim3(kWarpThreads), 0, level_gru_kernel<T, TableT>,
                    static_cast<int>(a.Q), G, a.states, static_cast<const int64_t*>(a.parent_pos),
                    static_cast<const int64_t*>(a.tokens), rows, a.ld_table, a.vocab, a.w_hh, a.ld_hh,
                    a.b_hh, a.states_out, status);
  });
}

// The standalone op: scratch from the launcher, then one level.
template <typename T, typename Launcher>
void launch_expand_level(Launcher& launcher, const LevelArgs<T>& a) {
  const bool corrected = a.z != nullptr;
  const LevelBuffers<T> buffers{launcher.template scratch<T>(corrected ? a.f * a.r : 0, "mid"),
                                launcher.template scratch<T>(corrected ? a.f * a.C : 0, "logits"),
                                launcher.template scratch<T>(a.f * a.E, "flat")};
  launch_level(launcher, a, select_args(a, buffers), buffers, static_cast<int32_t*>(nullptr));
}

}  // namespace dartree
