// Data-race detector of the CUDA emulator (included by cuda_emulation.h).
//
// Every load and store of kernel code reaches check_access(): the drivers are compiled with
// -fsanitize=thread, whose instrumentation calls __tsan_read4(addr) & co., defined below (no
// libtsan is linked). The emulator's own code is EMU_INTERNAL (not instrumented) and reports the
// accesses it makes for a kernel itself (ldmatrix, cp.async, atomics).
//
// The rule, on shared and global memory alike, within one block: two accesses of the same byte by
// different threads, at least one a write, race unless
//   - a __syncthreads() (or __syncthreads_or, or a thread's exit) completed between them, or
//   - both threads are in one warp and a __syncwarp() of that warp lies between them, or
//   - both are atomics.
// Shuffles, votes (__ballot_sync, __any_sync), __match_any_sync and mma exchange registers but do
// not order memory (CUDA Programming Guide, warp vote and match functions: "These intrinsics do
// not imply a memory barrier"), so they do not count. Races between blocks are not checked
// (blocks run one after the other), nor accesses to a fiber's own stack (private to its thread).
//
// Determinism: barrier intervals are numbered (Block::epoch, a counter over the whole run) and a
// thread's warp-level position is its count of __syncwarp() calls, so whether two accesses are
// ordered does not depend on the order the scheduler ran them in. Each byte keeps its last write
// and a summary of its reads in the current interval: the read with the most __syncwarp()s, the
// same for the other threads, and whether readers span several warps; that is exact for the rule.
// The first race is printed with both threads, the address and the code of both accesses
// (addr2line), and the run fails.
#pragma once

#include <dlfcn.h>

#include <unordered_map>

namespace emu {

// Code addresses as 32-bit offsets from one function of the driver (all in one executable).
EMU_INTERNAL inline int32_t code_offset(const void* pc) {
  return static_cast<int32_t>(reinterpret_cast<intptr_t>(pc) - reinterpret_cast<intptr_t>(&next_epoch));
}
EMU_INTERNAL inline const void* code_address(int32_t offset) {
  return reinterpret_cast<const void*>(reinterpret_cast<intptr_t>(&next_epoch) + offset);
}

struct Access {  // 16 bytes: the shadow holds three per byte of memory
  uint32_t epoch = 0;  // 0: none
  uint32_t syncwarps = 0;
  uint16_t thread = 0;  // linear index in the block
  bool atomic = false;
  int32_t pc = 0;       // code_offset() of the access
};

struct Cell {
  Access write;
  Access read;        // the read (this interval) with the most __syncwarp()s
  Access read_other;  // the same over the threads other than read.thread
  int32_t read_warp = 0;  // the readers' warp, or -1 when they span several
};

enum Kind { kRead = 0, kWrite = 1, kAtomic = 2 };

struct Shadow {
  static constexpr uintptr_t kPage = 4096;
  std::unordered_map<uintptr_t, std::unique_ptr<Cell[]>> pages;
  uintptr_t last_page = ~uintptr_t(0);
  Cell* last = nullptr;

