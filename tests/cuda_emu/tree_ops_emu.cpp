// Runs the CUDA draft-tree kernels (csrc/include/dartree/{candidate_topk,expand_level,prune_tree,
// verify_tree}.cuh), unchanged, under the host emulator with its race detector, launched by the
// launchers' own host code (their launch_* functions and dartree/build_dartree.cuh: same grids,
// block sizes, shared memory, scratch) through an emulated launcher in place of
// csrc/cuda/launcher.h. What is left here is the part of csrc/cuda/*.cu that reads torch tensors:
// the request's tensors as the launch code's raw-pointer arguments.
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

#include "dartree/build_dartree.cuh"
#include "dartree/candidate_topk.cuh"
#include "dartree/expand_level.cuh"
#include "dartree/prune_tree.cuh"
#include "dartree/verify_tree.cuh"

#include <algorithm>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

using emu::Request;
using emu::Scratch;
using emu::Tensor;
using namespace dartree;

static_assert(sizeof(verify_smem) == 3 * sizeof(int) * kMaxVerifyNodes, "verify_smem size");

// csrc/cuda/launcher.h's StreamLauncher, emulated: the same three members.
class EmuLauncher {
 public:
  template <typename Kernel, typename... Args>
  void launch(dim3 grid, dim3 block, size_t smem_bytes, Kernel kernel, Args... args) {
    if constexpr (std::is_same_v<Kernel, decltype(&verify_tree_kernel)>) {
      emu::set_dynamic_shared(verify_smem, sizeof(verify_smem));
    } else {
      emu::set_dynamic_shared(dynamic_smem, sizeof(dynamic_smem));
    }
    emu::launch(grid, block, smem_bytes, kernel, args...);
  }

  template <typename T>
  T* scratch(int64_t count, const char* name) {  // poisoned, named for the race detector
    held_.push_back(std::make_unique<Scratch>(sizeof(T) * static_cast<size_t>(count), name));
    return held_.back()->ptr<T>();
  }

  void zero(void* data, size_t bytes) { std::memset(data, 0, bytes); }

 private:
  std::vector<std::unique_ptr<Scratch>> held_;
};

[[noreturn]] void unsupported(const std::string& what) {
  std::fprintf(stderr, "driver: unsupported %s\n", what.c_str());
  std::exit(2);
}

TableKind table_kind(const Tensor& table) {
  if (table.dtype == "float32") return TableKind::kFloat;
  if (table.dtype == "float64") return TableKind::kDouble;
  if (table.dtype == "float16") return TableKind::kHalf;
  if (table.dtype == "bfloat16") return TableKind::kBFloat16;
  unsupported("table dtype " + table.dtype);
}

// ---- candidate_topk: logits [rows, V] -> values, ids [rows, C], lse [rows] (or [0])

template <typename In>
void candidate_topk(Request& r) {
  using Acc = typename AccOf<In>::type;
  Tensor& logits = r.at("logits");
  Tensor& lse = r.at("lse");
  EmuLauncher launcher;
  launch_candidate_topk<In>(launcher, logits.ptr<const In>(), logits.size(0), logits.size(1),
                            static_cast<int>(r.at("values").size(1)), r.at("values").ptr<Acc>(),
                            r.at("ids").ptr<int64_t>(), lse.numel() ? lse.ptr<Acc>() : nullptr);
}

// ---- expand_level (the arguments as csrc/tree_ops.h::expand_level_op packs them)

template <typename T>
void expand_level(Request& r) {
  const bool corrected = r.has("z"), gru = r.has("input_table");
  LevelArgs<T> a;
  a.f = r.at("parent_scores").size(0);
  a.C = r.at("cand_base").size(0);
  a.E = r.scalar_int("num_expand");
  a.Q = r.at("parent_pos").size(0);
  a.r = corrected ? r.at("z").size(0) : 0;
  a.G = (corrected || gru) ? r.at("parent_states").size(1) : 0;
  a.parent_scores = r.at("parent_scores").ptr<const T>();
  a.states = (corrected || gru) ? r.at("parent_states").ptr<const T>() : nullptr;
  if (corrected) {
    a.z = r.at("z").ptr<const T>();
    a.w_s = r.at("w_s").ptr<const T>();
    a.ld_ws = r.at("w_s").stride0();
    a.w2 = r.at("cand_w2").ptr<const T>();
    a.ld_w2 = r.at("cand_w2").stride0();
    a.b2 = r.ptr_or_null<const T>("cand_b2");
  }
  a.base = r.at("cand_base").ptr<const T>();
  a.ids = r.at("cand_ids").ptr<const int64_t>();
  if (gru) {
    const Tensor& table = r.at("input_table");
    a.vocab = table.size(0);
    a.table = table.data;
    a.table_kind = table_kind(table);
    a.ld_table = table.stride0();
    a.w_hh = r.at("w_hh").ptr<const T>();
    a.ld_hh = r.at("w_hh").stride0();
    a.b_hh = r.ptr_or_null<const T>("b_hh");
    a.states_out = r.at("states").ptr<T>();
  }
  a.parent_pos = r.at("parent_pos").ptr<int64_t>();
  a.tokens = r.at("tokens").ptr<int64_t>();
  a.scores = r.at("scores").ptr<T>();
  EmuLauncher launcher;
  launch_expand_level(launcher, a);
}

