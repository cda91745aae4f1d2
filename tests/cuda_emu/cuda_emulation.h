// Host emulation of the CUDA features dartree's kernels use, so that a kernel header compiled with
// -DDARTREE_CUDA_EMULATION runs, unchanged, on a machine without a GPU (see
// csrc/include/dartree/tree_attention.cuh). Not fast; faithful where bugs hide:
//
// - Every thread of a block is a fiber with its own stack (started by ucontext, switched by
//   _setjmp/_longjmp, which skip the signal-mask syscall); blocks run one at a time.
// - The scheduler runs the runnable fibers in a random order (seeded), each to its next
//   synchronisation point. __syncthreads() waits for the whole block; warp collectives
//   (__shfl_xor_sync, __syncwarp, mma) wait for the 32 lanes of their warp only, so other warps
//   run ahead just as they may on hardware. A missing barrier is reported by the race detector.
// - A warp collective that not all 32 lanes reach, or a barrier that never completes, aborts with
//   a deadlock message.
// - Dynamic shared memory is filled with 0xFF (NaN for floats and halves) before every block, so
//   reading shared memory nobody wrote poisons the result.
// - mma.m16n8k16 follows the PTX ISA fragment layouts (A row-major 16x16, B col-major 16x8, C/D
//   16x8 fp32; groupID = lane >> 2, threadID_in_group = lane % 4), independently of the kernels.
// - ldmatrix follows the PTX ISA too (row addresses from lanes 8j..8j+7 for matrix j).
// - cp.async copies at once (or zero-fills) and checks 16-byte alignment of both addresses.
// - `__shared__` variables are thread_local: one copy shared by all fibers (they run on one OS
//   thread); `extern __shared__` arrays are defined by the driver and given to
//   emu::set_dynamic_shared, which poisons them (0xFF) before every block like Block::smem.
// - Every memory access of kernel code is checked for data races (race_check.h): the driver is
//   compiled with -fsanitize=thread, whose instrumentation calls land in the detector, not in
//   libtsan. The emulator's own code is not instrumented (EMU_INTERNAL).
#pragma once

#ifndef __SANITIZE_THREAD__
#error "compile the emulator drivers with -fsanitize=thread: the race detector hooks its instrumentation"
#endif

