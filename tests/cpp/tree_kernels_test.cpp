// The torch-free CPU kernels of the draft tree and of greedy_head (csrc/include/dartree/cpu/*.h) against naive loops, on random
// and awkward sizes; built and run under AddressSanitizer + UBSan by tests/test_cpu_kernels_asan.py
// so that an out-of-bounds access in a kernel fails the test suite. Every buffer is sized exactly
// (std::vector), so ASan sees one element past any end.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "dartree/cpu/candidate_topk.h"
#include "dartree/cpu/expand_level.h"
#include "dartree/cpu/greedy_head.h"
#include "dartree/cpu/prune_tree.h"
#include "dartree/cpu/verify_tree.h"

using namespace dartree::cpu;
using dartree::LevelArgs;
using dartree::TableKind;

static int failures = 0;
#define EXPECT(cond, ...)                 \
  do {                                    \
    if (!(cond)) {                        \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      std::printf(__VA_ARGS__);           \
      std::printf("\n");                  \
      ++failures;                         \
    }                                     \
  } while (0)

struct Serial {
  template <typename F>
  void operator()(int64_t n, int64_t, const F& fn) const {
    if (n > 0) fn(0, n);
  }
};

template <typename T>
std::vector<int64_t> stable_order(const std::vector<T>& x) {
  std::vector<int64_t> order(x.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return ranks_before(x[a], a, x[b], b);
  });
  return order;
}

template <typename T>
void test_topk(std::mt19937& gen) {
  for (int64_t vocab : {1, 5, 37, 1000, 2048, 4099, 20000}) {
    for (int64_t count : {int64_t(1), int64_t(7), int64_t(64), vocab}) {
      if (count > vocab) continue;
      for (int ties = 0; ties < 2; ++ties) {
        std::vector<T> x(vocab);
        std::normal_distribution<double> normal(0, 3);
        std::uniform_int_distribution<int> small(-4, 4);
        for (auto& v : x) v = ties ? T(small(gen)) : T(normal(gen));
        std::vector<T> values(count), lse(1);
        std::vector<int64_t> ids(count);
        std::vector<Ranked<T>> pool(4 * count);
        candidate_topk_row<T>(x.data(), vocab, count, values.data(), ids.data(), lse.data(),
                              pool.data());
        const auto order = stable_order(x);
        bool same = true;
        for (int64_t j = 0; j < count; ++j) same &= order[j] == ids[j] && values[j] == x[ids[j]];
        EXPECT(same, "topk vocab %ld count %ld ties %d", long(vocab), long(count), ties);
        double m = -INFINITY, s = 0;
        for (auto v : x) m = std::max(m, double(v));
        for (auto v : x) s += std::exp(double(v) - m);
        EXPECT(std::fabs(lse[0] - (m + std::log(s))) < 1e-4 * (1 + std::fabs(m)), "lse vocab %ld",
               long(vocab));
      }
    }
  }
}