// ---- prune_tree and the layout

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
  EmuLauncher launcher;
  launch_prune_tree(launcher, a);
}

// ---- verify_tree

void verify_tree(Request& r) {
  EmuLauncher launcher;
  launch_verify_tree(launcher, static_cast<int>(r.at("parents").size(0)),
                     r.at("parents").ptr<const int64_t>(), r.at("tokens").ptr<const int64_t>(),
                     r.at("target_tokens").ptr<const int64_t>(),
                     r.ptr_or_null<const int64_t>("first_child"),
                     r.ptr_or_null<const int64_t>("next_sibling"), r.at("accepted").ptr<int64_t>(),
                     r.at("num_accepted").ptr<int64_t>(), r.at("bonus").ptr<int64_t>());
}

// ---- build_dartree: the shape as csrc/tree_checks.h::check_build_dartree finds it, the inputs as
// csrc/tree_ops.h::build_dartree_op packs them, then dartree/build_dartree.cuh

template <typename T>
void build_dartree(Request& r) {
  const Tensor& plan = r.at("plan");
  BuildShape s{};
  s.k = r.at("cand_values").size(0);
  s.C = r.at("cand_values").size(1);
  s.E = r.scalar_int("num_expand");
  s.L = plan.numel();
  s.N = r.at("tokens").size(0);
  s.total = 0;
  s.max_width = 1;
  for (int64_t d = 0; d < s.L; ++d) {
    s.total += plan.ptr<int64_t>()[d];
    s.max_width = std::max(s.max_width, plan.ptr<int64_t>()[d]);
  }
  s.corrected = r.has("z");
  s.gru = r.has("input_table");
  s.root_from_table = (s.corrected || s.gru) && !r.has("root_state");
  if (s.corrected || s.gru) s.G = s.root_from_table ? r.at("w_hh").size(1) : r.at("root_state").numel();
  s.r = s.corrected ? r.at("z").size(1) : 0;
  s.w2_table = s.corrected && r.at("w_2").dim() == 2;
  s.w2_rows = s.w2_table ? r.at("w_2").size(0) : 0;
  s.vocab = s.gru ? r.at("input_table").size(0) : 0;

  BuildInputs<T> in;
  in.cand_values = r.at("cand_values").ptr<const T>();
  in.cand_ids = r.at("cand_ids").ptr<const int64_t>();
  in.root = r.at("root").ptr<const int64_t>();
  in.root_state = r.ptr_or_null<const T>("root_state");
  in.z = r.ptr_or_null<const T>("z");
  if (r.has("w_s")) in.w_s = r.at("w_s").ptr<const T>(), in.ld_ws = r.at("w_s").stride0();
  if (r.has("w_2")) in.w_2 = r.at("w_2").ptr<const T>(), in.ld_w2 = r.at("w_2").stride0();
  in.b_2 = r.ptr_or_null<const T>("b_2");
  if (s.gru) {
    in.input_table = r.at("input_table").data;
    in.table_kind = table_kind(r.at("input_table"));
    in.ld_table = r.at("input_table").stride0();
  }
  if (r.has("w_hh")) in.w_hh = r.at("w_hh").ptr<const T>(), in.ld_hh = r.at("w_hh").stride0();
  in.b_hh = r.ptr_or_null<const T>("b_hh");
  in.plan = plan.ptr<const int64_t>();
  in.prefix_len = r.scalar_int("prefix_len");
  in.depth_bonus = r.scalar_double("depth_bonus");

  const BuildOutputs<T> out{r.at("tokens").ptr<int64_t>(), r.at("parents").ptr<int64_t>(),
                            r.at("depths").ptr<int64_t>(), r.at("scores").ptr<T>(),
                            r.at("status").ptr<int32_t>()};
  EmuLauncher launcher;
  launch_build_dartree(launcher, s, in, out);
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