#include <setjmp.h>
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <memory>
#include <random>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3() = default;
  dim3(unsigned x_, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct uint4 {
  unsigned x, y, z, w;
};

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ thread_local
#define __align__(n) __attribute__((aligned(n)))
#define EMU_INTERNAL __attribute__((no_sanitize("thread")))

// CUDA's float overloads of the math functions (exp(float) is expf on the device)
using std::exp;
using std::fmax;
using std::isinf;
using std::log;
using std::tanh;
// fmaf, expf, fmaxf are C's own: fmaf is libm's fused multiply-add (one rounding, as on the
// device; never a*b+c), tested by tests/test_cuda_emulator_exact.py.

namespace emu {

struct Fiber {
  ucontext_t context;  // first entry only: switches are _setjmp/_longjmp (no signal-mask syscall)
  jmp_buf jump;
  bool started = false;
  char* stack = nullptr;
  dim3 thread_idx;
  int linear = 0;
  enum class Wait { None, Warp, Block } wait = Wait::None;
  uint64_t until = 0;        // generation of the warp / block barrier that releases this fiber
  uint64_t warp_calls = 0;   // warp collectives done: picks the exchange buffer (parity)
  uint32_t syncwarps = 0;    // __syncwarp() calls done: the race detector's warp-level order
  bool done = false;
};

struct Exchange {  // one lane's operands of a warp collective
  uint32_t a[4];
  uint32_t b[2];
  uint64_t value;
};

struct Block {
  dim3 block_idx, block_dim, grid_dim;
  std::vector<Fiber> fibers;
  std::vector<uint64_t> warp_generation, warp_arrived;
  uint64_t block_generation = 0, block_arrived = 0;
  int votes[2] = {0, 0};     // __syncthreads_or / _count, by barrier generation parity
  uint32_t epoch = 0;        // race detector: this block's current barrier interval
  int live = 0;              // threads not exited
  std::vector<Exchange> exchange;  // [warp][parity][lane]
  std::vector<unsigned char> smem;
  jmp_buf scheduler;
  Fiber* current = nullptr;
  std::function<void()> body;
  std::mt19937_64 rng{12345};
};

EMU_INTERNAL inline Block*& block() {
  static Block* active = nullptr;
  return active;
}
EMU_INTERNAL inline Fiber& self() { return *block()->current; }

[[noreturn]] EMU_INTERNAL inline void fail(const char* what) {
  std::fprintf(stderr, "cuda emulation: %s\n", what);
  std::abort();
}

EMU_INTERNAL inline void yield() {
  if (_setjmp(self().jump) == 0) _longjmp(block()->scheduler, 1);
}

EMU_INTERNAL inline int live_threads(const Block& b) { return b.live; }

// Arrive at the current warp collective and wait for the warp's other 31 lanes.
EMU_INTERNAL inline void warp_sync() {
  Block& b = *block();
  Fiber& f = self();
  const int warp = f.linear / 32;
  const uint64_t generation = b.warp_generation[warp];
  if (++b.warp_arrived[warp] == 32) {
    b.warp_arrived[warp] = 0;
    ++b.warp_generation[warp];
  }
  f.wait = Fiber::Wait::Warp;
  f.until = generation + 1;
  yield();
}

// Barrier intervals, numbered across all blocks and launches (the race detector's clock).
EMU_INTERNAL inline uint32_t next_epoch() {
  static uint32_t epoch = 0;
  return ++epoch;
}

EMU_INTERNAL inline void complete_barrier(Block& b) {
  b.block_arrived = 0;
  ++b.block_generation;
  b.votes[b.block_generation & 1] = 0;  // the next barrier's tally
  b.epoch = next_epoch();
}

// __syncthreads(); `vote` is added to the barrier's tally, which is returned.
EMU_INTERNAL inline int block_sync(int vote = 0) {
  Block& b = *block();
  Fiber& f = self();
  const uint64_t generation = b.block_generation;
  b.votes[generation & 1] += vote;
  if (++b.block_arrived == static_cast<uint64_t>(live_threads(b))) complete_barrier(b);
  f.wait = Fiber::Wait::Block;
  f.until = generation + 1;
  yield();
  return b.votes[generation & 1];  // not reset before this thread reaches the next barrier
}

// This lane's exchange slot for its next warp collective, and the slot of `lane` in the same one.
EMU_INTERNAL inline Exchange& my_slot() {
  Block& b = *block();
  Fiber& f = self();
  const uint64_t parity = f.warp_calls & 1;
  return b.exchange[((f.linear / 32) * 2 + parity) * 32 + f.linear % 32];
}
EMU_INTERNAL inline const Exchange& slot_of(int lane) {
  Block& b = *block();
  Fiber& f = self();
  const uint64_t parity = (f.warp_calls - 1) & 1;  // after the sync: the collective just done
  return b.exchange[((f.linear / 32) * 2 + parity) * 32 + lane];
}
EMU_INTERNAL inline void collective() {
  ++self().warp_calls;
  warp_sync();
}

EMU_INTERNAL inline void entry() {
  block()->body();
  self().done = true;
  --block()->live;
  // Threads that exit no longer count towards __syncthreads (as on sm_70+).
  Block& b = *block();
  if (b.block_arrived > 0 && b.block_arrived == static_cast<uint64_t>(live_threads(b))) {
    complete_barrier(b);
  }
  _longjmp(b.scheduler, 1);  // a fiber's function never returns
}

EMU_INTERNAL inline bool runnable(const Block& b, const Fiber& f) {
  if (f.done) return false;
  switch (f.wait) {
    case Fiber::Wait::None: return true;
    case Fiber::Wait::Warp: return b.warp_generation[f.linear / 32] >= f.until;
    case Fiber::Wait::Block: return b.block_generation >= f.until;
  }
  return false;
}

constexpr size_t kStackBytes = 256 * 1024;

// Fiber stacks, kept for the whole run (untouched pages cost nothing).
EMU_INTERNAL inline char* stack(int i) {
  static std::vector<std::unique_ptr<char[]>> pool;
  while (static_cast<int>(pool.size()) <= i) pool.emplace_back(new char[kStackBytes]);
  return pool[i].get();
}

EMU_INTERNAL inline void run_block(Block& b) {
  const int threads = static_cast<int>(b.block_dim.x * b.block_dim.y * b.block_dim.z);
  if (threads % 32) fail("block size must be a multiple of 32");
  b.fibers.resize(threads);
  b.warp_generation.assign(threads / 32, 0);
  b.warp_arrived.assign(threads / 32, 0);
  b.exchange.assign(static_cast<size_t>(threads) * 2, Exchange{});
  for (int i = 0; i < threads; ++i) {
    Fiber& f = b.fibers[i];
    f.linear = i;
    f.thread_idx = dim3(i % b.block_dim.x, (i / b.block_dim.x) % b.block_dim.y,
                        i / (b.block_dim.x * b.block_dim.y));
    f.wait = Fiber::Wait::None;
    f.done = false;
    f.warp_calls = 0;
    f.syncwarps = 0;
    f.stack = stack(i);
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    f.started = false;
    makecontext(&f.context, entry, 0);
  }
  b.votes[0] = b.votes[1] = 0;
  b.epoch = next_epoch();
  b.live = threads;
  // Rounds: the runnable fibers in a random order, each run to its next synchronisation point
  // if still runnable when its turn comes. (Raw arrays: STL code here would be instrumented.)
  Fiber* fibers = b.fibers.data();
  std::unique_ptr<int[]> round(new int[threads]);
  while (b.live > 0) {
    int n = 0;
    for (int i = 0; i < threads; ++i) {
      if (runnable(b, fibers[i])) round[n++] = i;
    }
    if (n == 0) fail("deadlock: a barrier or warp collective that not every thread reaches");
    for (int i = n - 1; i > 0; --i) std::swap(round[i], round[b.rng() % (i + 1)]);
    for (int k = 0; k < n; ++k) {
      Fiber& next = fibers[round[k]];
      if (!runnable(b, next)) continue;
      next.wait = Fiber::Wait::None;
      b.current = &next;
      if (_setjmp(b.scheduler) == 0) {
        if (!next.started) {
          next.started = true;
          setcontext(&next.context);
        }
        _longjmp(next.jump, 1);
      }
      b.current = nullptr;  // the scheduler's own code is no thread's
    }
  }
}

// The `extern __shared__` array of the kernels in the driver (a thread_local it defines).
struct DynamicShared {
  unsigned char* data = nullptr;
  size_t capacity = 0;
};
EMU_INTERNAL inline DynamicShared& dynamic_shared() {
  static DynamicShared region;
  return region;
}
EMU_INTERNAL inline void set_dynamic_shared(void* data, size_t capacity) {
  dynamic_shared() = DynamicShared{static_cast<unsigned char*>(data), capacity};
}

// Runs kernel(args...) over the grid, block after block.
template <typename Kernel, typename... Args>
EMU_INTERNAL void launch(dim3 grid, dim3 block_dim, size_t smem_bytes, Kernel kernel, Args... args) {
  DynamicShared& extern_smem = dynamic_shared();
  if (extern_smem.data != nullptr && smem_bytes > extern_smem.capacity) {
    fail("launch: more dynamic shared memory than the driver's extern __shared__ array holds");
  }
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        Block b;
        b.block_idx = dim3(x, y, z);
        b.block_dim = block_dim;
        b.grid_dim = grid;
        b.smem.assign(smem_bytes + 16, 0xFF);
        if (extern_smem.data != nullptr) std::memset(extern_smem.data, 0xFF, smem_bytes);
        b.rng.seed((uint64_t(z) * 1000003 + y) * 1000003 + x);
        b.body = [&]() EMU_INTERNAL { kernel(args...); };
        block() = &b;
        run_block(b);
        block() = nullptr;
      }
}

EMU_INTERNAL inline unsigned char* dynamic_smem() {
  auto address = reinterpret_cast<uintptr_t>(block()->smem.data());
  return reinterpret_cast<unsigned char*>((address + 15) & ~uintptr_t(15));
}

}  // namespace emu

