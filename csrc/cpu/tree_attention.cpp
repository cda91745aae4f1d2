// CPU launcher of tree_attention (kernel: dartree/cpu/tree_attention.h): the shared checks and
// dispatch (attention_launch.h), the kernel's GEMMs on ATen's BLAS, its threads on
// at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>

#include "attention_launch.h"
#include "launchers.h"
#include "dartree/cpu/tree_attention.h"

namespace dartree {
namespace {

// The kernel's two GEMMs, on scratch buffers (from_blob views, no copies).
template <typename acc_t>
struct AtenGemm {
  at::TensorOptions options = at::TensorOptions().dtype(c10::CppTypeToScalarType<acc_t>::value);

  // scores [rows, n] = q [rows, dim] k^T, k's n rows k_ld apart
  void scores(const acc_t* q, int64_t rows, int64_t dim, const acc_t* k, int64_t k_ld, int64_t n,
              acc_t* out) const {
    at::Tensor s_mat = at::from_blob(out, {rows, n}, options);
    at::mm_out(s_mat, at::from_blob(const_cast<acc_t*>(q), {rows, dim}, options),
               at::from_blob(const_cast<acc_t*>(k), {dim, n}, {1, k_ld}, options));
  }
  // o [rows, dim] += p [rows, n] v, v's n rows v_ld apart
  void accumulate(acc_t* o, int64_t rows, int64_t dim, const acc_t* p, int64_t n, const acc_t* v,
                  int64_t v_ld) const {
    at::from_blob(o, {rows, dim}, options)
        .addmm_(at::from_blob(const_cast<acc_t*>(p), {rows, n}, options),
                at::from_blob(const_cast<acc_t*>(v), {n, dim}, {v_ld, 1}, options));
  }
};

struct AtenParallel {
  template <typename F>
  void operator()(int64_t begin, int64_t end, int64_t grain, const F& fn) const {
    at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
      at::AutoDispatchBelowADInplaceOrView below_autograd;  // plain GEMMs on scratch buffers
      fn(b, e);
    });
  }
};

// Trees of at most this many rows take the exact kernel, which meets this op's contract too: their
// few BLAS calls per KV head cost more than their arithmetic. SmolLM2's shapes (9 query heads over
// 3 KV heads, D 64), 2 threads, EPYC Zen 4, per call, BLAS path / exact kernel (whose four-row
// tiles share each key and value load; its vector max of de59a8d and its balanced row blocks),
// medians of 200 calls: float32, 300 keys 141 / 91 us at T = 17, 260 / 199 at T = 33, 518 / 442 at
// T = 64, 1248 / 1224 at T = 128; 1500 keys 459 / 376 at T = 17, 847 / 737 at T = 33, 1830 / 1456
// at T = 64, 3861 / 3264 at T = 128; bfloat16 alike (1262 / 1316 its one loss, 300 keys at 128).
// Prefills of longer prompts take BLAS. Only with a KV head per thread: the exact kernel does not
// split a head's keys among threads.
constexpr int64_t kExactRows = 128;

bool exact_is_faster(const at::Tensor& q, const at::Tensor& k) {
  return q.dim() == 4 && k.dim() == 4 && q.size(2) <= kExactRows && q.size(0) * k.size(1) >= at::get_num_threads();
}

}  // namespace

at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& tree_mask, int64_t prefix_len,
                              std::optional<double> scale) {
  if (exact_is_faster(q, k)) return exact_tree_attention_cpu(q, k, v, tree_mask, prefix_len, scale);
  return launch_tree_attention(q, k, v, tree_mask, prefix_len, scale,
                               [](const auto& p, int64_t batch, auto* out) {
                                 using acc_t = cpu::attention_acc_t<std::remove_pointer_t<decltype(out)>>;
                                 cpu::tree_attn::tree_attention(p, batch, AtenGemm<acc_t>(), AtenParallel(),
                                                                at::get_num_threads(), out);
                               });
}

TORCH_LIBRARY_IMPL(dartree, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }

}  // namespace dartree
