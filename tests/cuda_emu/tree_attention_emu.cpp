// Runs the CUDA tree-attention kernels (csrc/include/dartree/tree_attention.cuh) under the host
// emulator (race detector on) on random problems and compares them with a float64 reference.
// Built (tests/cuda_emulator.py: g++ -fsanitize=thread ...) and run by
// tests/test_tree_attention.py::test_cuda_kernels_in_emulator.
// Prints one line per case; exits 1 when any case is outside its tolerance.
#include "dartree/tree_attention.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace ta = dartree::tree_attn;

template <typename E>
struct Format;
template <>
struct Format<ta::Float32> {
  static constexpr const char* name = "float32";
  static constexpr double tol = 2e-5;
  static float store(float x) { return x; }
  static double load(float x) { return x; }
};
template <>
struct Format<ta::Half> {
  static constexpr const char* name = "float16";
  static constexpr double tol = 2e-3;
  static uint16_t store(float x) { return emu::float_to_half(x); }
  static double load(uint16_t x) { return emu::half_to_float(x); }
};
template <>
struct Format<ta::BFloat16> {
  static constexpr const char* name = "bfloat16";
  static constexpr double tol = 1.5e-2;
  static uint16_t store(float x) { return emu::float_to_bfloat16(x); }
  static double load(uint16_t x) { return emu::bfloat16_to_float(x); }
};

struct Case {
  int batch, heads, kv_heads, tree, prefix, seq, slots;  // slots: blocks the "GPU" runs at once
  bool q_token_major;  // q laid out [B, T, Hq, D] and viewed as [B, Hq, T, D] (the HF layout)
  const char* tree_kind;
};

// Ancestor-or-self mask of a random tree of the given kind, [T, T] row-major.
std::vector<uint8_t> tree_mask(int size, const std::string& kind, std::mt19937& rng) {
  std::vector<int> parent(size, -1);
  for (int i = 1; i < size; ++i) {
    if (kind == "chain") parent[i] = i - 1;
    else if (kind == "star") parent[i] = 0;
    else parent[i] = static_cast<int>(rng() % i);
  }
  std::vector<uint8_t> mask(size_t(size) * size, 0);
  for (int i = 0; i < size; ++i)
    for (int j = i; j >= 0; j = parent[j]) mask[size_t(i) * size + j] = 1;
  return mask;
}

