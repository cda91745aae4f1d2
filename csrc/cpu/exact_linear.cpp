// CPU launchers of exact_linear and packed_linear (kernel: dartree/cpu/exact_linear.h; packed
// weight rows: dartree/cpu/packed_rows.h): checks, contiguous inputs, the empty sum, the
// instruction-set cap (DARTREE_EXACT_ISA), the dtype dispatch, threads on at::parallel_for.
// packed_linear runs exact_linear's own tiles over weight rows rebuilt in x's dtype, so its
// outputs are exact_linear's on the dequantised weights, bit for bit, on every path.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdlib>
#include <optional>

#include "../exact_checks.h"
#include "../packed_checks.h"
#include "dartree/cpu/exact_linear.h"
#include "dartree/cpu/packed_rows.h"
#include "launchers.h"
#include "torch_types.h"

namespace dartree {
namespace {

namespace lin = cpu::exact_lin;

struct AtenParallel {
  template <typename F>
  void operator()(int64_t begin, int64_t end, int64_t grain, const F& fn) const {
    at::parallel_for(begin, end, grain, fn);
  }
  int64_t threads() const { return at::in_parallel_region() ? 1 : at::get_num_threads(); }
};

}  // namespace

// The most capable path DARTREE_EXACT_ISA allows (unset: all of them).
int exact_isa_cap() {
  static const int cap = [] {
    const char* env = std::getenv("DARTREE_EXACT_ISA");
    const int rank = lin::isa_rank(env);
    TORCH_CHECK_VALUE(rank >= 0, "DARTREE_EXACT_ISA must be amx, avx512-bf16, avx512, avx2 or portable, got ",
                      env);
    return rank;
  }();
  return cap;
}

at::Tensor exact_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight_in,
                            const std::optional<at::Tensor>& bias_in) {
  check_exact_linear(x_in, weight_in, bias_in);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const std::optional<at::Tensor> bias =
      bias_in.has_value() ? std::optional<at::Tensor>(bias_in->contiguous()) : std::nullopt;
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (out.numel() == 0) return out;
  if (K == 0) {  // an empty sum: the bias alone
    if (bias.has_value()) out.copy_(bias->expand({M, N}));
    else out.zero_();
    return out;
  }
  const int cap = x.scalar_type() == at::kDouble ? 0 : exact_isa_cap();  // float64 has one path
  if (x.scalar_type() == at::kBFloat16 && lin::use_amx(cap)) {
    const auto bits = [](const at::Tensor& t) { return static_cast<const uint16_t*>(t.const_data_ptr()); };
    lin::run_amx_rows(bits(x), lin::DenseRows<uint16_t>{bits(weight), K}, bias.has_value() ? bits(*bias) : nullptr,
                      M, N, K, static_cast<uint16_t*>(out.data_ptr()), AtenParallel());
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "exact_linear_cpu", [&] {
    lin::run(x.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(),
             bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr, M, N, K,
             out.data_ptr<scalar_t>(), cap, AtenParallel());
  });
  return out;
}

namespace {

// bfloat16 bits of packed rows, for the AMX tiles (which read raw uint16 rows).
struct PackedBf16Bits {
  cpu::PackedRows<c10::BFloat16> rows;
  const uint16_t* operator()(int64_t n0, int64_t n1, std::vector<uint16_t>&) const {
    thread_local std::vector<c10::BFloat16> values;  // read by the caller before its next call
    return reinterpret_cast<const uint16_t*>(rows(n0, n1, values));
  }
};

}  // namespace