#include "race_check.h"

namespace emu {

// ---- numeric formats (round to nearest even)

EMU_INTERNAL inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
EMU_INTERNAL inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

EMU_INTERNAL inline uint16_t float_to_bfloat16(float x) {
  const uint32_t u = bits_of(x);
  if (std::isnan(x)) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
EMU_INTERNAL inline float bfloat16_to_float(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

EMU_INTERNAL inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0x1F) return float_of(sign | 0x7F800000u | (man << 13));
  if (exp == 0) return (sign ? -1.f : 1.f) * std::ldexp(static_cast<float>(man), -24);
  return float_of(sign | ((exp + 112) << 23) | (man << 13));
}
EMU_INTERNAL inline uint16_t float_to_half(float x) {
  if (std::isnan(x)) return 0x7E00;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 65520.0) return sign | 0x7C00;  // rounds to infinity
  // value = m * 2^(e - 10) with m in [1024, 2048) for normals; subnormals have e = -14 fixed.
  int e = a == 0 ? -14 : std::ilogb(a);
  if (e < -14) e = -14;
  const double scaled = std::nearbyint(std::ldexp(a, 10 - e));  // current rounding: to even
  uint32_t m = static_cast<uint32_t>(scaled);
  if (m == 2048) {
    m = 1024;
    ++e;
  }
  if (m < 1024) return sign | static_cast<uint16_t>(m);  // subnormal (e == -14)
  return sign | static_cast<uint16_t>(((e + 15) << 10) | (m - 1024));
}

