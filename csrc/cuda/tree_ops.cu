// CUDA launchers of the draft-tree ops (kernels in csrc/include/dartree/{candidate_topk,
// expand_level,prune_tree,verify_tree}.cuh). Arguments are checked on the host from shapes only;
// no launcher but the standalone expand_level (its GRU ids) reads device memory, so none of the
// others synchronises: index values are bounded inside the kernels, which report bad ones through
// status / num_accepted outputs. Scratch comes from the caching allocator on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <climits>
#include <type_traits>

#include "../tree_checks.h"
#include "dartree/candidate_topk.cuh"
#include "dartree/expand_level.cuh"
#include "dartree/prune_tree.cuh"
#include "dartree/verify_tree.cuh"

namespace dartree {

namespace {

template <typename T>
const T* opt_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

int blocks_for_warps(int64_t rows) {
  const int64_t warps = kWarpThreads / 32;
  return static_cast<int>((rows + warps - 1) / warps);
}

void check_int_range(int64_t value, const char* op, const char* what) {
  TORCH_CHECK_VALUE(value < INT_MAX, op, ": ", what, " = ", value, " is too large for the CUDA kernel");
}

template <typename T, typename F>
void with_table_type(at::ScalarType type, const void* data, const F& fn) {
  switch (type) {
    case at::kFloat: fn(static_cast<const float*>(data)); break;
    case at::kDouble: fn(static_cast<const double*>(data)); break;
    case at::kHalf: fn(static_cast<const __half*>(data)); break;
    default: fn(static_cast<const __nv_bfloat16*>(data)); break;
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------

template <typename In>
static void launch_candidate_topk(const at::Tensor& logits, at::Tensor& values, at::Tensor& ids,
                                  at::Tensor& lse, int count) {
  using Acc = typename AccOf<In>::type;
  const int64_t rows = logits.size(0);
  const size_t smem = static_cast<size_t>(count) * (sizeof(Acc) + sizeof(int64_t));
  candidate_topk_kernel<In><<<static_cast<unsigned>(rows), kSelectThreads, smem,
                              c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const In*>(logits.data_ptr()), logits.size(1), count,
      values.data_ptr<Acc>(), ids.data_ptr<int64_t>(), lse.numel() ? lse.data_ptr<Acc>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void candidate_topk_cuda(const at::Tensor& logits, at::Tensor values, at::Tensor ids, at::Tensor lse) {
  const int64_t count = check_candidate_topk(logits, values, ids, lse);
  TORCH_CHECK_VALUE(count <= kMaxSelect, "candidate_topk: the CUDA kernel selects at most ",
                    kMaxSelect, " candidates, got ", count);
  TORCH_CHECK_VALUE(logits.size(0) < INT_MAX, "candidate_topk: too many rows for the CUDA kernel");
  if (logits.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  const int c = static_cast<int>(count);
  switch (logits.scalar_type()) {
    case at::kFloat: launch_candidate_topk<float>(logits, values, ids, lse, c); break;
    case at::kDouble: launch_candidate_topk<double>(logits, values, ids, lse, c); break;
    case at::kHalf: launch_candidate_topk<__half>(logits, values, ids, lse, c); break;
    default: launch_candidate_topk<__nv_bfloat16>(logits, values, ids, lse, c); break;
  }
}

// ------------------------------------------------------------------------------------------------

static void check_level_limits(int64_t f, int64_t C, int64_t E, int64_t Q, int64_t r, int64_t G,
                               const char* op) {
  TORCH_CHECK_VALUE(Q <= kMaxSelect, op, ": the CUDA kernel selects at most ", kMaxSelect,
                    " nodes per level, got ", Q);
  check_int_range(f * E, op, "frontier x num_expand");
  check_int_range(f * C, op, "frontier x candidates");
  check_int_range(3 * G, op, "3 x GRU width");
  check_int_range(r, op, "rank");
}

// One level on the stream: mid (corrected), select, GRU (with a table).
template <typename T>
struct LevelLaunch {
  int f, C, E, Q, r, G;
  const T* states;  // [f, G] or null
  const T* z;       // [r] or null
  const T* w_s;
  int64_t ld_ws;
  T* mid;  // scratch [f, r]
  SelectArgs<T> select;
  const void* table;  // or null
  at::ScalarType table_type;
  int64_t ld_table, vocab;
  const T* w_hh;
  int64_t ld_hh;
  const T* b_hh;
  T* states_out;
  int32_t* status;

  // The GRU step's weights (a level that steps the GRU of its winners into states_out).
  void set_gru(const at::Tensor& input_table, const at::Tensor& hh, const std::optional<at::Tensor>& bias,
               int64_t vocab_size, T* out) {
    table = input_table.data_ptr();
    table_type = input_table.scalar_type();
    ld_table = input_table.stride(0);
    vocab = vocab_size;
    w_hh = hh.data_ptr<T>();
    ld_hh = hh.stride(0);
    b_hh = opt_ptr<T>(bias);
    states_out = out;
  }

  void run(cudaStream_t stream) {
    if (z != nullptr) {
      level_mid_kernel<T><<<blocks_for_warps(r), kWarpThreads, 0, stream>>>(f, r, G, states, z, w_s,
                                                                            ld_ws, mid);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    select.mid = z != nullptr ? mid : nullptr;
    const size_t smem = static_cast<size_t>(Q) * (sizeof(T) + sizeof(int64_t));
    level_select_kernel<T><<<1, kSelectThreads, smem, stream>>>(select);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (table == nullptr) return;
    with_table_type<T>(table_type, table, [&](auto* rows) {
      using TableT = std::remove_const_t<std::remove_pointer_t<decltype(rows)>>;
      level_gru_kernel<T, TableT><<<blocks_for_warps(G), kWarpThreads, 0, stream>>>(
          Q, G, states, select.parent_pos, select.tokens, rows, ld_table, vocab, w_hh, ld_hh, b_hh,
          states_out, status);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
};

void expand_level_cuda(const at::Tensor& parent_scores, const std::optional<at::Tensor>& parent_states,
                       const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& w_s,
                       const std::optional<at::Tensor>& cand_w2,
                       const std::optional<at::Tensor>& cand_b2, const at::Tensor& cand_base,
                       const at::Tensor& cand_ids, int64_t num_expand,
                       const std::optional<at::Tensor>& input_table,
                       const std::optional<at::Tensor>& w_hh, const std::optional<at::Tensor>& b_hh,
                       at::Tensor parent_pos, at::Tensor tokens, at::Tensor scores, at::Tensor states) {
  const LevelShape s = check_expand_level(parent_scores, parent_states, z, w_s, cand_w2, cand_b2,
                                          cand_base, cand_ids, num_expand, input_table, w_hh, b_hh,
                                          parent_pos, tokens, scores, states);
  check_level_limits(s.f, s.C, s.E, s.Q, s.r, s.G, "expand_level");
  const c10::cuda::CUDAGuard guard(parent_scores.device());
  if (s.gru) {
    // The ids the GRU may read are checked on the host as on the CPU (same error, instead of NaN
    // states): one sync, in this standalone op only. The engine's fused build_dartree reads none
    // and reports a bad id through its status flag.
    const at::Tensor ids = cand_ids.slice(0, 0, s.E).cpu();
    check_ids_in_vocab(ids.data_ptr<int64_t>(), s.E, s.vocab, "expand_level", "input_table");
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(parent_scores.scalar_type(), "expand_level_cuda", [&] {
    const auto opts = parent_scores.options();
    at::Tensor mid = at::empty({s.corrected ? s.f * s.r : 0}, opts);
    at::Tensor logits = at::empty({s.corrected ? s.f * s.C : 0}, opts);
    at::Tensor flat = at::empty({s.f * s.E}, opts);
    LevelLaunch<scalar_t> l{};
    l.f = s.f, l.C = s.C, l.E = s.E, l.Q = s.Q, l.r = s.r, l.G = s.G;
    l.states = (s.corrected || s.gru) ? parent_states->data_ptr<scalar_t>() : nullptr;
    if (s.corrected) {
      l.z = z->data_ptr<scalar_t>();
      l.w_s = w_s->data_ptr<scalar_t>();
      l.ld_ws = w_s->stride(0);
      l.mid = mid.data_ptr<scalar_t>();
    }
    SelectArgs<scalar_t>& a = l.select;
    a.f = l.f, a.C = l.C, a.E = l.E, a.Q = l.Q, a.r = l.r;
    a.parent_scores = parent_scores.data_ptr<scalar_t>();
    if (s.corrected) {
      a.w2 = cand_w2->data_ptr<scalar_t>();
      a.ld_w2 = cand_w2->stride(0);
      a.b2 = opt_ptr<scalar_t>(cand_b2);
    }
    a.base = cand_base.data_ptr<scalar_t>();
    a.ids = cand_ids.data_ptr<int64_t>();
    a.logits = s.corrected ? logits.data_ptr<scalar_t>() : nullptr;
    a.flat = flat.data_ptr<scalar_t>();
    a.parent_pos = parent_pos.data_ptr<int64_t>();
    a.tokens = tokens.data_ptr<int64_t>();
    a.scores = scores.data_ptr<scalar_t>();
    if (s.gru) l.set_gru(*input_table, *w_hh, b_hh, s.vocab, states.data_ptr<scalar_t>());
    l.run(stream);
  });
}

// ------------------------------------------------------------------------------------------------

template <typename T>
static void launch_prune(PruneArgs<T>& a, const at::TensorOptions& opts, cudaStream_t stream) {
  at::Tensor keys = at::empty({a.M}, opts);
  at::Tensor flags = at::empty({a.M}, opts.dtype(at::kInt));
  at::Tensor picked = at::empty({a.N}, opts.dtype(at::kLong));
  at::Tensor picked_keys = at::empty({a.N}, opts);
  a.keys = keys.data_ptr<T>();
  a.flags = flags.data_ptr<int32_t>();
  a.picked = picked.data_ptr<int64_t>();
  a.picked_keys = picked_keys.data_ptr<T>();
  const size_t smem = static_cast<size_t>(std::max(1, a.N - 1)) * (sizeof(T) + sizeof(int64_t));
  prune_tree_kernel<T><<<1, kSelectThreads, smem, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void prune_tree_cuda(const at::Tensor& parents, const at::Tensor& depths, const at::Tensor& scores,
                     double depth_bonus, at::Tensor kept, at::Tensor new_parents,
                     at::Tensor new_depths, at::Tensor ancestors, at::Tensor first_child,
                     at::Tensor next_sibling, at::Tensor status) {
  const auto [M, N] = check_prune_tree(parents, depths, scores, kept, new_parents, new_depths,
                                       ancestors, first_child, next_sibling, status);
  TORCH_CHECK_VALUE(N - 1 <= kMaxSelect, "prune_tree: the CUDA kernel keeps at most ", kMaxSelect,
                    " nodes besides the root, got ", N - 1);
  check_int_range(M, "prune_tree", "M");
  const c10::cuda::CUDAGuard guard(parents.device());
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "prune_tree_cuda", [&] {
    PruneArgs<scalar_t> a{};
    a.M = static_cast<int>(M), a.N = static_cast<int>(N);
    a.parents = parents.data_ptr<int64_t>();
    a.depths = depths.data_ptr<int64_t>();
    a.scores = scores.data_ptr<scalar_t>();
    a.bonus = static_cast<scalar_t>(depth_bonus);
    a.kept = kept.data_ptr<int64_t>();
    a.new_parents = new_parents.data_ptr<int64_t>();
    a.new_depths = new_depths.data_ptr<int64_t>();
    a.ancestors = ancestors.data_ptr<int32_t>();
    a.first_child = first_child.data_ptr<int64_t>();
    a.next_sibling = next_sibling.data_ptr<int64_t>();
    a.status = status.data_ptr<int32_t>();
    launch_prune<scalar_t>(a, scores.options(), c10::cuda::getCurrentCUDAStream());
  });
}

// ------------------------------------------------------------------------------------------------

void verify_tree_cuda(const at::Tensor& parents, const at::Tensor& tokens, const at::Tensor& target_tokens,
                      const std::optional<at::Tensor>& first_child,
                      const std::optional<at::Tensor>& next_sibling, at::Tensor accepted,
                      at::Tensor num_accepted, at::Tensor bonus) {
  const int64_t T = check_verify_tree(parents, tokens, target_tokens, first_child, next_sibling,
                                      accepted, num_accepted, bonus);
  TORCH_CHECK_VALUE(T <= kMaxVerifyNodes, "verify_tree: the CUDA kernel walks trees of at most ",
                    kMaxVerifyNodes, " nodes, got ", T);
  const c10::cuda::CUDAGuard guard(parents.device());
  const size_t smem = 3 * sizeof(int) * static_cast<size_t>(T);
  verify_tree_kernel<<<1, kVerifyThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<int>(T), parents.data_ptr<int64_t>(), tokens.data_ptr<int64_t>(),
      target_tokens.data_ptr<int64_t>(), first_child ? first_child->data_ptr<int64_t>() : nullptr,
      next_sibling ? next_sibling->data_ptr<int64_t>() : nullptr, accepted.data_ptr<int64_t>(),
      num_accepted.data_ptr<int64_t>(), bonus.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ------------------------------------------------------------------------------------------------

template <typename T>
static void launch_build(const BuildShape& s, const at::Tensor& cand_values, const at::Tensor& cand_ids,
                         const at::Tensor& root, const std::optional<at::Tensor>& root_state,
                         const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& w_s,
                         const std::optional<at::Tensor>& w_2,
                         const std::optional<at::Tensor>& b_2,
                         const std::optional<at::Tensor>& input_table,
                         const std::optional<at::Tensor>& w_hh, const std::optional<at::Tensor>& b_hh,
                         at::IntArrayRef plan, int64_t prefix_len, double depth_bonus,
                         at::Tensor& tokens, at::Tensor& parents, at::Tensor& depths,
                         at::Tensor& scores, at::Tensor& status) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto opts = cand_values.options();
  const auto long_opts = opts.dtype(at::kLong);
  const int64_t M = 1 + s.total, W = s.max_width, G = s.G;
  const bool prune = s.N < M;
  // the unpruned tree: straight into the outputs when nothing is pruned
  at::Tensor tok = prune ? at::empty({M}, long_opts) : tokens;
  at::Tensor par = prune ? at::empty({M}, long_opts) : parents;
  at::Tensor dep = prune ? at::empty({M}, long_opts) : depths;
  at::Tensor sc = prune ? at::empty({M}, opts) : scores;
  const bool tracked = s.corrected || s.gru;
  at::Tensor state_buffers = at::empty({tracked ? 2 * W * G : 0}, opts);
  at::Tensor mid = at::empty({s.corrected ? W * s.r : 0}, opts);
  at::Tensor logits = at::empty({s.corrected ? W * s.C : 0}, opts);
  at::Tensor flat = at::empty({W * s.E}, opts);
  at::Tensor parent_pos = at::empty({W}, long_opts);
  T* buffers = state_buffers.data_ptr<T>();
  status.zero_();  // kernels only raise it (an async fill: no sync)
  int32_t* status_p = status.data_ptr<int32_t>();
  at::Tensor table_root_state;
  const T* root_state_p = nullptr;
  if (s.root_from_table) {  // GRU(input_table[root], 0): one GRU launch from a zero state
    table_root_state = at::empty({G}, opts);
    at::Tensor zero_state = at::zeros({G}, opts);
    at::Tensor zero_pos = at::zeros({1}, long_opts);
    with_table_type<T>(input_table->scalar_type(), input_table->data_ptr(), [&](auto* rows) {
      using TableT = std::remove_const_t<std::remove_pointer_t<decltype(rows)>>;
      level_gru_kernel<T, TableT><<<blocks_for_warps(G), kWarpThreads, 0, stream>>>(
          1, static_cast<int>(G), zero_state.data_ptr<T>(), zero_pos.data_ptr<int64_t>(),
          root.data_ptr<int64_t>(), rows, input_table->stride(0), s.vocab, w_hh->data_ptr<T>(),
          w_hh->stride(0), opt_ptr<T>(b_hh), table_root_state.data_ptr<T>(), status_p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    root_state_p = table_root_state.data_ptr<T>();
  } else if (tracked) {
    root_state_p = root_state->data_ptr<T>();
  }
  int64_t* tok_p = tok.data_ptr<int64_t>();
  int64_t* par_p = par.data_ptr<int64_t>();
  int64_t* dep_p = dep.data_ptr<int64_t>();
  T* sc_p = sc.data_ptr<T>();
  int64_t start = 0, width = 1, placed = 1;
  for (int64_t d = 0; d < s.L; ++d) {
    LevelLaunch<T> l{};
    l.f = static_cast<int>(width), l.C = static_cast<int>(s.C), l.E = static_cast<int>(s.E);
    l.Q = static_cast<int>(plan[d]), l.r = static_cast<int>(s.r), l.G = static_cast<int>(G);
    l.states = !tracked ? nullptr : d == 0 ? root_state_p : buffers + ((d - 1) % 2) * W * G;
    const bool corrected = s.corrected && d >= prefix_len;
    if (corrected) {
      l.z = z->data_ptr<T>() + d * s.r;
      l.w_s = w_s->data_ptr<T>();
      l.ld_ws = w_s->stride(0);
      l.mid = mid.data_ptr<T>();
    }
    SelectArgs<T>& a = l.select;
    a.f = l.f, a.C = l.C, a.E = l.E, a.Q = l.Q, a.r = l.r;
    a.parent_scores = sc_p + start;
    if (corrected) {
      if (s.w2_table) {  // rows read by candidate id, straight from the head's W_2
        a.w2 = w_2->data_ptr<T>();
        a.ld_w2 = w_2->stride(0);
        a.b2 = opt_ptr<T>(b_2);
        a.w2_ids = cand_ids.data_ptr<int64_t>() + d * s.C;
        a.w2_rows = s.w2_rows;
      } else {
        a.w2 = w_2->data_ptr<T>() + d * s.C * s.r;
        a.ld_w2 = s.r;
        a.b2 = b_2.has_value() ? b_2->data_ptr<T>() + d * s.C : nullptr;
      }
      a.logits = logits.data_ptr<T>();
    }
    a.base = cand_values.data_ptr<T>() + d * s.C;
    a.ids = cand_ids.data_ptr<int64_t>() + d * s.C;
    a.flat = flat.data_ptr<T>();
    a.parent_pos = parent_pos.data_ptr<int64_t>();
    a.tokens = tok_p + placed;
    a.scores = sc_p + placed;
    a.tree_parents = par_p + placed;
    a.tree_depths = dep_p + placed;
    a.parent_offset = start;
    a.depth = d + 1;
    a.status = status_p;
    if (d == 0) {
      a.root = root.data_ptr<int64_t>();
      a.root_row_token = tok_p, a.root_row_parent = par_p, a.root_row_depth = dep_p;
      a.root_row_score = sc_p;
    }
    if (s.gru && d + 1 < s.L) {
      l.set_gru(*input_table, *w_hh, b_hh, s.vocab, buffers + (d % 2) * W * G);
      l.status = status_p;
    }
    l.run(stream);
    start = placed;
    placed += plan[d];
    width = plan[d];
  }
  if (!prune) return;
  PruneArgs<T> p{};
  p.M = static_cast<int>(M), p.N = static_cast<int>(s.N);
  p.parents = par_p, p.depths = dep_p, p.scores = sc_p;
  p.bonus = static_cast<T>(depth_bonus);
  at::Tensor kept = at::empty({s.N}, long_opts);
  p.kept = kept.data_ptr<int64_t>();
  p.new_parents = parents.data_ptr<int64_t>();
  p.new_depths = depths.data_ptr<int64_t>();
  p.status = status_p;
  p.raise_status = true;
  p.tokens = tok_p;
  p.tokens_out = tokens.data_ptr<int64_t>();
  p.scores_out = scores.data_ptr<T>();
  launch_prune<T>(p, opts, stream);
}

void build_dartree_cuda(const at::Tensor& cand_values, const at::Tensor& cand_ids, const at::Tensor& root,
                        const std::optional<at::Tensor>& root_state, const std::optional<at::Tensor>& z,
                        const std::optional<at::Tensor>& w_s, const std::optional<at::Tensor>& w_2,
                        const std::optional<at::Tensor>& b_2,
                        const std::optional<at::Tensor>& input_table,
                        const std::optional<at::Tensor>& w_hh, const std::optional<at::Tensor>& b_hh,
                        int64_t num_expand, at::IntArrayRef plan, int64_t prefix_len,
                        double depth_bonus, at::Tensor tokens, at::Tensor parents, at::Tensor depths,
                        at::Tensor scores, at::Tensor status) {
  const BuildShape s = check_build_dartree(cand_values, cand_ids, root, root_state, z, w_s, w_2,
                                           b_2, input_table, w_hh, b_hh, num_expand, plan,
                                           prefix_len, tokens, parents, depths, scores, status);
  check_level_limits(s.max_width, s.C, s.E, s.max_width, s.r, s.G, "build_dartree");
  check_int_range(1 + s.total, "build_dartree", "tree size");
  TORCH_CHECK_VALUE(s.N - 1 <= kMaxSelect, "build_dartree: the CUDA kernel keeps at most ", kMaxSelect,
                    " nodes besides the root, got ", s.N - 1);
  const c10::cuda::CUDAGuard guard(cand_values.device());
  AT_DISPATCH_FLOATING_TYPES(cand_values.scalar_type(), "build_dartree_cuda", [&] {
    launch_build<scalar_t>(s, cand_values, cand_ids, root, root_state, z, w_s, w_2, b_2,
                           input_table, w_hh, b_hh, plan, prefix_len, depth_bonus, tokens, parents,
                           depths, scores, status);
  });
}

TORCH_LIBRARY_IMPL(dartree, CUDA, m) {
  m.impl("candidate_topk", &candidate_topk_cuda);
  m.impl("expand_level", &expand_level_cuda);
  m.impl("prune_tree", &prune_tree_cuda);
  m.impl("verify_tree", &verify_tree_cuda);
  m.impl("build_dartree", &build_dartree_cuda);
}

}  // namespace dartree
