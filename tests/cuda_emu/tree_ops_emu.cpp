// Runs the CUDA draft-tree kernels (csrc/include/dartree/{candidate_topk,expand_level,prune_tree,
// verify_tree}.cuh), unchanged, under the host emulator with its race detector, launched exactly
// as csrc/cuda/tree_ops.cu launches them (same grids, block sizes, shared memory, scratch).
// Driven by tests/test_cuda_emulator.py:  tree_ops_emu <request> <response>  (tensor_io.h).
// Ops: candidate_topk, expand_level, prune_tree, verify_tree, build_dartree, with the tensors of
// the torch op under the schema's argument names (optional ones absent); scalars as 0-d tensors.
#include "tensor_io.h"

namespace dartree {
// The kernels' `extern __shared__` arrays (cuda_emulation.h: __shared__ is thread_local), defined
// before the kernels so that they need no TLS init call. verify: 3 ints per node, 4000 nodes.
alignas(16) thread_local unsigned char dynamic_smem[64 * 1024];
alignas(16) thread_local int verify_smem[3 * 4000];
}  // namespace dartree

#include "dartree/candidate_topk.cuh"
#include "dartree/expand_level.cuh"
#include "dartree/prune_tree.cuh"
#include "dartree/verify_tree.cuh"

#include <algorithm>
#include <type_traits>

namespace {

using emu::Request;
using emu::Scratch;
using emu::Tensor;
using namespace dartree;

constexpr int kSelectThreads = 1024;  // as tree_ops.cu
constexpr int kWarpThreads = 256;

void use_dynamic_smem() { emu::set_dynamic_shared(dynamic_smem, sizeof(dynamic_smem)); }

int blocks_for_warps(int64_t rows) {
  const int64_t warps = kWarpThreads / 32;
  return static_cast<int>((rows + warps - 1) / warps);
}

[[noreturn]] void unsupported(const std::string& what) {
  std::fprintf(stderr, "driver: unsupported %s\n", what.c_str());
  std::exit(2);
}

// The GRU input table in its own dtype.
template <typename F>
void with_table(const Tensor& table, const F& fn) {
  if (table.dtype == "float32") fn(table.ptr<float>());
  else if (table.dtype == "float64") fn(table.ptr<double>());
  else if (table.dtype == "float16") fn(table.ptr<__half>());
  else if (table.dtype == "bfloat16") fn(table.ptr<__nv_bfloat16>());
  else unsupported("table dtype " + table.dtype);
}

// ---- candidate_topk: logits [rows, V] -> values, ids [rows, C], lse [rows] (or [0])

template <typename In>
void candidate_topk(Request& r) {
  using Acc = typename AccOf<In>::type;
  Tensor& logits = r.at("logits");
  Tensor& values = r.at("values");
  Tensor& lse = r.at("lse");
  const int64_t rows = logits.size(0);
  const int count = static_cast<int>(values.size(1));
  if (rows == 0) return;
  use_dynamic_smem();
  emu::launch(dim3(static_cast<unsigned>(rows)), dim3(kSelectThreads),
              static_cast<size_t>(count) * (sizeof(Acc) + sizeof(int64_t)), candidate_topk_kernel<In>,
              logits.ptr<const In>(), logits.size(1), count, values.ptr<Acc>(), r.at("ids").ptr<int64_t>(),
              lse.numel() ? lse.ptr<Acc>() : nullptr);
}

// ---- one level: tree_ops.cu's LevelLaunch

template <typename T>
struct LevelLaunch {
  int f, C, E, Q, r, G;
  const T* states = nullptr;
  const T* z = nullptr;
  const T* w_s = nullptr;
  int64_t ld_ws = 0;
  T* mid = nullptr;
  SelectArgs<T> select{};
  const Tensor* table = nullptr;
  int64_t vocab = 0;
  const T* w_hh = nullptr;
  int64_t ld_hh = 0;
  const T* b_hh = nullptr;
  T* states_out = nullptr;
  int32_t* status = nullptr;

