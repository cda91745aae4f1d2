// CUDA launcher for csrc/include/dartree/tree_attention.cuh: argument checks, dtype and head-dim
// dispatch, the split plan, and two launches on the current stream (split kernel, then the combine
// kernel when the keys are split). No host synchronisation; the split workspace comes from the
// caching allocator.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>

#include "../checks.h"
#include "dartree/tree_attention.cuh"

namespace dartree {
namespace {

namespace ta = tree_attn;

// Whether every row start of t (a [B, H, N, D] view with unit d stride) is `bytes`-aligned.
bool rows_aligned(const at::Tensor& t, int64_t bytes) {
  const int64_t elems = bytes / t.element_size();
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0 && t.stride(0) % elems == 0 &&
         t.stride(1) % elems == 0 && t.stride(2) % elems == 0;
}

// Split-kernel blocks the current GPU runs at once; also opts the kernel into its shared memory.
// Asked once per device and kernel (the answer never changes).
template <typename E, int D, typename Kernel>
int block_slots(Kernel kernel) {
  using C = ta::Config<E, D>;
  constexpr int kMaxDevices = 64;
  static int slots[kMaxDevices] = {};
  const int device = c10::cuda::current_device();
  if (device < kMaxDevices && slots[device] > 0) return slots[device];
  if (C::kSmemBytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(C::kSmemBytes)));
  }
  int per_sm = 0, sms = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, C::kThreads, C::kSmemBytes));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int count = sms * (per_sm > 0 ? per_sm : 1);
  if (device < kMaxDevices) slots[device] = count;
  return count;
}

int compute_capability_major() {
  int major = 0;
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c10::cuda::current_device()));
  return major;
}

template <typename E, int D>
void launch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
            at::Tensor& out, int64_t prefix_len, double scale) {
  ta::Params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.mask = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  p.out = out.data_ptr();
  p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_st = q.stride(2);
  p.k_sb = k.stride(0), p.k_sh = k.stride(1), p.k_ss = k.stride(2);
  p.v_sb = v.stride(0), p.v_sh = v.stride(1), p.v_ss = v.stride(2);
  p.o_sb = out.stride(0), p.o_sh = out.stride(1), p.o_st = out.stride(2);
  p.kv_heads = static_cast<int>(k.size(1));
  p.group = static_cast<int>(q.size(1) / k.size(1));
  p.tree = static_cast<int>(q.size(2));
  p.rows = p.group * p.tree;
  p.prefix = static_cast<int>(prefix_len);
  p.keys = static_cast<int>(prefix_len + q.size(2));
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);

  const int batch = static_cast<int>(q.size(0));
  auto split_kernel = ta::tree_attention_split_kernel<E, D>;
  const ta::Plan plan = ta::make_plan<E, D>(p, batch, block_slots<E, D>(split_kernel));
  at::Tensor part_o, part_ml;
  if (plan.splits > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    const int64_t heads = int64_t(batch) * p.kv_heads;
    part_o = at::empty({heads, plan.splits, p.rows, D}, f32);
    part_ml = at::empty({heads, plan.splits, p.rows, 2}, f32);
    p.part_o = part_o.data_ptr<float>();
    p.part_ml = part_ml.data_ptr<float>();
  }

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  split_kernel<<<plan.split_grid, plan.threads, plan.smem_bytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (plan.splits > 1) {
    ta::tree_attention_combine_kernel<E, D><<<plan.combine_grid, plan.threads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename E>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                  at::Tensor& out, int64_t prefix_len, double scale) {
  if (q.size(3) == 64) {
    launch<E, 64>(q, k, v, mask, out, prefix_len, scale);
  } else {
    launch<E, 128>(q, k, v, mask, out, prefix_len, scale);
  }
}

at::Tensor tree_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                               const at::Tensor& tree_mask, int64_t prefix_len,
                               std::optional<double> scale) {
  check_tree_attention(q_in, k_in, v_in, tree_mask, prefix_len);
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK_VALUE(dtype != at::kDouble,
                    "tree_attention: float64 is not supported on CUDA (float32, float16, bfloat16 are)");
  const int64_t dim = q_in.size(3);
  TORCH_CHECK_VALUE(dim == 64 || dim == 128, "tree_attention: the CUDA kernel needs head dim 64 or 128, got ",
                    dim);
  TORCH_CHECK_VALUE(k_in.size(0) * k_in.size(1) <= 65535, "tree_attention: B * Hkv must be <= 65535, got ",
                    k_in.size(0) * k_in.size(1));
  TORCH_CHECK_VALUE(k_in.size(2) < std::numeric_limits<int32_t>::max() &&
                        q_in.size(1) * q_in.size(2) < std::numeric_limits<int32_t>::max(),
                    "tree_attention: sequence or head counts too large for the CUDA kernel");
  const c10::cuda::CUDAGuard guard(q_in.device());
  TORCH_CHECK_VALUE(compute_capability_major() >= 8,
                    "tree_attention: the CUDA kernel needs compute capability 8.0 or newer");

  at::Tensor out = at::empty(q_in.sizes(), q_in.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  // Read in place when rows are contiguous and aligned for the kernel's vector loads (always for
  // the static cache and for transformers' query views); copy otherwise.
  const at::Tensor q = q_in.stride(3) == 1 && rows_aligned(q_in, 4) ? q_in : q_in.contiguous();
  const at::Tensor k = k_in.stride(3) == 1 && rows_aligned(k_in, 16) ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(3) == 1 && rows_aligned(v_in, 16) ? v_in : v_in.contiguous();
  const at::Tensor mask = tree_mask.contiguous();
  const double softmax_scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(dim));

  switch (dtype) {
    case at::kHalf: dispatch_dim<ta::Half>(q, k, v, mask, out, prefix_len, softmax_scale); break;
    case at::kBFloat16: dispatch_dim<ta::BFloat16>(q, k, v, mask, out, prefix_len, softmax_scale); break;
    default: dispatch_dim<ta::Float32>(q, k, v, mask, out, prefix_len, softmax_scale); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree, CUDA, m) { m.impl("tree_attention", &tree_attention_cuda); }

}  // namespace dartree