// ---- warp-level primitives

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32: c += A B.
EMU_INTERNAL inline void mma_m16n8k16(bool bf16, float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Exchange& mine = my_slot();
  std::memcpy(mine.a, a, sizeof(mine.a));
  mine.b[0] = b0;
  mine.b[1] = b1;
  collective();
  auto value = [bf16](uint32_t reg, int half) {
    const auto bits = static_cast<uint16_t>(half ? reg >> 16 : reg & 0xFFFF);
    return bf16 ? bfloat16_to_float(bits) : half_to_float(bits);
  };
  // A[row][k]: row groupID (+8 for a2,a3,a6,a7), k = 2*tig + (i&1) (+8 for a4..a7)
  auto A = [&](int row, int k) {
    const int lane = (row % 8) * 4 + (k % 8) / 2;
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return value(slot_of(lane).a[reg], k % 2);
  };
  // B[k][col]: k = 2*tig + (i&1) (+8 for b2,b3), col = groupID
  auto B = [&](int k, int col) {
    const int lane = col * 4 + (k % 8) / 2;
    return value(slot_of(lane).b[k >= 8 ? 1 : 0], k % 2);
  };
  const int lane = self().linear % 32, group = lane >> 2, tig = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = group + (i >= 2 ? 8 : 0), col = 2 * tig + (i & 1);
    double sum = 0;
    for (int k = 0; k < 16; ++k) sum += static_cast<double>(A(row, k)) * B(k, col);
    c[i] = static_cast<float>(c[i] + sum);
  }
}

// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16: lanes 8j..8j+7 hold the row addresses of
// matrix j; lane l gets, in register j, row l/4 elements 2(l%4), 2(l%4)+1 (with .trans: column
// l/4, rows 2(l%4), 2(l%4)+1), lower element in the low half.
EMU_INTERNAL inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  if (reinterpret_cast<uintptr_t>(row) % 16) fail("ldmatrix: row address not 16-byte aligned");
  my_slot().value = reinterpret_cast<uintptr_t>(row);
  collective();
  const int lane = self().linear % 32;
  auto element = [](int source_lane, int column) EMU_INTERNAL {
    uint16_t x;
    const char* from = reinterpret_cast<const char*>(slot_of(source_lane).value) + 2 * column;
    check_access(from, 2, kRead, __builtin_return_address(0));
    std::memcpy(&x, from, 2);
    return static_cast<uint32_t>(x);
  };
  for (int j = 0; j < 4; ++j) {
    if (trans) {
      const int row0 = 8 * j + 2 * (lane % 4);
      r[j] = element(row0, lane / 4) | (element(row0 + 1, lane / 4) << 16);
    } else {
      const int source = 8 * j + lane / 4;
      r[j] = element(source, 2 * (lane % 4)) | (element(source, 2 * (lane % 4) + 1) << 16);
    }
  }
}

EMU_INTERNAL inline void cp_async_16(void* smem, const void* gmem, bool valid) {
  if (reinterpret_cast<uintptr_t>(smem) % 16) fail("cp.async: shared address not 16-byte aligned");
  check_access(smem, 16, kWrite, __builtin_return_address(0));
  if (!valid) {
    std::memset(smem, 0, 16);
    return;
  }
  if (reinterpret_cast<uintptr_t>(gmem) % 16) fail("cp.async: global address not 16-byte aligned");
  check_access(gmem, 16, kRead, __builtin_return_address(0));
  std::memcpy(smem, gmem, 16);
}

}  // namespace emu

#define threadIdx (emu::self().thread_idx)
#define blockIdx (emu::block()->block_idx)
#define blockDim (emu::block()->block_dim)
#define gridDim (emu::block()->grid_dim)