  void set_gru(const Tensor& input_table, const Tensor& hh, const T* bias, T* out) {
    table = &input_table;
    vocab = input_table.size(0);
    w_hh = hh.ptr<const T>();
    ld_hh = hh.stride0();
    b_hh = bias;
    states_out = out;
  }

  void run() {
    if (z != nullptr) {
      emu::launch(dim3(blocks_for_warps(r)), dim3(kWarpThreads), 0, level_mid_kernel<T>, f, r, G, states, z,
                  w_s, ld_ws, mid);
    }
    select.mid = z != nullptr ? mid : nullptr;
    use_dynamic_smem();
    emu::launch(dim3(1), dim3(kSelectThreads), static_cast<size_t>(Q) * (sizeof(T) + sizeof(int64_t)),
                level_select_kernel<T>, select);
    if (table == nullptr) return;
    with_table(*table, [&](auto* rows) {
      using TableT = std::remove_const_t<std::remove_pointer_t<decltype(rows)>>;
      emu::launch(dim3(blocks_for_warps(G)), dim3(kWarpThreads), 0, level_gru_kernel<T, TableT>, Q, G, states,
                  static_cast<const int64_t*>(select.parent_pos), static_cast<const int64_t*>(select.tokens),
                  static_cast<const TableT*>(rows), table->stride0(), vocab, w_hh, ld_hh, b_hh, states_out,
                  status);
    });
  }
};

template <typename T>
void expand_level(Request& r) {
  Tensor& scores = r.at("parent_scores");
  const bool corrected = r.has("z"), gru = r.has("input_table");
  Tensor& base = r.at("cand_base");
  LevelLaunch<T> l{};
  l.f = static_cast<int>(scores.size(0));
  l.C = static_cast<int>(base.size(0));
  l.E = static_cast<int>(r.scalar_int("num_expand"));
  l.Q = static_cast<int>(r.at("parent_pos").size(0));
  l.r = corrected ? static_cast<int>(r.at("z").size(0)) : 0;
  l.G = (corrected || gru) ? static_cast<int>(r.at("parent_states").size(1)) : 0;
  Scratch mid(sizeof(T) * (corrected ? l.f * l.r : 0), "mid");
  Scratch logits(sizeof(T) * (corrected ? l.f * l.C : 0), "logits");
  Scratch flat(sizeof(T) * l.f * l.E, "flat");
  l.states = (corrected || gru) ? r.at("parent_states").ptr<const T>() : nullptr;
  if (corrected) {
    l.z = r.at("z").ptr<const T>();
    l.w_s = r.at("w_s").ptr<const T>();
    l.ld_ws = r.at("w_s").stride0();
    l.mid = mid.ptr<T>();
  }
  SelectArgs<T>& a = l.select;
  a.f = l.f, a.C = l.C, a.E = l.E, a.Q = l.Q, a.r = l.r;
  a.parent_scores = scores.ptr<const T>();
  if (corrected) {
    a.w2 = r.at("cand_w2").ptr<const T>();
    a.ld_w2 = r.at("cand_w2").stride0();
    a.b2 = r.ptr_or_null<const T>("cand_b2");
  }
  a.base = base.ptr<const T>();
  a.ids = r.at("cand_ids").ptr<const int64_t>();
  a.logits = corrected ? logits.ptr<T>() : nullptr;
  a.flat = flat.ptr<T>();
  a.parent_pos = r.at("parent_pos").ptr<int64_t>();
  a.tokens = r.at("tokens").ptr<int64_t>();
  a.scores = r.at("scores").ptr<T>();
  if (gru) l.set_gru(r.at("input_table"), r.at("w_hh"), r.ptr_or_null<const T>("b_hh"), r.at("states").ptr<T>());
  l.run();
}

// ---- prune_tree and the layout (tree_ops.cu's launch_prune)

template <typename T>
void launch_prune(PruneArgs<T>& a) {
  Scratch keys(sizeof(T) * a.M, "keys"), flags(sizeof(int32_t) * a.M, "flags");
  Scratch picked(sizeof(int64_t) * a.N, "picked"), picked_keys(sizeof(T) * a.N, "picked_keys");
  a.keys = keys.ptr<T>();
  a.flags = flags.ptr<int32_t>();
  a.picked = picked.ptr<int64_t>();
  a.picked_keys = picked_keys.ptr<T>();
  use_dynamic_smem();
  const size_t smem = static_cast<size_t>(std::max(1, a.N - 1)) * (sizeof(T) + sizeof(int64_t));
  emu::launch(dim3(1), dim3(kSelectThreads), smem, prune_tree_kernel<T>, a);
}

template <typename T>
void prune_tree(Request& r) {
  PruneArgs<T> a{};
  a.M = static_cast<int>(r.at("parents").size(0));
  a.N = static_cast<int>(r.at("kept").size(0));
  a.parents = r.at("parents").ptr<const int64_t>();
  a.depths = r.at("depths").ptr<const int64_t>();
  a.scores = r.at("scores").ptr<const T>();
  a.bonus = static_cast<T>(r.scalar_double("depth_bonus"));
  a.kept = r.at("kept").ptr<int64_t>();
  a.new_parents = r.at("new_parents").ptr<int64_t>();
  a.new_depths = r.at("new_depths").ptr<int64_t>();
  a.ancestors = r.at("ancestors").ptr<int32_t>();
  a.first_child = r.at("first_child").ptr<int64_t>();
  a.next_sibling = r.at("next_sibling").ptr<int64_t>();
  a.status = r.at("status").ptr<int32_t>();
  launch_prune<T>(a);
}

// ---- verify_tree

void verify_tree(Request& r) {
  const int T = static_cast<int>(r.at("parents").size(0));
  static_assert(sizeof(verify_smem) == 3 * sizeof(int) * kMaxVerifyNodes, "verify_smem size");
  emu::set_dynamic_shared(verify_smem, sizeof(verify_smem));
  emu::launch(dim3(1), dim3(256), 3 * sizeof(int) * static_cast<size_t>(T), verify_tree_kernel, T,
              r.at("parents").ptr<const int64_t>(), r.at("tokens").ptr<const int64_t>(),
              r.at("target_tokens").ptr<const int64_t>(), r.ptr_or_null<const int64_t>("first_child"),
              r.ptr_or_null<const int64_t>("next_sibling"), r.at("accepted").ptr<int64_t>(),
              r.at("num_accepted").ptr<int64_t>(), r.at("bonus").ptr<int64_t>());
}

// ---- build_dartree: tree_ops.cu's launch_build, level after level, then the prune

template <typename T>
void build_dartree(Request& r) {
  Tensor& cand_values = r.at("cand_values");
  Tensor& cand_ids = r.at("cand_ids");
  const Tensor& plan_t = r.at("plan");
  const int64_t* plan = plan_t.ptr<int64_t>();
  const int64_t L = plan_t.numel(), C = cand_values.size(1), E = r.scalar_int("num_expand");
  const int64_t prefix_len = r.scalar_int("prefix_len");
  const int64_t N = r.at("tokens").size(0);
  int64_t total = 0, W = 1;
  for (int64_t d = 0; d < L; ++d) total += plan[d], W = std::max(W, plan[d]);
  const bool corrected = r.has("z"), gru = r.has("input_table");
  const bool root_from_table = (corrected || gru) && !r.has("root_state");
  const int64_t G = !(corrected || gru) ? 0 : root_from_table ? r.at("w_hh").size(1) : r.at("root_state").numel();
  const int64_t rank = corrected ? r.at("z").size(1) : 0;
  const bool w2_table = corrected && r.at("w_2").dim() == 2;
  const int64_t M = 1 + total;
  const bool prune = N < M;
  Tensor& tokens = r.at("tokens");
  Tensor& parents = r.at("parents");
  Tensor& depths = r.at("depths");
  Tensor& scores = r.at("scores");
  Scratch tok(prune ? 8 * M : 0, "tree tokens"), par(prune ? 8 * M : 0, "tree parents");
  Scratch dep(prune ? 8 * M : 0, "tree depths"), sc(prune ? sizeof(T) * M : 0, "tree scores");
  const bool tracked = corrected || gru;
  Scratch state_buffers(sizeof(T) * (tracked ? 2 * W * G : 0), "states");
  Scratch mid(sizeof(T) * (corrected ? W * rank : 0), "mid");
  Scratch logits(sizeof(T) * (corrected ? W * C : 0), "logits");
  Scratch flat(sizeof(T) * W * E, "flat");
  Scratch parent_pos(8 * W, "parent_pos");
  T* buffers = state_buffers.ptr<T>();
  int32_t* status_p = r.at("status").ptr<int32_t>();
  *status_p = 0;  // status.zero_()
  Scratch table_root_state(sizeof(T) * G, "root state"), zero_state(sizeof(T) * G, "zero state");
  Scratch zero_pos(8, "zero pos");
  const T* root_state_p = nullptr;
  if (root_from_table) {
    std::memset(zero_state.t.data, 0, zero_state.t.bytes);
    std::memset(zero_pos.t.data, 0, zero_pos.t.bytes);
    const Tensor& hh = r.at("w_hh");
    with_table(r.at("input_table"), [&](auto* rows) {
      using TableT = std::remove_const_t<std::remove_pointer_t<decltype(rows)>>;
      emu::launch(dim3(blocks_for_warps(G)), dim3(kWarpThreads), 0, level_gru_kernel<T, TableT>, 1,
                  static_cast<int>(G), zero_state.ptr<const T>(), zero_pos.ptr<const int64_t>(),
                  r.at("root").ptr<const int64_t>(), static_cast<const TableT*>(rows),
                  r.at("input_table").stride0(), r.at("input_table").size(0), hh.ptr<const T>(),
                  hh.stride0(), r.ptr_or_null<const T>("b_hh"), table_root_state.ptr<T>(), status_p);
    });
    root_state_p = table_root_state.ptr<T>();
  } else if (tracked) {
    root_state_p = r.at("root_state").ptr<const T>();
  }
  int64_t* tok_p = prune ? tok.ptr<int64_t>() : tokens.ptr<int64_t>();
  int64_t* par_p = prune ? par.ptr<int64_t>() : parents.ptr<int64_t>();
  int64_t* dep_p = prune ? dep.ptr<int64_t>() : depths.ptr<int64_t>();
  T* sc_p = prune ? sc.ptr<T>() : scores.ptr<T>();
  int64_t start = 0, width = 1, placed = 1;
  for (int64_t d = 0; d < L; ++d) {
    LevelLaunch<T> l{};
    l.f = static_cast<int>(width), l.C = static_cast<int>(C), l.E = static_cast<int>(E);
    l.Q = static_cast<int>(plan[d]), l.r = static_cast<int>(rank), l.G = static_cast<int>(G);
    l.states = !tracked ? nullptr : d == 0 ? root_state_p : buffers + ((d - 1) % 2) * W * G;
    const bool level_corrected = corrected && d >= prefix_len;
    if (level_corrected) {
      l.z = r.at("z").ptr<const T>() + d * rank;
      l.w_s = r.at("w_s").ptr<const T>();
      l.ld_ws = r.at("w_s").stride0();
      l.mid = mid.ptr<T>();
    }
    SelectArgs<T>& a = l.select;
    a.f = l.f, a.C = l.C, a.E = l.E, a.Q = l.Q, a.r = l.r;
    a.parent_scores = sc_p + start;
    if (level_corrected) {
      const Tensor& w_2 = r.at("w_2");
      if (w2_table) {
        a.w2 = w_2.ptr<const T>();
        a.ld_w2 = w_2.stride0();
        a.b2 = r.ptr_or_null<const T>("b_2");
        a.w2_ids = cand_ids.ptr<const int64_t>() + d * C;
        a.w2_rows = w_2.size(0);
      } else {
        a.w2 = w_2.ptr<const T>() + d * C * rank;
        a.ld_w2 = rank;
        a.b2 = r.has("b_2") ? r.at("b_2").ptr<const T>() + d * C : nullptr;
      }
      a.logits = logits.ptr<T>();
    }
    a.base = cand_values.ptr<const T>() + d * C;
    a.ids = cand_ids.ptr<const int64_t>() + d * C;
    a.flat = flat.ptr<T>();
    a.parent_pos = parent_pos.ptr<int64_t>();
    a.tokens = tok_p + placed;
    a.scores = sc_p + placed;
    a.tree_parents = par_p + placed;
    a.tree_depths = dep_p + placed;
    a.parent_offset = start;
    a.depth = d + 1;
    a.status = status_p;
    if (d == 0) {
      a.root = r.at("root").ptr<const int64_t>();
      a.root_row_token = tok_p, a.root_row_parent = par_p, a.root_row_depth = dep_p;
      a.root_row_score = sc_p;
    }
    if (gru && d + 1 < L) {
      l.set_gru(r.at("input_table"), r.at("w_hh"), r.ptr_or_null<const T>("b_hh"), buffers + (d % 2) * W * G);
      l.status = status_p;
    }
    l.run();
    start = placed;
    placed += plan[d];
    width = plan[d];
  }
  if (!prune) return;
  PruneArgs<T> p{};
  p.M = static_cast<int>(M), p.N = static_cast<int>(N);
  p.parents = par_p, p.depths = dep_p, p.scores = sc_p;
  p.bonus = static_cast<T>(r.scalar_double("depth_bonus"));
  Scratch kept(8 * N, "kept");
  p.kept = kept.ptr<int64_t>();
  p.new_parents = parents.ptr<int64_t>();
  p.new_depths = depths.ptr<int64_t>();
  p.status = status_p;
  p.raise_status = true;
  p.tokens = tok_p;
  p.tokens_out = tokens.ptr<int64_t>();
  p.scores_out = scores.ptr<T>();
  launch_prune<T>(p);
}

// Dispatch on the dtype of `key` (AT_DISPATCH_FLOATING_TYPES; candidate_topk also 16-bit).
template <template <typename> class Op, bool kHalfToo = false>
void dispatch(Request& r, const std::string& key) {
  const std::string& dtype = r.at(key).dtype;
  if (dtype == "float32") return Op<float>::run(r);
  if (dtype == "float64") return Op<double>::run(r);
  if constexpr (kHalfToo) {
    if (dtype == "float16") return Op<__half>::run(r);
    if (dtype == "bfloat16") return Op<__nv_bfloat16>::run(r);
  }
  unsupported(r.op + " dtype " + dtype);
}
template <typename T> struct TopkOp { static void run(Request& r) { candidate_topk<T>(r); } };
template <typename T> struct LevelOp { static void run(Request& r) { expand_level<T>(r); } };
template <typename T> struct PruneOp { static void run(Request& r) { prune_tree<T>(r); } };
template <typename T> struct BuildOp { static void run(Request& r) { build_dartree<T>(r); } };

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <request> <response>\n", argv[0]);
    return 2;
  }
  Request r = emu::read_request(argv[1]);
  if (r.op == "candidate_topk") dispatch<TopkOp, true>(r, "logits");
  else if (r.op == "expand_level") dispatch<LevelOp>(r, "parent_scores");
  else if (r.op == "prune_tree") dispatch<PruneOp>(r, "scores");
  else if (r.op == "verify_tree") verify_tree(r);
  else if (r.op == "build_dartree") dispatch<BuildOp>(r, "cand_values");
  else unsupported("op " + r.op);
  emu::write_tensors(argv[2], r);
  return 0;
}