at::Tensor packed_linear_cpu(const at::Tensor& x_in, const at::Tensor& packed_in, int64_t qtype, int64_t K,
                             const std::optional<at::Tensor>& bias_in) {
  check_packed_linear(x_in, packed_in, qtype, K, bias_in);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor packed = packed_in.contiguous();
  const std::optional<at::Tensor> bias =
      bias_in.has_value() ? std::optional<at::Tensor>(bias_in->contiguous()) : std::nullopt;
  const int64_t M = x.size(0), N = packed.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (out.numel() == 0) return out;
  const int type = static_cast<int>(qtype);
  const uint8_t* rows = packed.const_data_ptr<uint8_t>();
  const int64_t row_bytes = packed.size(1);
  const int cap = exact_isa_cap();
  const bool simd = cap >= 2 && cpu::has_avx512();  // select_kernel's AVX-512 tiles, and dq32
  const bool avx2 = !simd && cap >= 1 && cpu::has_avx2();  // its AVX2 tiles, and packed_avx2.h
#if DARTREE_X86 && defined(__GNUC__)
  // Few rows: weights dequantised in registers, in float32 or (where exact_linear does not take AMX)
  // bfloat16, on the chain exact_linear's tiles would take (VDPBF16PS or FMA).
  const bool fused_bf16 = x.scalar_type() == at::kBFloat16 && !lin::use_amx(cap);
  using cpu::packed::SmallTiles;
  const SmallTiles path = lin::use_vdpbf16(cap) ? SmallTiles::kVdpbf16 : simd ? SmallTiles::kAvx512 : SmallTiles::kAvx2;
  const bool fma_tiles = simd && (x.scalar_type() == at::kFloat || path == SmallTiles::kAvx512);
  // 17-18 rows in two groups: float32, and not Q5_K, whose rebuild costs more than the scratch's pass
  const int64_t max_split = fma_tiles && x.scalar_type() == at::kFloat && type != gguf::Q5_K
                                ? cpu::packed::kMaxFmaSplitRows
                                : cpu::packed::kMaxSplitRows;
  if ((x.scalar_type() == at::kFloat || fused_bf16) && M <= max_split && (simd || avx2)) {
    // More rows than one call of the tiles takes: balanced groups (9 rows on the VDPBF16PS tiles: 5 +
    // 4), each rebuilding the weights (a row's bits do not depend on its group).
    const int64_t per_call = fma_tiles ? cpu::packed::kMaxFmaRows : cpu::packed::kMaxFusedRows;
    const int64_t groups = (M + per_call - 1) / per_call;
    const auto small = [&](auto* x_data, auto* bias_data, auto* out_data) {
      cpu::packed::with_type(type, [&](auto t) {
        for (int64_t g = 0, r0 = 0; g < groups; ++g) {
          const int64_t r1 = M * (g + 1) / groups;
          cpu::packed::run_small<decltype(t)::value>(x_data + r0 * K, rows, row_bytes, bias_data, r1 - r0, N, K,
                                                     out_data + r0 * N, path, AtenParallel());
          r0 = r1;
        }
      });
    };
    if (fused_bf16) {
      using bf16 = c10::BFloat16;
      small(x.const_data_ptr<bf16>(), bias.has_value() ? bias->const_data_ptr<bf16>() : nullptr, out.data_ptr<bf16>());
    } else {
      small(x.const_data_ptr<float>(), bias.has_value() ? bias->const_data_ptr<float>() : nullptr,
            out.data_ptr<float>());
    }
    return out;
  }
#endif
  if (x.scalar_type() == at::kBFloat16 && lin::use_amx(cap)) {
    const auto bits = [](const at::Tensor& t) { return static_cast<const uint16_t*>(t.const_data_ptr()); };
    const PackedBf16Bits packed_rows{{rows, row_bytes, type, K, simd, lin::use_vdpbf16(cap), avx2}};
    lin::run_amx_rows(bits(x), packed_rows, bias.has_value() ? bits(*bias) : nullptr, M, N, K,
                      static_cast<uint16_t*>(out.data_ptr()), AtenParallel());
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "packed_linear_cpu", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {  // refused by the checks
      const cpu::PackedRows<scalar_t> packed_rows{rows, row_bytes, type, K, simd, lin::use_vdpbf16(cap), avx2};
      lin::run_rows(x.const_data_ptr<scalar_t>(), packed_rows,
                    bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr, M, N, K,
                    out.data_ptr<scalar_t>(), cap, AtenParallel());
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(dartree, CPU, m) {
  m.impl("exact_linear", &exact_linear_cpu);
  m.impl("packed_linear", &packed_linear_cpu);
}

}  // namespace dartree
