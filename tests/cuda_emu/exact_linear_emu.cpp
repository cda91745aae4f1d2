// Runs the CUDA batch-invariant linear kernel (csrc/include/dartree/exact.cuh: exact_linear_kernel
// with its DenseW and PackedW weight loaders), unchanged, under the host emulator with its race
// detector, launched as csrc/cuda/exact.cu launches it. That launch code sits inside the torch
// launchers, so it is mirrored here (keep the two in step): block kTile x kTile, grid
// (ceil(N / kTile), ceil(M / kTile)), no dynamic shared memory, nothing launched for an empty
// output, the element type that of x (float32, float16, bfloat16). The argument checks
// (check_exact_linear, check_packed_linear) are torch code and stay with the CPU tests.
// Driven by tests/test_cuda_emulator_exact.py:  exact_linear_emu <request> <response>  (tensor_io.h).
// Ops, with the tensors of the torch op under the schema's argument names (bias absent when None)
// and the output `out` [M, N] (poisoned by the caller, written in place):
//   exact_linear   x [M, K], weight [N, K], bias [N]
//   packed_linear  x [M, K], packed [N, row bytes] uint8, qtype, K (0-d int64), bias [N]
#include "tensor_io.h"

#include "dartree/exact.cuh"

#include <string>

namespace {

using emu::Request;
using emu::Tensor;
namespace ex = dartree::exact;

template <typename E, typename W>
void launch_linear(Request& r, const W& w, int64_t N, int64_t K) {
  Tensor& x = r.at("x");
  Tensor& out = r.at("out");
  const int64_t M = x.size(0);
  if (out.dim() != 2 || out.size(0) != M || out.size(1) != N || out.dtype != x.dtype) {
    std::fprintf(stderr, "driver: out must be [%lld, %lld] %s\n", static_cast<long long>(M),
                 static_cast<long long>(N), x.dtype.c_str());
    std::exit(2);
  }
  if (out.numel() == 0) return;
  if ((M + ex::kTile - 1) / ex::kTile >= 65536) {
    std::fprintf(stderr, "driver: M = %lld is too large for one launch\n", static_cast<long long>(M));
    std::exit(2);
  }
  const dim3 block(ex::kTile, ex::kTile);
  const dim3 grid(static_cast<unsigned>((N + ex::kTile - 1) / ex::kTile),
                  static_cast<unsigned>((M + ex::kTile - 1) / ex::kTile));
  emu::launch(grid, block, 0, ex::exact_linear_kernel<E, W>, x.ptr<const E>(), w, r.ptr_or_null<const E>("bias"),
              out.ptr<E>(), M, N, K);
}

template <typename E>
void exact_linear(Request& r) {
  Tensor& weight = r.at("weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  launch_linear<E>(r, ex::DenseW<E>{weight.ptr<const E>(), K}, N, K);
}

template <typename E>
void packed_linear(Request& r) {
  Tensor& packed = r.at("packed");
  const int64_t N = packed.size(0), K = r.scalar_int("K");
  const ex::PackedW<E> w{packed.ptr<const uint8_t>(), packed.size(1), static_cast<int>(r.scalar_int("qtype"))};
  launch_linear<E>(r, w, N, K);
}

// exact.cu's dispatch_16_32, on x's dtype
template <template <typename> class Op>
void dispatch(Request& r) {
  const std::string& dtype = r.at("x").dtype;
  if (dtype == "float32") return Op<float>::run(r);
  if (dtype == "float16") return Op<__half>::run(r);
  if (dtype == "bfloat16") return Op<__nv_bfloat16>::run(r);
  std::fprintf(stderr, "driver: %s: dtype %s not covered\n", r.op.c_str(), dtype.c_str());
  std::exit(2);
}
template <typename E> struct DenseOp { static void run(Request& r) { exact_linear<E>(r); } };
template <typename E> struct PackedOp { static void run(Request& r) { packed_linear<E>(r); } };

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <request> <response>\n", argv[0]);
    return 2;
  }
  Request r = emu::read_request(argv[1]);
  if (r.op == "exact_linear") dispatch<DenseOp>(r);
  else if (r.op == "packed_linear") dispatch<PackedOp>(r);
  else {
    std::fprintf(stderr, "driver: unknown op %s\n", r.op.c_str());
    return 2;
  }
  emu::write_tensors(argv[2], r);
  return 0;
}
