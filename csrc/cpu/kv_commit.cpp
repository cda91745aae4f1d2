// CPU launcher of kv_commit (kernel: dartree/cpu/kv_commit.h): checks, including the accepted
// values, and the cache groups split over threads.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../checks.h"
#include "dartree/cpu/kv_commit.h"

namespace dartree {

void kv_commit_cpu(at::Tensor kv, int64_t prefix_len, const at::Tensor& accepted) {
  const int64_t groups = check_kv_commit(kv, prefix_len, accepted, /*check_values=*/true);
  const int64_t seq = kv.size(-2);
  const int64_t row_bytes = kv.size(-1) * kv.element_size();
  if (groups == 0 || row_bytes == 0) return;  // empty rows (D = 0) or no rows: nothing to move
  char* base = static_cast<char*>(kv.data_ptr());
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    cpu::kv_commit(base, begin, end, seq, row_bytes, prefix_len, accepted.data_ptr<int64_t>(),
                   accepted.numel());
  });
}

TORCH_LIBRARY_IMPL(dartree, CPU, m) { m.impl("kv_commit", &kv_commit_cpu); }

}  // namespace dartree
