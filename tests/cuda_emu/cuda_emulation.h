// Host emulation of the CUDA features dartree's kernels use, so that a kernel header compiled with
// -DDARTREE_CUDA_EMULATION runs, unchanged, on a machine without a GPU (see
// csrc/include/dartree/tree_attention.cuh). Not fast; faithful where bugs hide:
//
// - Every thread of a block is a fiber (ucontext) with its own stack; blocks run one at a time.
// - The scheduler picks a random runnable fiber at every synchronisation point. __syncthreads()
//   waits for the whole block; warp collectives (__shfl_xor_sync, __syncwarp, mma) wait for the 32
//   lanes of their warp only, so other warps run ahead just as they may on hardware: a missing
//   __syncthreads shows up as wrong results instead of being hidden by lock-step execution.
// - A warp collective that not all 32 lanes reach, or a barrier that never completes, aborts with
//   a deadlock message.
// - Dynamic shared memory is filled with 0xFF (NaN for floats and halves) before every block, so
//   reading shared memory nobody wrote poisons the result.
// - mma.m16n8k16 follows the PTX ISA fragment layouts (A row-major 16x16, B col-major 16x8, C/D
//   16x8 fp32; groupID = lane >> 2, threadID_in_group = lane % 4), independently of the kernels.
// - ldmatrix follows the PTX ISA too (row addresses from lanes 8j..8j+7 for matrix j).
// - cp.async copies at once (or zero-fills) and checks 16-byte alignment of both addresses.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3() = default;
  dim3(unsigned x_, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

namespace emu {

struct Fiber {
  ucontext_t context;
  char* stack = nullptr;
  dim3 thread_idx;
  int linear = 0;
  enum class Wait { None, Warp, Block } wait = Wait::None;
  uint64_t until = 0;        // generation of the warp / block barrier that releases this fiber
  uint64_t warp_calls = 0;   // warp collectives done: picks the exchange buffer (parity)
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
  std::vector<Exchange> exchange;  // [warp][parity][lane]
  std::vector<unsigned char> smem;
  ucontext_t scheduler;
  Fiber* current = nullptr;
  std::function<void()> body;
  std::mt19937_64 rng{12345};
};

inline Block*& block() {
  static Block* active = nullptr;
  return active;
}
inline Fiber& self() { return *block()->current; }

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda emulation: %s\n", what);
  std::abort();
}

inline void yield() { swapcontext(&self().context, &block()->scheduler); }

inline int live_threads(const Block& b) {
  int live = 0;
  for (const Fiber& f : b.fibers) live += !f.done;
  return live;
}

// Arrive at the current warp collective and wait for the warp's other 31 lanes.
inline void warp_sync() {
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

inline void block_sync() {
  Block& b = *block();
  Fiber& f = self();
  const uint64_t generation = b.block_generation;
  if (++b.block_arrived == static_cast<uint64_t>(live_threads(b))) {
    b.block_arrived = 0;
    ++b.block_generation;
  }
  f.wait = Fiber::Wait::Block;
  f.until = generation + 1;
  yield();
}

// This lane's exchange slot for its next warp collective, and the slot of `lane` in the same one.
inline Exchange& my_slot() {
  Block& b = *block();
  Fiber& f = self();
  const uint64_t parity = f.warp_calls & 1;
  return b.exchange[((f.linear / 32) * 2 + parity) * 32 + f.linear % 32];
}
inline const Exchange& slot_of(int lane) {
  Block& b = *block();
  Fiber& f = self();
  const uint64_t parity = (f.warp_calls - 1) & 1;  // after the sync: the collective just done
  return b.exchange[((f.linear / 32) * 2 + parity) * 32 + lane];
}
inline void collective() {
  ++self().warp_calls;
  warp_sync();
}

inline void entry() {
  block()->body();
  self().done = true;
  // Threads that exit no longer count towards __syncthreads (as on sm_70+).
  Block& b = *block();
  if (b.block_arrived > 0 && b.block_arrived == static_cast<uint64_t>(live_threads(b))) {
    b.block_arrived = 0;
    ++b.block_generation;
  }
}

inline bool runnable(const Block& b, const Fiber& f) {
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
inline char* stack(int i) {
  static std::vector<std::unique_ptr<char[]>> pool;
  while (static_cast<int>(pool.size()) <= i) pool.emplace_back(new char[kStackBytes]);
  return pool[i].get();
}

inline void run_block(Block& b) {
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
    f.stack = stack(i);
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &b.scheduler;
    makecontext(&f.context, entry, 0);
  }
  std::vector<int> ready;
  while (true) {
    ready.clear();
    bool all_done = true;
    for (int i = 0; i < threads; ++i) {
      all_done &= b.fibers[i].done;
      if (runnable(b, b.fibers[i])) ready.push_back(i);
    }
    if (all_done) return;
    if (ready.empty()) fail("deadlock: a barrier or warp collective that not every thread reaches");
    Fiber& next = b.fibers[ready[b.rng() % ready.size()]];
    next.wait = Fiber::Wait::None;
    b.current = &next;
    swapcontext(&b.scheduler, &next.context);
  }
}

// Runs kernel(args...) over the grid, block after block.
template <typename Kernel, typename... Args>
void launch(dim3 grid, dim3 block_dim, size_t smem_bytes, Kernel kernel, Args... args) {
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        Block b;
        b.block_idx = dim3(x, y, z);
        b.block_dim = block_dim;
        b.grid_dim = grid;
        b.smem.assign(smem_bytes + 16, 0xFF);
        b.rng.seed((uint64_t(z) * 1000003 + y) * 1000003 + x);
        b.body = [&] { kernel(args...); };
        block() = &b;
        run_block(b);
        block() = nullptr;
      }
}

inline unsigned char* dynamic_smem() {
  auto address = reinterpret_cast<uintptr_t>(block()->smem.data());
  return reinterpret_cast<unsigned char*>((address + 15) & ~uintptr_t(15));
}

// ---- numeric formats (round to nearest even)

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

inline uint16_t float_to_bfloat16(float x) {
  const uint32_t u = bits_of(x);
  if (std::isnan(x)) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
inline float bfloat16_to_float(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0x1F) return float_of(sign | 0x7F800000u | (man << 13));
  if (exp == 0) return (sign ? -1.f : 1.f) * std::ldexp(static_cast<float>(man), -24);
  return float_of(sign | ((exp + 112) << 23) | (man << 13));
}
inline uint16_t float_to_half(float x) {
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
inline void mma_m16n8k16(bool bf16, float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
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
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  if (reinterpret_cast<uintptr_t>(row) % 16) fail("ldmatrix: row address not 16-byte aligned");
  my_slot().value = reinterpret_cast<uintptr_t>(row);
  collective();
  const int lane = self().linear % 32;
  auto element = [](int source_lane, int column) {
    uint16_t x;
    std::memcpy(&x, reinterpret_cast<const char*>(slot_of(source_lane).value) + 2 * column, 2);
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

inline void cp_async_16(void* smem, const void* gmem, bool valid) {
  if (reinterpret_cast<uintptr_t>(smem) % 16) fail("cp.async: shared address not 16-byte aligned");
  if (!valid) {
    std::memset(smem, 0, 16);
    return;
  }
  if (reinterpret_cast<uintptr_t>(gmem) % 16) fail("cp.async: global address not 16-byte aligned");
  std::memcpy(smem, gmem, 16);
}

}  // namespace emu

#define threadIdx (emu::self().thread_idx)
#define blockIdx (emu::block()->block_idx)
#define blockDim (emu::block()->block_dim)
#define gridDim (emu::block()->grid_dim)

inline void __syncthreads() { emu::block_sync(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) emu::fail("__syncwarp: only full-warp masks are emulated");
  emu::collective();
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  static_assert(sizeof(T) <= 8, "shuffle of more than 8 bytes");
  if (mask != 0xffffffffu) emu::fail("__shfl_xor_sync: only full-warp masks are emulated");
  std::memcpy(&emu::my_slot().value, &value, sizeof(T));
  emu::collective();
  T out;
  std::memcpy(&out, &emu::slot_of((emu::self().linear % 32) ^ lane_mask).value, sizeof(T));
  return out;
}