template <typename E, int D>
bool run_case(const Case& c, uint32_t seed) {
  using S = typename E::Storage;
  using F = Format<E>;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int B = c.batch, Hq = c.heads, Hkv = c.kv_heads, T = c.tree, P = c.prefix, L = c.seq;
  const int group = Hq / Hkv;

  std::vector<S> q(size_t(B) * Hq * T * D), k(size_t(B) * Hkv * L * D), v(k.size());
  for (auto& x : q) x = F::store(normal(rng));
  for (size_t i = 0; i < k.size(); ++i) {
    const size_t row = (i / D) % L;
    const bool garbage = row >= size_t(P + T);  // never read: NaN must not leak
    k[i] = F::store(garbage ? NAN : normal(rng));
    v[i] = F::store(garbage ? NAN : normal(rng));
  }
  std::vector<uint8_t> mask;
  for (int b = 0; b < B; ++b) {
    auto one = tree_mask(T, c.tree_kind, rng);
    mask.insert(mask.end(), one.begin(), one.end());
  }
  std::vector<S> out(size_t(B) * Hq * T * D, F::store(NAN));
  const float scale = 1.f / std::sqrt(float(D));

  ta::Params p{};
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.mask = mask.data();
  p.out = out.data();
  if (c.q_token_major) {  // element (b, h, t, d) at ((b * T + t) * Hq + h) * D + d
    p.q_sb = int64_t(T) * Hq * D;
    p.q_sh = D;
    p.q_st = int64_t(Hq) * D;
  } else {
    p.q_sb = int64_t(Hq) * T * D;
    p.q_sh = int64_t(T) * D;
    p.q_st = D;
  }
  p.k_sb = p.v_sb = int64_t(Hkv) * L * D;
  p.k_sh = p.v_sh = int64_t(L) * D;
  p.k_ss = p.v_ss = D;
  p.o_sb = int64_t(Hq) * T * D;
  p.o_sh = int64_t(T) * D;
  p.o_st = D;
  p.kv_heads = Hkv;
  p.group = group;
  p.tree = T;
  p.rows = group * T;
  p.prefix = P;
  p.keys = P + T;
  p.scale_log2 = scale * 1.4426950408889634f;
  const ta::Plan plan = ta::make_plan<E, D>(p, B, c.slots);
  std::vector<float> part_o, part_ml;
  if (plan.splits > 1) {
    part_o.assign(size_t(B) * Hkv * plan.splits * p.rows * D, NAN);
    part_ml.assign(size_t(B) * Hkv * plan.splits * p.rows * 2, NAN);
    p.part_o = part_o.data();
    p.part_ml = part_ml.data();
  }
  emu::launch(plan.split_grid, dim3(plan.threads), plan.smem_bytes, ta::tree_attention_split_kernel<E, D>, p);
  if (plan.splits > 1) {
    emu::launch(plan.combine_grid, dim3(plan.threads), 0, ta::tree_attention_combine_kernel<E, D>, p);
  }

  // float64 reference on the same (rounded) inputs
  double worst = 0;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h)
      for (int i = 0; i < T; ++i) {
        const int kvh = h / group;
        auto qv = [&](int d) { return F::load(q[b * p.q_sb + h * p.q_sh + i * p.q_st + d]); };
        auto kv_at = [&](const std::vector<S>& x, int j, int d) {
          return F::load(x[((size_t(b) * Hkv + kvh) * L + j) * D + d]);
        };
        std::vector<double> w;
        std::vector<int> keys;
        for (int j = 0; j < P + T; ++j) {
          if (j >= P && !mask[(size_t(b) * T + i) * T + (j - P)]) continue;
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += qv(d) * kv_at(k, j, d);
          w.push_back(dot * scale);
          keys.push_back(j);
        }
        const double mx = *std::max_element(w.begin(), w.end());
        double total = 0;
        for (double& x : w) total += (x = std::exp(x - mx));
        for (int d = 0; d < D; ++d) {
          double expect = 0;
          for (size_t n = 0; n < keys.size(); ++n) expect += w[n] / total * kv_at(v, keys[n], d);
          // the kernel writes out [B, Hq, T, D] contiguous
          const double got = F::load(out[((size_t(b) * Hq + h) * T + i) * D + d]);
          const double err = std::isfinite(got) ? std::fabs(got - expect) : INFINITY;
          worst = std::max(worst, err);
        }
      }
  const bool ok = worst <= F::tol;
  std::printf("%s %-8s D=%-3d B=%d Hq=%d Hkv=%d T=%d P=%d S=%d %-6s q_token_major=%d splits=%d "
              "max_err=%.3g tol=%.3g\n",
              ok ? "ok  " : "FAIL", F::name, D, B, Hq, Hkv, T, P, L, c.tree_kind, int(c.q_token_major),
              plan.splits, worst, F::tol);
  return ok;
}

template <typename E, int D>
bool run_all(const std::vector<Case>& cases) {
  bool ok = true;
  uint32_t seed = 1;
  for (const Case& c : cases) ok &= run_case<E, D>(c, seed++);
  return ok;
}

int main(int argc, char** argv) {
  // name filter: "all" (default) or one of float32 / float16 / bfloat16
  const std::string only = argc > 1 ? argv[1] : "all";
  const std::vector<Case> cases = {
      // B, Hq, Hkv, T, P, S, slots, token-major q, tree
      {1, 4, 2, 5, 37, 60, 1, false, "random"},      // one split, garbage rows after P + T
      {1, 4, 2, 5, 37, 60, 64, true, "random"},       // a split per key tile + combine
      {2, 8, 1, 9, 0, 9, 4, false, "chain"},          // no prefix, g = 8, S == P + T
      {1, 3, 3, 1, 130, 140, 8, false, "single"},     // T = 1, Hq == Hkv
      {1, 8, 2, 20, 70, 100, 1, true, "star"},        // M = 80: two row tiles, tree in two tiles
      {1, 8, 2, 20, 70, 100, 16, false, "random"},
      {1, 4, 2, 7, 300, 320, 8, false, "random"},     // splits of several tiles, a short last one
  };
  bool ok = true;
  if (only == "all" || only == "float32") {
    ok &= run_all<ta::Float32, 64>(cases);
    ok &= run_all<ta::Float32, 128>(cases);
  }
  if (only == "all" || only == "float16") {
    ok &= run_all<ta::Half, 64>(cases);
    ok &= run_all<ta::Half, 128>(cases);
  }
  if (only == "all" || only == "bfloat16") {
    ok &= run_all<ta::BFloat16, 64>(cases);
    ok &= run_all<ta::BFloat16, 128>(cases);
  }
  std::printf(ok ? "all cases ok\n" : "some cases FAILED\n");
  return ok ? 0 : 1;
}
