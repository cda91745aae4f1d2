// CPU KV commit (op kv_commit; the CUDA twin: dartree/kv_commit.cuh): for each of `groups` caches
// of seq rows of row_bytes, row prefix_len + j = row prefix_len + accepted[j] for j < count.
// Rows move forward only (accepted[j] >= j, increasing), so walking j upwards never reads a row it
// wrote. Work: groups [begin, end) of one task, one memcpy per moved row (reads and writes
// count * row_bytes per group). Assumes accepted values checked by the launcher.
#pragma once
#include <cstdint>
#include <cstring>

namespace dartree {
namespace cpu {

inline void kv_commit(char* base, int64_t begin, int64_t end, int64_t seq, int64_t row_bytes,
                      int64_t prefix_len, const int64_t* accepted, int64_t count) {
  for (int64_t g = begin; g < end; ++g) {
    char* rows = base + (g * seq + prefix_len) * row_bytes;
    for (int64_t j = 0; j < count; ++j) {
      if (accepted[j] != j) std::memcpy(rows + j * row_bytes, rows + accepted[j] * row_bytes, row_bytes);
    }
  }
}

}  // namespace cpu
}  // namespace dartree
