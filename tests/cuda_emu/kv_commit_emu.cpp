// Runs the CUDA KV-commit kernel (csrc/include/dartree/kv_commit.cuh), unchanged, under the host
// emulator with its race detector, launched as csrc/cuda/kv_commit.cu launches it (the widest word
// that divides a row and the base address, 256 threads a block). Driven by
// tests/test_cuda_emulator.py:  kv_commit_emu <request> <response>  (tensor_io.h): op kv_commit
// with kv (updated in place), accepted [A] int64 and prefix_len.
#include "tensor_io.h"

#include "dartree/kv_commit.cuh"

namespace {

template <typename Word>
void launch_kv_commit(emu::Tensor& kv, int64_t prefix_len, const emu::Tensor& accepted) {
  const int64_t seq = kv.size(-2);
  const int64_t element = static_cast<int64_t>(kv.bytes / std::max<int64_t>(1, kv.numel()));
  const int64_t words = kv.size(-1) * element / static_cast<int64_t>(sizeof(Word));
  const int64_t groups = kv.numel() / (seq * kv.size(-1));
  const int64_t threads = groups * words;
  if (threads == 0) return;
  constexpr int kBlock = 256;
  const int64_t blocks = (threads + kBlock - 1) / kBlock;
  emu::launch(dim3(static_cast<unsigned>(blocks)), dim3(kBlock), 0, dartree::kv_commit_kernel<Word>,
              kv.ptr<Word>(), accepted.ptr<const int64_t>(), groups, seq, words, prefix_len,
              accepted.numel());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  emu::Request r = emu::read_request(argv[1]);
  if (r.op != "kv_commit") return 2;
  emu::Tensor& kv = r.at("kv");
  const int64_t prefix = r.scalar_int("prefix_len");
  const int64_t row_bytes = static_cast<int64_t>(kv.bytes / std::max<int64_t>(1, kv.numel())) * kv.size(-1);
  const auto address = reinterpret_cast<uintptr_t>(kv.data);
  if (row_bytes % 16 == 0 && address % 16 == 0) launch_kv_commit<uint4>(kv, prefix, r.at("accepted"));
  else if (row_bytes % 4 == 0 && address % 4 == 0) launch_kv_commit<uint32_t>(kv, prefix, r.at("accepted"));
  else launch_kv_commit<uint8_t>(kv, prefix, r.at("accepted"));
  emu::write_tensors(argv[2], r);
  return 0;
}
