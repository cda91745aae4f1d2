// CPU twin of csrc/include/dartree/kv_commit.cuh: same contract, rows moved with memcpy.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "../checks.h"

namespace dartree {

void kv_commit_cpu(at::Tensor kv, int64_t prefix_len, const at::Tensor& accepted) {
  const int64_t groups = check_kv_commit(kv, prefix_len, accepted, /*check_values=*/true);
  const int64_t seq = kv.size(-2);
  const int64_t row_bytes = kv.size(-1) * kv.element_size();
  const int64_t* idx = accepted.data_ptr<int64_t>();
  const int64_t count = accepted.numel();
  if (groups == 0 || row_bytes == 0) return;  // empty rows (D = 0) or no rows: nothing to move
  char* base = static_cast<char*>(kv.data_ptr());
  // Rows move forward only (accepted[j] >= j), so walking j upwards never reads a row it wrote.
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      char* rows = base + (g * seq + prefix_len) * row_bytes;
      for (int64_t j = 0; j < count; ++j) {
        if (idx[j] != j) std::memcpy(rows + j * row_bytes, rows + idx[j] * row_bytes, row_bytes);
      }
    }
  });
}

TORCH_LIBRARY_IMPL(dartree, CPU, m) { m.impl("kv_commit", &kv_commit_cpu); }

}  // namespace dartree