  // The cells of [address, address + bytes), which must lie in one page.
  EMU_INTERNAL Cell* at(uintptr_t address) {
    const uintptr_t page = address / kPage;
    if (page != last_page) {
      auto& cells = pages[page];
      if (!cells) cells.reset(new Cell[kPage]);
      last_page = page;
      last = cells.get();
    }
    return last + address % kPage;
  }
};

EMU_INTERNAL inline Shadow& shadow() {
  static Shadow s;
  return s;
}

// Named memory (the driver's buffers, dynamic shared memory) for the reports.
EMU_INTERNAL inline std::map<uintptr_t, std::pair<size_t, std::string>>& memory_names() {
  static std::map<uintptr_t, std::pair<size_t, std::string>> names;
  return names;
}
EMU_INTERNAL inline void name_memory(const void* data, size_t bytes, const std::string& name) {
  memory_names()[reinterpret_cast<uintptr_t>(data)] = {bytes, name};
}

EMU_INTERNAL inline std::string describe_address(uintptr_t address) {
  char text[256];
  const DynamicShared& smem = dynamic_shared();
  const auto base = reinterpret_cast<uintptr_t>(smem.data);
  auto& names = memory_names();
  auto it = names.upper_bound(address);
  if (smem.data != nullptr && address >= base && address < base + smem.capacity) {
    std::snprintf(text, sizeof(text), "extern __shared__ + %zu", size_t(address - base));
  } else if (it != names.begin() && address < (--it)->first + it->second.first) {
    std::snprintf(text, sizeof(text), "%s + %zu bytes", it->second.second.c_str(),
                  size_t(address - it->first));
  } else {
    std::snprintf(text, sizeof(text), "%p (a __shared__ variable or unnamed memory)",
                  reinterpret_cast<void*>(address));
  }
  return text;
}

EMU_INTERNAL inline std::string describe_code(const void* pc) {
  Dl_info info;
  if (pc == nullptr || dladdr(pc, &info) == 0) return "?";
  char command[512];
  std::snprintf(command, sizeof(command), "addr2line -C -f -i -p -e '%s' 0x%zx 2>/dev/null",
                info.dli_fname, size_t(reinterpret_cast<uintptr_t>(pc) - 1 -
                                       reinterpret_cast<uintptr_t>(info.dli_fbase)));
  std::string out;
  if (FILE* pipe = popen(command, "r")) {
    char line[512];
    while (std::fgets(line, sizeof(line), pipe)) out += std::string("      ") + line;
    pclose(pipe);
  }
  return out.empty() ? "      ?\n" : out;
}

EMU_INTERNAL inline std::string describe_thread(const Block& b, int linear) {
  const Fiber& f = b.fibers[linear];
  char text[160];
  std::snprintf(text, sizeof(text), "block (%u,%u,%u) thread (%u,%u,%u) [warp %d lane %d]",
                b.block_idx.x, b.block_idx.y, b.block_idx.z, f.thread_idx.x, f.thread_idx.y,
                f.thread_idx.z, linear / 32, linear % 32);
  return text;
}

[[noreturn]] EMU_INTERNAL inline void report_race(uintptr_t address, const char* what,
                                                  const Access& now, const Access& before,
                                                  const char* before_what) {
  const Block& b = *block();
  std::fprintf(stderr,
               "cuda emulation: DATA RACE on %s\n"
               "  %s by %s at\n%s"
               "  %s by %s at\n%s"
               "  with no __syncthreads() (or __syncwarp() of their warp) between them\n",
               describe_address(address).c_str(), what, describe_thread(b, now.thread).c_str(),
               describe_code(code_address(now.pc)).c_str(), before_what, describe_thread(b, before.thread).c_str(),
               describe_code(code_address(before.pc)).c_str());
  fail("data race");
}

// Whether `before` (an access of this interval or an earlier one) is ordered before `now`.
EMU_INTERNAL inline bool ordered(const Access& before, const Access& now) {
  if (before.epoch != now.epoch || before.thread == now.thread) return true;
  return before.thread / 32 == now.thread / 32 && now.syncwarps > before.syncwarps;
}

EMU_INTERNAL inline void check_byte(Cell& c, uintptr_t address, int kind, const Access& now) {
  const bool atomic = kind & kAtomic;
  if (c.write.epoch != 0 && !ordered(c.write, now) && !(atomic && c.write.atomic)) {
    report_race(address, kind == kRead ? "read" : atomic ? "atomic" : "write", now, c.write,
                c.write.atomic ? "after an atomic" : "after a write");
  }
  const int warp = now.thread / 32;
  if (kind == kRead) {
    if (c.read.epoch != now.epoch) {
      c.read = now;
      c.read_other = Access{};
      c.read_warp = warp;
      return;
    }
    if (c.read_warp != warp) c.read_warp = -1;
    if (now.thread == c.read.thread) {
      c.read = now;
    } else if (now.syncwarps >= c.read.syncwarps) {
      c.read_other = c.read;
      c.read = now;
    } else if (c.read_other.epoch == 0 || now.syncwarps >= c.read_other.syncwarps) {
      c.read_other = now;
    }
    return;
  }
  if (c.read.epoch == now.epoch) {  // reads of this interval, by other threads
    const Access& other = c.read.thread != now.thread ? c.read : c.read_other;
    if (other.epoch != 0 && (c.read_warp != warp || !ordered(other, now))) {
      report_race(address, atomic ? "atomic" : "write", now, other, "after a read");
    }
  }
  c.write = now;
  c.write.atomic = atomic;
}

// An access of `bytes` bytes at `address` by the running thread; pc: the code that made it.
EMU_INTERNAL inline void check_access(const void* address, size_t bytes, int kind, const void* pc) {
  static bool busy = false;  // the detector's own std::map code is instrumented too
  Block* b = block();
  if (busy || b == nullptr || b->current == nullptr || b->current->done) return;  // host code
  const Fiber& f = *b->current;
  const auto a = reinterpret_cast<uintptr_t>(address);
  const auto stack_begin = reinterpret_cast<uintptr_t>(f.stack);
  if (a >= stack_begin && a < stack_begin + kStackBytes) return;  // the thread's own locals
  Access now;
  now.epoch = b->epoch;
  now.syncwarps = f.syncwarps;
  now.thread = static_cast<uint16_t>(f.linear);
  now.pc = code_offset(pc);
  busy = true;
  for (uintptr_t i = a, end = a + bytes; i < end;) {
    const uintptr_t stop = std::min(end, (i / Shadow::kPage + 1) * Shadow::kPage);
    Cell* cells = shadow().at(i);
    for (; i < stop; ++i, ++cells) check_byte(*cells, i, kind, now);
  }
  busy = false;
}

}  // namespace emu

