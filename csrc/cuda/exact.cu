// CUDA launchers for csrc/include/dartree/exact.cuh: checks, dtype dispatch, one launch each on the
// current stream, no host synchronisation.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

#include "../checks.h"
#include "../exact_checks.h"
#include "../packed_checks.h"
#include "dartree/exact.cuh"

namespace dartree {
namespace {

template <typename F>
void dispatch_16_32(at::ScalarType dtype, const char* name, F&& body) {
  switch (dtype) {
    case at::kFloat: body(float{}); break;
    case at::kHalf: body(__half{}); break;
    case at::kBFloat16: body(__nv_bfloat16{}); break;
    default: TORCH_CHECK_VALUE(false, name, ": the CUDA kernel covers float32, float16 and bfloat16, got ", dtype);
  }
}

at::Tensor exact_linear_cuda(const at::Tensor& x_in, const at::Tensor& w_in, const std::optional<at::Tensor>& bias_in) {
  check_exact_linear(x_in, w_in, bias_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (out.numel() == 0) return out;
  TORCH_CHECK_VALUE((M + exact::kTile - 1) / exact::kTile < 65536, "exact_linear: M = ", M, " is too large for one launch");
  const dim3 block(exact::kTile, exact::kTile);
  const dim3 grid(static_cast<unsigned>((N + exact::kTile - 1) / exact::kTile),
                  static_cast<unsigned>((M + exact::kTile - 1) / exact::kTile));
  dispatch_16_32(x.scalar_type(), "exact_linear", [&](auto tag) {
    using E = decltype(tag);
    exact::exact_linear_kernel<E><<<grid, block, 0, c10::cuda::getCurrentCUDAStream()>>>(
        static_cast<const E*>(x.data_ptr()), exact::DenseW<E>{static_cast<const E*>(w.data_ptr()), K},
        bias.defined() ? static_cast<const E*>(bias.data_ptr()) : nullptr, static_cast<E*>(out.data_ptr()),
        M, N, K);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor packed_linear_cuda(const at::Tensor& x_in, const at::Tensor& packed_in, int64_t qtype, int64_t K,
                              const std::optional<at::Tensor>& bias_in) {
  check_packed_linear(x_in, packed_in, qtype, K, bias_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), packed = packed_in.contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const int64_t M = x.size(0), N = packed.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (out.numel() == 0) return out;
  TORCH_CHECK_VALUE((M + exact::kTile - 1) / exact::kTile < 65536, "packed_linear: M = ", M, " is too large for one launch");
  const dim3 block(exact::kTile, exact::kTile);
  const dim3 grid(static_cast<unsigned>((N + exact::kTile - 1) / exact::kTile),
                  static_cast<unsigned>((M + exact::kTile - 1) / exact::kTile));
  dispatch_16_32(x.scalar_type(), "packed_linear", [&](auto tag) {
    using E = decltype(tag);
    exact::exact_linear_kernel<E><<<grid, block, 0, c10::cuda::getCurrentCUDAStream()>>>(
        static_cast<const E*>(x.data_ptr()),
        exact::PackedW<E>{packed.data_ptr<uint8_t>(), packed.size(1), static_cast<int>(qtype)},
        bias.defined() ? static_cast<const E*>(bias.data_ptr()) : nullptr, static_cast<E*>(out.data_ptr()),
        M, N, K);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor exact_tree_attention_cuda(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in,
                                     const at::Tensor& tree_mask, int64_t prefix_len, std::optional<double> scale) {
  check_tree_attention(q, k_in, v_in, tree_mask, prefix_len);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  const at::Tensor mask = tree_mask.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), size = q.size(2), dim = q.size(3);
  const int64_t rows = batch * heads * size;
  at::Tensor scores = at::empty({rows, prefix_len + size}, q.options().dtype(at::kFloat));
  const double softmax_scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(dim));
  const size_t smem = dim * sizeof(float) + size * sizeof(int);
  TORCH_CHECK_VALUE(smem <= 48 * 1024, "exact_tree_attention: head dim ", dim, " and T ", size,
                    " need more than 48 KiB of shared memory");
  dispatch_16_32(q.scalar_type(), "exact_tree_attention", [&](auto tag) {
    using E = decltype(tag);
    exact::exact_tree_attention_kernel<E><<<static_cast<unsigned>(rows), exact::kAttnThreads, smem,
                                           c10::cuda::getCurrentCUDAStream()>>>(
        static_cast<const E*>(q.data_ptr()), static_cast<const E*>(k.data_ptr()),
        static_cast<const E*>(v.data_ptr()), mask.data_ptr<bool>(), static_cast<E*>(out.data_ptr()),
        scores.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2), q.stride(3), k.stride(0),
        k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), static_cast<int>(heads),
        static_cast<int>(heads / k.size(1)), static_cast<int>(size), static_cast<int>(dim), prefix_len,
        static_cast<float>(softmax_scale));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree, CUDA, m) {
  m.impl("exact_linear", &exact_linear_cuda);
  m.impl("packed_linear", &packed_linear_cuda);
  m.impl("exact_tree_attention", &exact_tree_attention_cuda);
}

}  // namespace dartree
