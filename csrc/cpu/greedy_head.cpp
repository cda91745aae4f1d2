// CPU launcher of greedy_head and greedy_head_bounds (kernels and the bound:
// dartree/cpu/greedy_head.h): checks, the rows' quantisation, the code groups split over threads,
// then each row's candidates computed exactly by packed_linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "../packed_checks.h"
#include "dartree/cpu/greedy_head.h"
#include "dartree/cpu/sample_keyed.h"
#include "launchers.h"

namespace dartree {
namespace {

namespace gh = cpu::greedy;

// x float32 [T, K] (K a multiple of 32), codes uint8 [G, K / 4, 64], stats float32 [3, 16 G]
// (scale, err, qnorm of each column), V columns: 16 (G - 1) < V <= 16 G.
void check_codes(const char* op, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& stats, int64_t V) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": x must be float32 [T, K], got ",
                    x.scalar_type(), " ", x.sizes());
  const int64_t K = x.size(1);
  TORCH_CHECK_VALUE(K > 0 && K % gh::kBlock == 0, op, ": K must be a positive multiple of ", gh::kBlock, ", got ", K);
  TORCH_CHECK_VALUE(V > 0, op, ": V must be positive, got ", V);
  const int64_t G = (V + gh::kCols - 1) / gh::kCols;
  TORCH_CHECK_VALUE(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(0) == G &&
                        codes.size(1) == K / 4 && codes.size(2) == 4 * gh::kCols,
                    op, ": codes must be uint8 [", G, ", ", K / 4, ", 64] for V = ", V, " and K = ", K, ", got ",
                    codes.scalar_type(), " ", codes.sizes());
  TORCH_CHECK_VALUE(stats.dim() == 2 && stats.scalar_type() == at::kFloat && stats.size(0) == 3 &&
                        stats.size(1) == G * gh::kCols,
                    op, ": stats must be float32 [3, ", G * gh::kCols, "], got ", stats.scalar_type(), " ",
                    stats.sizes());
  for (const at::Tensor* t : {&x, &codes, &stats})
    TORCH_CHECK_VALUE(t->device().is_cpu(), op, ": every tensor must be on the CPU, got ", t->device());
}

bool use_vnni() { return exact_isa_cap() >= 2 && gh::has_avx512_vnni(); }

// The rows of x that quantize_row takes (the others: non-finite values), quantised.
struct Rows {
  std::vector<int64_t> index;  // rows of x
  std::vector<int8_t> xq;      // [n, K]
  std::vector<float> sx;       // [n, K / 32]
  std::vector<gh::RowTerms> terms;
  Rows(const float* x, int64_t T, int64_t K) : xq(T * K), sx(T * (K / gh::kBlock)), terms(T) {
    for (int64_t r = 0; r < T; ++r) {
      const int64_t n = static_cast<int64_t>(index.size());
      if (gh::quantize_row(x + r * K, K, xq.data() + n * K, sx.data() + n * (K / gh::kBlock), terms[n]))
        index.push_back(r);
    }
  }
};

