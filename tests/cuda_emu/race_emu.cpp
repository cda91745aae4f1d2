// Tiny kernels with and without a planted data race, for tests/test_cuda_emulator.py: the race
// detector (race_check.h) must flag every `racy_*` kernel and none of the `clean_*` ones.
//   race_emu <kernel>   prints "ok" and exits 0 when the kernel ran without a reported race
#include "cuda_emulation.h"

#include <cstring>
#include <string>

// Two warps: thread 0 writes, thread 32 (another warp) reads, with or without a barrier.
__global__ void shared_write_read(bool barrier, int* out) {
  __shared__ int value;
  if (threadIdx.x == 0) value = 42;
  if (barrier) __syncthreads();
  if (threadIdx.x == 32) out[0] = value;
}

// One warp: lane 0 writes, lane 1 reads after a shuffle (orders nothing) or a __syncwarp().
__global__ void warp_write_read(bool syncwarp, int* out) {
  __shared__ int value;
  if (threadIdx.x == 0) value = 7;
  int x = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1);
  if (syncwarp) __syncwarp();
  if (threadIdx.x == 1) out[0] = value + x;
}

// Every thread reads, then thread 0 overwrites: a write after other threads' reads.
__global__ void read_then_write(bool barrier, int* out) {
  __shared__ int value;
  if (threadIdx.x == 0) value = 1;
  __syncthreads();
  out[threadIdx.x] = value;
  if (barrier) __syncthreads();
  if (threadIdx.x == 0) value = 2;
}

// Atomics on one counter do not race with each other; a plain read of it before the barrier does.
__global__ void atomic_counter(bool read_early, int* out) {
  __shared__ int count;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  atomicAdd(&count, 1);
  if (!read_early) __syncthreads();
  if (threadIdx.x == 63) out[0] = count;
}

// Global memory: thread 0 writes out[0], thread 40 reads it.
__global__ void global_write_read(bool barrier, int* out) {
  if (threadIdx.x == 0) out[0] = 5;
  if (barrier) __syncthreads();
  if (threadIdx.x == 40) out[1] = out[0];
}

// A 16-bit store next to another thread's: bytes that do not overlap do not race.
__global__ void adjacent_halves(bool overlap, uint16_t* out) {
  const int i = threadIdx.x;
  if (i < 2) out[overlap ? 0 : i] = static_cast<uint16_t>(i + 1);
}

int main(int argc, char** argv) {
  const std::string name = argc > 1 ? argv[1] : "";
  int out[64] = {};
  uint16_t halves[2] = {};
  emu::name_memory(out, sizeof(out), "out");
  const bool racy = name.rfind("racy_", 0) == 0;
  const std::string kernel = name.substr(name.find('_') + 1);
  if (kernel == "shared_write_read") emu::launch(dim3(1), dim3(64), 0, shared_write_read, !racy, out);
  else if (kernel == "warp_write_read") emu::launch(dim3(1), dim3(32), 0, warp_write_read, !racy, out);
  else if (kernel == "read_then_write") emu::launch(dim3(1), dim3(64), 0, read_then_write, !racy, out);
  else if (kernel == "atomic_counter") emu::launch(dim3(1), dim3(64), 0, atomic_counter, racy, out);
  else if (kernel == "global_write_read") emu::launch(dim3(1), dim3(64), 0, global_write_read, !racy, out);
  else if (kernel == "adjacent_halves") emu::launch(dim3(1), dim3(64), 0, adjacent_halves, racy, halves);
  else return 2;
  std::printf("ok\n");
  return 0;
}