template <typename T>
void test_level(std::mt19937& gen) {
  std::normal_distribution<double> normal(0, 1);
  struct Shape { int64_t f, C, E, Q, r, G, V; };
  for (Shape sh : {Shape{1, 1, 1, 1, 1, 1, 2}, Shape{5, 13, 9, 17, 6, 10, 50},
                   Shape{12, 64, 64, 12, 64, 37, 100}, Shape{3, 7, 7, 21, 5, 9, 30}}) {
    for (int corrected = 0; corrected < 2; ++corrected) {
      auto rand = [&](int64_t n, double scale) {
        std::vector<T> v(n);
        for (auto& x : v) x = T(normal(gen) * scale);
        return v;
      };
      auto ps = rand(sh.f, 1.0), states = rand(sh.f * sh.G, 0.5), z = rand(sh.r, 1.0);
      auto w_s = rand(sh.r * sh.G, 0.3), w2 = rand(sh.C * sh.r, 0.3), b2 = rand(sh.C, 1.0);
      auto base = rand(sh.C, 2.0), table = rand(sh.V * 3 * sh.G, 0.5);
      auto w_hh = rand(3 * sh.G * sh.G, 0.2), b_hh = rand(3 * sh.G, 1.0);
      std::vector<int64_t> ids(sh.C);
      for (int64_t j = 0; j < sh.C; ++j) ids[j] = (j * 7 + 3) % sh.V;
      LevelArgs<T> a;
      a.f = sh.f, a.C = sh.C, a.E = sh.E, a.Q = sh.Q, a.r = sh.r, a.G = sh.G;
      a.parent_scores = ps.data();
      a.states = states.data();
      a.z = corrected ? z.data() : nullptr;
      a.w_s = w_s.data(), a.ld_ws = sh.G, a.w2 = w2.data(), a.ld_w2 = sh.r, a.b2 = b2.data();
      a.base = base.data(), a.ids = ids.data();
      a.table = table.data();
      a.table_kind = std::is_same<T, float>::value ? TableKind::kFloat : TableKind::kDouble;
      a.ld_table = 3 * sh.G, a.w_hh = w_hh.data(), a.ld_hh = sh.G, a.b_hh = b_hh.data();
      std::vector<int64_t> pos(sh.Q), tokens(sh.Q);
      std::vector<T> scores(sh.Q), out(sh.Q * sh.G);
      a.parent_pos = pos.data(), a.tokens = tokens.data(), a.scores = scores.data();
      a.states_out = out.data();
      LevelScratch<T> scratch;
      expand_level(a, scratch, Serial());
      // naive
      std::vector<double> flat(sh.f * sh.E);
      for (int64_t p = 0; p < sh.f; ++p) {
        std::vector<double> c(sh.C);
        for (int64_t j = 0; j < sh.C; ++j) {
          double delta = 0;
          if (corrected) {
            for (int64_t t = 0; t < sh.r; ++t) {
              double v = z[t];
              for (int64_t k = 0; k < sh.G; ++k) v += double(w_s[t * sh.G + k]) * states[p * sh.G + k];
              delta += w2[j * sh.r + t] * (v / (1 + std::exp(-v)));
            }
            delta += b2[j];
          }
          c[j] = base[j] + delta;
        }
        const double m = *std::max_element(c.begin(), c.end());
        double s = 0;
        for (double v : c) s += std::exp(v - m);
        for (int64_t j = 0; j < sh.E; ++j) flat[p * sh.E + j] = ps[p] + (c[j] - (m + std::log(s)));
      }
      const auto order = stable_order(flat);
      const double tol = std::is_same<T, float>::value ? 2e-4 : 1e-9;
      for (int64_t q = 0; q < sh.Q; ++q) {
        EXPECT(pos[q] == order[q] / sh.E && tokens[q] == ids[order[q] % sh.E], "level pick %ld", long(q));
        EXPECT(std::fabs(scores[q] - flat[order[q]]) < tol * (1 + std::fabs(flat[order[q]])), "level score");
        const int64_t p = pos[q];
        for (int64_t j = 0; j < sh.G; ++j) {
          double h[3];
          for (int gate = 0; gate < 3; ++gate) {
            h[gate] = b_hh[gate * sh.G + j];
            for (int64_t k = 0; k < sh.G; ++k) h[gate] += double(w_hh[(gate * sh.G + j) * sh.G + k]) * states[p * sh.G + k];
          }
          const T* gi = table.data() + tokens[q] * 3 * sh.G;
          const double r = 1 / (1 + std::exp(-(gi[j] + h[0])));
          const double u = 1 / (1 + std::exp(-(gi[sh.G + j] + h[1])));
          const double n = std::tanh(gi[2 * sh.G + j] + r * h[2]);
          const double want = (1 - u) * n + u * states[p * sh.G + j];
          EXPECT(std::fabs(out[q * sh.G + j] - want) < tol * 10, "gru %ld %ld", long(q), long(j));
        }
      }
    }
  }
}