// The calls -fsanitize=thread inserts (GCC's builtin signatures).
#define EMU_TSAN_HOOKS(n)                                                                        \
  extern "C" EMU_INTERNAL void __tsan_read##n(void* p) {                                         \
    emu::check_access(p, n, emu::kRead, __builtin_return_address(0));                           \
  }                                                                                              \
  extern "C" EMU_INTERNAL void __tsan_write##n(void* p) {                                        \
    emu::check_access(p, n, emu::kWrite, __builtin_return_address(0));                          \
  }                                                                                              \
  extern "C" EMU_INTERNAL void __tsan_unaligned_read##n(void* p) {                               \
    emu::check_access(p, n, emu::kRead, __builtin_return_address(0));                           \
  }                                                                                              \
  extern "C" EMU_INTERNAL void __tsan_unaligned_write##n(void* p) {                              \
    emu::check_access(p, n, emu::kWrite, __builtin_return_address(0));                          \
  }
EMU_TSAN_HOOKS(1)
EMU_TSAN_HOOKS(2)
EMU_TSAN_HOOKS(4)
EMU_TSAN_HOOKS(8)
EMU_TSAN_HOOKS(16)
#undef EMU_TSAN_HOOKS
extern "C" EMU_INTERNAL void __tsan_read_range(void* p, unsigned long n) {
  emu::check_access(p, n, emu::kRead, __builtin_return_address(0));
}
extern "C" EMU_INTERNAL void __tsan_write_range(void* p, unsigned long n) {
  emu::check_access(p, n, emu::kWrite, __builtin_return_address(0));
}
extern "C" EMU_INTERNAL void __tsan_init() {}
extern "C" EMU_INTERNAL void __tsan_func_entry(void*) {}
extern "C" EMU_INTERNAL void __tsan_func_exit(void*) {}