// upper [n, 16 G] of every certified row against every column (n = rows.index.size()), lower
// likewise unless null, and each row's largest lower bound over the first V columns.
std::vector<float> bounds(const Rows& rows, const uint8_t* codes, const float* stats, int64_t G, int64_t K, int64_t V,
                          float* upper, float* lower) {
  const int64_t n = static_cast<int64_t>(rows.index.size()), ld = G * gh::kCols, blocks = K / gh::kBlock;
  const float *scale = stats, *err = stats + ld, *qnorm = stats + 2 * ld;
  const bool vnni = use_vnni();
  std::vector<float> best(n, -INFINITY);
  std::mutex merge;
  // ~K * 16 * rows products a group: a few groups a task keep small calls on one thread
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, K * gh::kCols * n / 64));
  at::parallel_for(0, G, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row_max(n * gh::kCols, -INFINITY);  // this task's, lane j: columns 16 g + j
    std::vector<float> last(n * gh::kCols, -INFINITY);      // the last group's, when it passes V
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = codes + g * K * gh::kCols;
      const int64_t c = g * gh::kCols;
      float* maxima = c + gh::kCols > V ? last.data() : row_max.data();  // padding never counts
      for (int64_t r0 = 0; r0 < n; r0 += gh::kMaxRows) {
        const int mr = static_cast<int>(std::min<int64_t>(gh::kMaxRows, n - r0));
        const int8_t* xq = rows.xq.data() + r0 * K;
        const float* sx = rows.sx.data() + r0 * blocks;
        const gh::RowTerms* terms = rows.terms.data() + r0;
        float* up = upper + r0 * ld + c;
        float* low = lower != nullptr ? lower + r0 * ld + c : nullptr;
        float* mx = maxima + r0 * gh::kCols;
#if DARTREE_X86 && defined(__GNUC__)
        if (vnni) {
          using Tile = void (*)(const uint8_t*, const int8_t*, const float*, const gh::RowTerms*, int, const float*,
                                const float*, const float*, int64_t, float*, float*, int64_t, float*);
          static constexpr Tile kTiles[gh::kMaxRows] = {
              gh::bounds_group_vnni<1>, gh::bounds_group_vnni<2>, gh::bounds_group_vnni<3>, gh::bounds_group_vnni<4>,
              gh::bounds_group_vnni<5>, gh::bounds_group_vnni<6>, gh::bounds_group_vnni<7>, gh::bounds_group_vnni<8>};
          kTiles[mr - 1](group, xq, sx, terms, mr, scale + c, err + c, qnorm + c, K, up, low, ld, mx);
          continue;
        }
#endif
        gh::bounds_group_portable(group, xq, sx, terms, mr, scale + c, err + c, qnorm + c, K, up, low, ld, mx);
      }
    }
    std::lock_guard<std::mutex> lock(merge);
    for (int64_t i = 0; i < n; ++i)
      for (int j = 0; j < gh::kCols; ++j) {
        best[i] = std::max(best[i], row_max[i * gh::kCols + j]);
        if ((G - 1) * gh::kCols + j < V) best[i] = std::max(best[i], last[i * gh::kCols + j]);
      }
  });
  return best;
}

// The first largest of each row of logits [n, V] (argmax_row: NaN first, ties the lowest id).
void argmax_rows(const at::Tensor& logits, int64_t* out) {
  const int64_t V = logits.size(1);
  const bool avx2 = exact_isa_cap() >= 1 && cpu::has_avx2();
  const float* data = logits.const_data_ptr<float>();
  for (int64_t r = 0; r < logits.size(0); ++r) out[r] = cpu::argmax_row(data + r * V, V, avx2);
}

std::tuple<at::Tensor, at::Tensor> greedy_head_bounds_cpu(const at::Tensor& x_in, const at::Tensor& codes_in,
                                                          const at::Tensor& stats_in, int64_t V) {
  check_codes("greedy_head_bounds", x_in, codes_in, stats_in, V);
  const at::Tensor x = x_in.contiguous(), codes = codes_in.contiguous(), stats = stats_in.contiguous();
  const int64_t T = x.size(0), K = x.size(1), G = codes.size(0), ld = G * gh::kCols;
  const Rows rows(x.const_data_ptr<float>(), T, K);
  const int64_t n = static_cast<int64_t>(rows.index.size());
  at::Tensor up = at::empty({n, ld}, x.options()), low = at::empty({n, ld}, x.options());
  if (n > 0) bounds(rows, codes.const_data_ptr<uint8_t>(), stats.const_data_ptr<float>(), G, K, V, up.data_ptr<float>(),
                    low.data_ptr<float>());
  // rows without a bound (non-finite x): the whole line
  at::Tensor upper = at::full({T, V}, INFINITY, x.options()), lower = at::full({T, V}, -INFINITY, x.options());
  if (n > 0) {
    const at::Tensor index = at::tensor(rows.index, at::kLong);
    upper.index_copy_(0, index, up.narrow(1, 0, V));
    lower.index_copy_(0, index, low.narrow(1, 0, V));
  }
  return {upper, lower};
}