void test_prune_and_verify(std::mt19937& gen) {
  std::uniform_real_distribution<double> unit(0, 1);
  for (int64_t M : {1, 2, 3, 40, 193, 300}) {
    std::vector<int64_t> parents(M), depths(M);
    std::vector<double> scores(M);
    parents[0] = -1, depths[0] = 0, scores[0] = 0;
    for (int64_t i = 1; i < M; ++i) {
      parents[i] = std::uniform_int_distribution<int64_t>(0, i - 1)(gen);
      depths[i] = depths[parents[i]] + 1;
      scores[i] = scores[parents[i]] - 2 * unit(gen);
    }
    for (int64_t N : {int64_t(1), std::min<int64_t>(M, 2), std::min<int64_t>(M, 65), M}) {
      std::vector<int64_t> kept(N), np(N), nd(N), fc(N), ns(N), scratch;
      std::vector<int32_t> anc(N * ((N + 31) / 32));
      std::vector<double> heap;
      const int status = prune_tree<double>(M, parents.data(), depths.data(), scores.data(), -0.2, N,
                                            kept.data(), np.data(), nd.data(), anc.data(), fc.data(),
                                            ns.data(), scratch, heap);
      EXPECT(status == 0, "prune status M %ld N %ld", long(M), long(N));
      std::vector<double> keys(M - 1);
      for (int64_t i = 1; i < M; ++i) keys[i - 1] = scores[i] + -0.2 * double(depths[i]);
      auto order = stable_order(keys);
      std::vector<int64_t> want(1, 0);
      for (int64_t j = 0; j < N - 1; ++j) want.push_back(order[j] + 1);
      std::sort(want.begin(), want.end());
      EXPECT(std::equal(want.begin(), want.end(), kept.begin()), "prune kept M %ld N %ld", long(M), long(N));
      for (int64_t n = 1; n < N; ++n) EXPECT(kept[np[n]] == parents[kept[n]], "prune parent");
      // verify on the kept tree, with and without links
      std::vector<int64_t> tokens(N), target(N);
      for (int64_t n = 0; n < N; ++n) tokens[n] = gen() % 3, target[n] = gen() % 3;
      for (int links = 0; links < 2; ++links) {
        std::vector<int64_t> accepted(N), vs;
        int64_t count = -1, bonus = -1;
        const int rc = verify_tree(N, np.data(), tokens.data(), target.data(),
                                   links ? fc.data() : nullptr, links ? ns.data() : nullptr,
                                   accepted.data(), &count, &bonus, vs);
        EXPECT(rc == 0, "verify rc");
        int64_t cur = 0, a = 1;
        for (;;) {
          int64_t next = -1;
          for (int64_t c = 1; c < N; ++c) {
            if (np[c] == cur && tokens[c] == target[cur]) {
              next = c;
              break;
            }
          }
          if (next < 0) break;
          EXPECT(a < count && accepted[a] == next, "verify path");
          ++a;
          cur = next;
        }
        EXPECT(count == a && bonus == target[cur], "verify count");
      }
    }
  }
  // malformed input is refused, never read out of bounds
  std::vector<int64_t> bad_parents{-1, 0, 9}, zeros(3, 0), accepted(3), vs;
  int64_t count, bonus;
  EXPECT(verify_tree(3, bad_parents.data(), zeros.data(), zeros.data(), nullptr, nullptr,
                     accepted.data(), &count, &bonus, vs) == 1, "bad parents");
  std::vector<int64_t> parents{-1, 0, 0}, fc{2, -1, -1}, ns{-1, -1, 7};
  EXPECT(verify_tree(3, parents.data(), zeros.data(), zeros.data(), fc.data(), ns.data(),
                     accepted.data(), &count, &bonus, vs) == 2, "bad links");
}