EMU_INTERNAL inline void __syncthreads() { emu::block_sync(); }
EMU_INTERNAL inline int __syncthreads_or(int predicate) { return emu::block_sync(predicate != 0) != 0; }
EMU_INTERNAL inline int __syncthreads_count(int predicate) { return emu::block_sync(predicate != 0); }
EMU_INTERNAL inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) emu::fail("__syncwarp: only full-warp masks are emulated");
  ++emu::self().syncwarps;  // orders memory within the warp (shuffles and votes do not)
  emu::collective();
}

namespace emu {
// Each lane's 64-bit operand to its warp; returns the 32 of them.
template <typename T>
EMU_INTERNAL void warp_gather(unsigned mask, const char* what, T value, T (&all)[32]) {
  static_assert(sizeof(T) <= 8, "warp operand of more than 8 bytes");
  if (mask != 0xffffffffu) {
    std::fprintf(stderr, "cuda emulation: %s: only full-warp masks are emulated\n", what);
    std::abort();
  }
  my_slot().value = 0;
  std::memcpy(&my_slot().value, &value, sizeof(T));
  collective();
  for (int lane = 0; lane < 32; ++lane) std::memcpy(&all[lane], &slot_of(lane).value, sizeof(T));
}
}  // namespace emu

EMU_INTERNAL inline unsigned __ballot_sync(unsigned mask, int predicate) {
  int all[32];
  emu::warp_gather(mask, "__ballot_sync", predicate, all);
  unsigned ballot = 0;
  for (int lane = 0; lane < 32; ++lane) ballot |= (all[lane] != 0 ? 1u : 0u) << lane;
  return ballot;
}
EMU_INTERNAL inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
EMU_INTERNAL inline int __all_sync(unsigned mask, int predicate) {
  return __ballot_sync(mask, predicate) == 0xffffffffu;
}
template <typename T>
EMU_INTERNAL unsigned __match_any_sync(unsigned mask, T value) {
  T all[32];
  emu::warp_gather(mask, "__match_any_sync", value, all);
  unsigned peers = 0;
  for (int lane = 0; lane < 32; ++lane) peers |= (all[lane] == value ? 1u : 0u) << lane;
  return peers;
}

EMU_INTERNAL inline int __popc(unsigned x) { return __builtin_popcount(x); }
EMU_INTERNAL inline int __ffs(int x) { return __builtin_ffs(x); }
EMU_INTERNAL inline unsigned __float_as_uint(float x) { return emu::bits_of(x); }
EMU_INTERNAL inline long long __double_as_longlong(double x) {
  long long u;
  std::memcpy(&u, &x, 8);
  return u;
}
// Host arithmetic rounds to nearest and does not contract these (no -ffast-math, -ffp-contract=off)
EMU_INTERNAL inline float __fmul_rn(float a, float b) { return a * b; }
EMU_INTERNAL inline float __fadd_rn(float a, float b) { return a + b; }
EMU_INTERNAL inline double __dmul_rn(double a, double b) { return a * b; }
EMU_INTERNAL inline double __dadd_rn(double a, double b) { return a + b; }

// Atomics: fibers switch only at barriers and collectives, so a read-modify-write is atomic; the
// race detector sees it as an atomic access.
template <typename T, typename Op>
EMU_INTERNAL T atomic_update(T* address, const Op& op, const void* pc) {
  emu::check_access(address, sizeof(T), emu::kWrite | emu::kAtomic, pc);
  const T old = *address;
  *address = op(old);
  return old;
}
template <typename T>
EMU_INTERNAL T atomicAdd(T* address, T value) {
  return atomic_update(address, [value](T old) EMU_INTERNAL { return old + value; }, __builtin_return_address(0));
}
template <typename T>
EMU_INTERNAL T atomicExch(T* address, T value) {
  return atomic_update(address, [value](T) EMU_INTERNAL { return value; }, __builtin_return_address(0));
}
template <typename T>
EMU_INTERNAL T atomicMax(T* address, T value) {
  return atomic_update(address, [value](T old) EMU_INTERNAL { return old > value ? old : value; }, __builtin_return_address(0));
}

template <typename T>
EMU_INTERNAL T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  static_assert(sizeof(T) <= 8, "shuffle of more than 8 bytes");
  if (mask != 0xffffffffu) emu::fail("__shfl_xor_sync: only full-warp masks are emulated");
  std::memcpy(&emu::my_slot().value, &value, sizeof(T));
  emu::collective();
  T out;
  std::memcpy(&out, &emu::slot_of((emu::self().linear % 32) ^ lane_mask).value, sizeof(T));
  return out;
}