at::Tensor greedy_head_cpu(const at::Tensor& x_in, const at::Tensor& codes_in, const at::Tensor& stats_in,
                           const at::Tensor& packed_in, int64_t qtype, int64_t K) {
  check_packed_linear(x_in, packed_in, qtype, K, std::nullopt);
  check_codes("greedy_head", x_in, codes_in, stats_in, packed_in.size(0));
  TORCH_CHECK_VALUE(packed_in.device().is_cpu(), "greedy_head: packed must be on the CPU, got ", packed_in.device());
  const at::Tensor x = x_in.contiguous(), codes = codes_in.contiguous(), stats = stats_in.contiguous();
  const at::Tensor packed = packed_in.contiguous();
  const int64_t T = x.size(0), V = packed.size(0), G = codes.size(0), ld = G * gh::kCols;
  at::Tensor tokens = at::empty({T}, x.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  if (T == 0) return tokens;
  if (!use_vnni()) {  // the bounds would cost more than the product they spare
    argmax_rows(packed_linear_cpu(x, packed, qtype, K, std::nullopt), out);
    return tokens;
  }
  const Rows rows(x.const_data_ptr<float>(), T, K);
  const int64_t n = static_cast<int64_t>(rows.index.size());
  if (n < T) {  // rows with a NaN or an infinity: their exact product, and argmax_row's order
    std::vector<int64_t> rest;
    for (int64_t r = 0, j = 0; r < T; ++r) {
      if (j < n && rows.index[j] == r) ++j;
      else rest.push_back(r);
    }
    const at::Tensor index = at::tensor(rest, at::kLong);
    std::vector<int64_t> found(rest.size());
    argmax_rows(packed_linear_cpu(x.index_select(0, index), packed, qtype, K, std::nullopt), found.data());
    for (size_t i = 0; i < rest.size(); ++i) out[rest[i]] = found[i];
    if (n == 0) return tokens;
  }
  const std::unique_ptr<float[]> upper(new float[n * ld]);  // (uninitialised: every entry is written)
  const std::vector<float> floor =
      bounds(rows, codes.const_data_ptr<uint8_t>(), stats.const_data_ptr<float>(), G, K, V, upper.get(), nullptr);
  // each row's candidates: the columns whose upper bound reaches the row's largest lower bound
  std::vector<std::vector<int64_t>> reach(n);
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) gh::reaching(upper.get() + i * ld, V, floor[i], reach[i]);
  });
  std::vector<int64_t> columns;
  for (const auto& r : reach) columns.insert(columns.end(), r.begin(), r.end());
  std::sort(columns.begin(), columns.end());
  columns.erase(std::unique(columns.begin(), columns.end()), columns.end());
  const at::Tensor x_rows = n == T ? x : x.index_select(0, at::tensor(rows.index, at::kLong));
  if (static_cast<int64_t>(columns.size()) * 4 > V) {  // bounds too loose to pay: the whole product
    std::vector<int64_t> found(n);
    argmax_rows(packed_linear_cpu(x_rows, packed, qtype, K, std::nullopt), found.data());
    for (int64_t i = 0; i < n; ++i) out[rows.index[i]] = found[i];
    return tokens;
  }
  // every row against the union: each logit has the bits of the whole product's
  const int64_t U = static_cast<int64_t>(columns.size()), row_bytes = packed.size(1);
  at::Tensor picked = at::empty({U, row_bytes}, packed.options());
  const uint8_t* src = packed.const_data_ptr<uint8_t>();
  uint8_t* dst = picked.data_ptr<uint8_t>();
  for (int64_t j = 0; j < U; ++j) std::memcpy(dst + j * row_bytes, src + columns[j] * row_bytes, row_bytes);
  const at::Tensor exact = packed_linear_cpu(x_rows, picked, qtype, K, std::nullopt);
  const float* e = exact.const_data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {  // finite logits: the first largest, columns ascending
    int64_t best = 0;
    for (int64_t j = 1; j < U; ++j)
      if (e[i * U + j] > e[i * U + best]) best = j;
    out[rows.index[i]] = columns[best];
  }
  return tokens;
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree, CPU, m) {
  m.impl("greedy_head", &greedy_head_cpu);
  m.impl("greedy_head_bounds", &greedy_head_bounds_cpu);
}

}  // namespace dartree