// greedy_head's row quantisation, its tiles (VNNI where the CPU has it, against the portable one) and
// the candidate scan, on exactly sized buffers.
template <int MR>
void test_greedy_tile(std::mt19937& gen, int64_t K) {
  constexpr int kCols = greedy::kCols;
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint8_t> codes(K * kCols);
  for (auto& c : codes) c = static_cast<uint8_t>(byte(gen));
  std::vector<float> x(MR * K), sx(MR * (K / 32)), scale(kCols), err(kCols), qnorm(kCols);
  for (auto& v : x) v = normal(gen) * 3;
  for (int j = 0; j < kCols; ++j) scale[j] = 0.01f * (j + 1), err[j] = 0.001f * j, qnorm[j] = 0.1f;
  std::vector<int8_t> xq(MR * K);
  std::vector<greedy::RowTerms> terms(MR);
  for (int i = 0; i < MR; ++i) {
    EXPECT(greedy::quantize_row(x.data() + i * K, K, xq.data() + i * K, sx.data() + i * (K / 32), terms[i]),
           "finite row refused");
    for (int64_t k = 0; k < K; ++k) {
      const float s = sx[i * (K / 32) + k / 32];
      EXPECT(std::fabs(x[i * K + k] - s * xq[i * K + k]) <= 0.5001f * s + 1e-30f, "row %d k %lld", i, (long long)k);
    }
  }
  std::vector<float> up(MR * kCols), low(MR * kCols), max_port(MR * kCols, -INFINITY);
  greedy::bounds_group_portable(codes.data(), xq.data(), sx.data(), terms.data(), MR, scale.data(), err.data(),
                                qnorm.data(), K, up.data(), low.data(), kCols, max_port.data());
  for (int i = 0; i < MR * kCols; ++i) EXPECT(low[i] <= up[i] && max_port[i] == low[i], "portable %d", i);
#if DARTREE_X86 && defined(__GNUC__)
  if (greedy::has_avx512_vnni()) {
    std::vector<float> up2(MR * kCols), max_vnni(MR * kCols, -INFINITY);
    greedy::bounds_group_vnni<MR>(codes.data(), xq.data(), sx.data(), terms.data(), MR, scale.data(), err.data(),
                                  qnorm.data(), K, up2.data(), nullptr, kCols, max_vnni.data());
    for (int i = 0; i < MR * kCols; ++i) {
      const float width = up[i] - low[i];
      EXPECT(std::fabs(up2[i] - up[i]) <= 1e-3f * width + 1e-6f * std::fabs(up[i]), "vnni upper %d", i);
      EXPECT(std::fabs(max_vnni[i] - low[i]) <= 1e-3f * width + 1e-6f * std::fabs(low[i]), "vnni lower %d", i);
    }
  }
#endif
  std::vector<int64_t> got;
  greedy::reaching(up.data(), MR * kCols, low[0], got);
  std::vector<int64_t> want;
  for (int i = 0; i < MR * kCols; ++i)
    if (up[i] >= low[0]) want.push_back(i);
  EXPECT(got == want, "reaching: %zu against %zu columns", got.size(), want.size());
}

void test_greedy_head(std::mt19937& gen) {
  for (int64_t K : {32, 96, 576}) {
    test_greedy_tile<1>(gen, K);
    test_greedy_tile<3>(gen, K);
    test_greedy_tile<8>(gen, K);
  }
  std::vector<float> x(64, 127.0f), sx(2);  // scale 1: every value exact
  std::vector<int8_t> xq(64);
  greedy::RowTerms terms;
  x[40] = NAN;
  EXPECT(!greedy::quantize_row(x.data(), 64, xq.data(), sx.data(), terms), "a NaN row taken");
  x[40] = 0.0f;
  EXPECT(greedy::quantize_row(x.data(), 64, xq.data(), sx.data(), terms) && terms.delta == 0.0f && sx[0] == 1.0f,
         "an exact row");
}

int main() {
  std::mt19937 gen(1234);
  test_topk<float>(gen);
  test_topk<double>(gen);
  test_level<float>(gen);
  test_level<double>(gen);
  test_prune_and_verify(gen);
  test_greedy_head(gen);
  std::printf(failures ? "FAILED %d\n" : "OK\n", failures);
  return failures ? 1 : 0;
}
