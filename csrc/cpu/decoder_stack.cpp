// CPU launcher of decoder_stack: a Llama-family decoder stack (Llama, Mistral, Qwen2, Qwen3) over
// T tokens of one sequence in one call, with transformers' bits. Each layer's linear layers run
// exact_linear / packed_linear, its attention (exact_)tree_attention over the static cache, and
// its elementwise steps those of dartree/cpu/decoder_layer.h (in SIMD lanes:
// decoder_layer_simd.h); only SiLU stays an ATen call
// (its exp is ATen's vector exp). From Python the same step is ~140 small ATen ops a layer, whose
// dispatch cost a packed 135M model about 45% of a decoding step (torch.profiler, float32).
// Reference: dartree/decoder_stack.py's loop (and transformers' forward under dartree.exact()).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "dartree/cpu/decoder_layer_simd.h"
#include "launchers.h"
#include "torch_types.h"

namespace dartree {
namespace {

namespace layer = cpu::layer;

constexpr int64_t kProjections = 7;  // per layer: q, k, v, o, gate, up, down
enum { kQ, kK, kV, kO, kGate, kUp, kDown };

// ---------------------------------------------------------------------------------- RMSNorm mean

// Rows of n squares with values over many binades: any change of summation order shows.
at::Tensor probe_rows(int64_t n) {
  at::Tensor rows = at::empty({8, n}, at::kFloat);
  float* p = rows.data_ptr<float>();
  uint64_t state = 0x9E3779B97F4A7C15ull;
  for (int64_t i = 0; i < rows.numel(); ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const float unit = static_cast<float>(state >> 40) / static_cast<float>(1ull << 24);
    p[i] = std::ldexp(0.5f + unit, static_cast<int>((state >> 20) % 17) - 8);
  }
  return rows;
}

// ATen's vector width for float32 row sums of length n: the one with which layer::aten_mean gives
// at::mean's bits on probe rows (16 with AVX-512 kernels, 8 with AVX2 / default ones), or 0 when
// neither does (another ATen: the norms then call at::mean). Found once per n.
int mean_lanes(int64_t n) {
  static std::mutex mutex;
  static std::unordered_map<int64_t, int> known;
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find(n);
  if (found != known.end()) return found->second;
  const at::Tensor rows = probe_rows(n);
  const at::Tensor want = rows.mean(-1, /*keepdim=*/true);
  int lanes = 0;
  for (const int w : {16, 8}) {
    bool same = true;
    for (int64_t r = 0; r < rows.size(0) && same; ++r) {
      const float got = layer::aten_mean(rows.data_ptr<float>() + r * n, n, w);
      same = std::memcmp(&got, want.data_ptr<float>() + r, sizeof(float)) == 0;
    }
    if (same) {
      lanes = w;
      break;
    }
  }
  known.emplace(n, lanes);
  return lanes;
}

// out [rows, n] = transformers' RMSNorm of rows of x (row r at x + r * x_stride), weight w [n].
template <typename S>
void rms_norm(const layer::vec& simd, const S* x, int64_t rows, int64_t n, int64_t x_stride, const S* w, double eps,
              S* out) {
  const int lanes = mean_lanes(n);
  thread_local std::vector<float> squared;  // kept from call to call: two norms a layer
  squared.resize(rows * n);
  float* sq = squared.data();
  for (int64_t r = 0; r < rows; ++r) simd.squares(x + r * x_stride, n, sq + r * n);
  at::Tensor means;
  if (lanes == 0) means = at::from_blob(sq, {rows, n}, at::kFloat).mean(-1).contiguous();
  for (int64_t r = 0; r < rows; ++r) {
    const float mean = lanes ? layer::aten_mean(sq + r * n, n, lanes) : means.data_ptr<float>()[r];
    simd.rms_scale(x + r * x_stride, n, layer::inverse_rms(mean, eps), w, out + r * n);
  }
}

// ------------------------------------------------------------------------------------ linears

// x [T, K] -> [T, N]: a packed projection (GGML type qtype >= 0) or a dense one (qtype -1).
at::Tensor project(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const std::optional<at::Tensor>& bias) {
  return qtype < 0 ? exact_linear_cpu(x, w, bias) : packed_linear_cpu(x, w, qtype, x.size(1), bias);
}

// The concatenation of `parts` along dim 0 as a view when they lie back to back in one storage,
// contiguous, of one dtype and row shape (decoder_stack.adjacent in Python); else nullopt.
std::optional<at::Tensor> adjacent(const std::vector<at::Tensor>& parts) {
  const at::Tensor& first = parts[0];
  const char* end = static_cast<const char*>(first.const_data_ptr());
  int64_t rows = 0;
  for (const at::Tensor& t : parts) {
    if (static_cast<const char*>(t.const_data_ptr()) != end || !t.is_contiguous() || t.dim() != first.dim() ||
        t.scalar_type() != first.scalar_type() || t.sizes().slice(1) != first.sizes().slice(1) ||
        !t.storage().is_alias_of(first.storage())) {
      return std::nullopt;
    }
    end += t.nbytes();
    rows += t.size(0);
  }
  std::vector<int64_t> sizes(first.sizes().begin(), first.sizes().end());
  sizes[0] = rows;
  return first.as_strided(sizes, first.strides());
}

// The outputs [T, N_i] of projections [first, first + count) of a layer on x: one packed call
// when their rows (and biases) lie back to back with one block type (load_gguf lays q/k/v and
// gate/up so); a projection's bits are the same either way (every output element is a function of
// its row of x and of weights alone).
std::vector<at::Tensor> project_group(const at::Tensor& x, const c10::List<at::Tensor>& weights,
                                      const std::vector<int64_t>& qtypes,
                                      const c10::List<std::optional<at::Tensor>>& biases, int64_t first,
                                      int64_t count) {
  std::vector<at::Tensor> rows, bias_parts;
  bool fuse = qtypes[first] >= 0;
  int64_t with_bias = 0;
  for (int64_t i = first; i < first + count; ++i) {
    rows.push_back(weights.get(i));
    fuse = fuse && qtypes[i] == qtypes[first];
    const std::optional<at::Tensor> b = biases.get(i);
    if (b.has_value()) {
      bias_parts.push_back(*b);
      ++with_bias;
    }
  }
  std::optional<at::Tensor> fused_rows = fuse ? adjacent(rows) : std::nullopt;
  std::optional<at::Tensor> fused_bias;
  if (with_bias == count) fused_bias = adjacent(bias_parts);
  std::vector<at::Tensor> outs;
  if (fused_rows.has_value() && (with_bias == 0 || fused_bias.has_value())) {
    const at::Tensor out = packed_linear_cpu(x, *fused_rows, qtypes[first], x.size(1), fused_bias);
    int64_t offset = 0;
    for (const at::Tensor& w : rows) {
      outs.push_back(out.narrow(1, offset, w.size(0)));
      offset += w.size(0);
    }
    return outs;
  }
  for (int64_t i = first; i < first + count; ++i) outs.push_back(project(x, rows[i - first], qtypes[i], biases.get(i)));
  return outs;
}

// ---------------------------------------------------------------------------------- the stack

struct Shape {
  int64_t tokens, hidden, heads, kv_heads, dim, layers, start;
  bool qk_norm;
};

void check_stack(const at::Tensor& x, const at::Tensor& kv, int64_t start, const at::Tensor& tree_mask,
                 const at::Tensor& cos, const at::Tensor& sin_signed, const c10::List<at::Tensor>& weights,
                 at::IntArrayRef qtypes, const c10::List<std::optional<at::Tensor>>& biases,
                 const c10::List<at::Tensor>& norms, at::IntArrayRef heads, at::IntArrayRef keep, Shape& s) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) >= 1, "decoder_stack: x must be [T, H] with T >= 1, got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                    "decoder_stack: x must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK_VALUE(heads.size() == 4, "decoder_stack: heads must be [Hq, Hkv, D, qk_norm], got ", heads);
  s.tokens = x.size(0);
  s.hidden = x.size(1);
  s.heads = heads[0];
  s.kv_heads = heads[1];
  s.dim = heads[2];
  s.qk_norm = heads[3] != 0;
  s.start = start;
  TORCH_CHECK_VALUE(s.kv_heads >= 1 && s.heads % s.kv_heads == 0 && s.dim >= 2 && s.dim % 2 == 0,
                    "decoder_stack: heads ", heads, " need Hkv >= 1 dividing Hq and an even head dim");
  TORCH_CHECK_VALUE(kv.dim() == 6 && kv.size(1) == 2 && kv.size(2) == 1 && kv.size(3) == s.kv_heads &&
                        kv.size(5) == s.dim && kv.scalar_type() == dtype && kv.is_contiguous(),
                    "decoder_stack: kv must be a contiguous ", dtype, " cache [L, 2, 1, ", s.kv_heads, ", S, ",
                    s.dim, "], got ", kv.scalar_type(), " ", kv.sizes());
  s.layers = kv.size(0);
  TORCH_CHECK_VALUE(start >= 0 && start + s.tokens <= kv.size(4), "decoder_stack: rows [", start, ", ",
                    start + s.tokens, ") do not fit the cache's ", kv.size(4), " positions");
  TORCH_CHECK_VALUE(tree_mask.dim() == 3 && tree_mask.size(0) == 1 && tree_mask.size(1) == s.tokens &&
                        tree_mask.size(2) == s.tokens && tree_mask.scalar_type() == at::kBool,
                    "decoder_stack: tree_mask must be bool [1, ", s.tokens, ", ", s.tokens, "], got ",
                    tree_mask.scalar_type(), " ", tree_mask.sizes());
  for (const at::Tensor* t : {&cos, &sin_signed}) {
    TORCH_CHECK_VALUE(t->sizes() == at::IntArrayRef({s.tokens, s.dim}) && t->scalar_type() == dtype,
                      "decoder_stack: cos and sin_signed must be ", dtype, " [", s.tokens, ", ", s.dim, "], got ",
                      t->scalar_type(), " ", t->sizes());
  }
  const int64_t n = kProjections * s.layers;
  TORCH_CHECK_VALUE(static_cast<int64_t>(weights.size()) == n && static_cast<int64_t>(qtypes.size()) == n &&
                        static_cast<int64_t>(biases.size()) == n,
                    "decoder_stack: weights, qtypes and biases need 7 entries per layer (", n, " for ", s.layers,
                    " layers), got ", weights.size(), ", ", qtypes.size(), " and ", biases.size());
  const int64_t per_layer = s.qk_norm ? 4 : 2;
  TORCH_CHECK_VALUE(static_cast<int64_t>(norms.size()) == per_layer * s.layers, "decoder_stack: norms needs ",
                    per_layer, " weights per layer (", per_layer * s.layers, "), got ", norms.size());
  for (int64_t l = 0; l < s.layers; ++l) {
    const int64_t want[kProjections] = {s.heads * s.dim, s.kv_heads * s.dim, s.kv_heads * s.dim, s.hidden,
                                        -1, -1, s.hidden};
    const int64_t inter = weights.get(kProjections * l + kGate).size(0);
    for (int64_t j = 0; j < kProjections; ++j) {
      const at::Tensor w = weights.get(kProjections * l + j);
      const int64_t rows = want[j] < 0 ? inter : want[j];
      TORCH_CHECK_VALUE(w.dim() == 2 && w.size(0) == rows, "decoder_stack: layer ", l, " projection ", j,
                        " must have ", rows, " output rows, got ", w.sizes());
    }
    for (int64_t j = 0; j < per_layer; ++j) {
      const at::Tensor w = norms.get(per_layer * l + j);
      const int64_t width = j < 2 ? s.hidden : s.dim;
      TORCH_CHECK_VALUE(w.dim() == 1 && w.size(0) == width && w.scalar_type() == dtype && w.is_contiguous(),
                        "decoder_stack: layer ", l, " norm ", j, " must be a contiguous ", dtype, " [", width,
                        "], got ", w.scalar_type(), " ", w.sizes());
    }
  }
  for (const int64_t l : keep) {
    TORCH_CHECK_VALUE(l >= 0 && l < s.layers, "decoder_stack: keep holds layer ", l, ", not in [0, ", s.layers, ")");
  }
  for (const at::Tensor* t : {&x, &kv, &tree_mask, &cos, &sin_signed}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "decoder_stack: every tensor must be on the CPU, got ", t->device());
  }
}

// One decoder layer on x [T, H] (updated in place).
template <typename S>
void run_layer(const layer::vec& simd, at::Tensor& x, const at::Tensor& kv, int64_t l, const Shape& s,
               const at::Tensor& tree_mask,
               const S* cos, const S* sin_signed, const c10::List<at::Tensor>& weights,
               const std::vector<int64_t>& qtypes, const c10::List<std::optional<at::Tensor>>& biases,
               const c10::List<at::Tensor>& norms, double eps, double scaling, bool exact) {
  const int64_t T = s.tokens, H = s.hidden, D = s.dim, first = kProjections * l;
  const int64_t norm0 = (s.qk_norm ? 4 : 2) * l;
  const auto norm = [&](int64_t j) { return norms.get(norm0 + j).template const_data_ptr<S>(); };
  const auto ptr = [](const at::Tensor& t) { return t.template data_ptr<S>(); };

  at::Tensor h = at::empty({T, H}, x.options());
  rms_norm(simd, ptr(x), T, H, H, norm(0), eps, ptr(h));
  const std::vector<at::Tensor> qkv = project_group(h, weights, qtypes, biases, first + kQ, 3);
  const at::Tensor& q = qkv[0];
  const at::Tensor& k = qkv[1];
  const at::Tensor& v = qkv[2];

  // Qwen3: RMSNorm over each head's D values before RoPE
  at::Tensor q_in = q, k_in = k;
  if (s.qk_norm) {
    q_in = at::empty({T, s.heads * D}, x.options());
    k_in = at::empty({T, s.kv_heads * D}, x.options());
    for (int64_t t = 0; t < T; ++t) {
      rms_norm(simd, ptr(q) + t * q.stride(0), s.heads, D, D, norm(2), eps, ptr(q_in) + t * s.heads * D);
      rms_norm(simd, ptr(k) + t * k.stride(0), s.kv_heads, D, D, norm(3), eps, ptr(k_in) + t * s.kv_heads * D);
    }
  }
  // RoPE: queries into [1, Hq, T, D]; keys, and values as they are, straight into the cache rows
  at::Tensor q_rot = at::empty({1, s.heads, T, D}, x.options());
  const at::Tensor k_cache = kv.select(0, l).select(0, 0);  // [1, Hkv, S, D]
  const at::Tensor v_cache = kv.select(0, l).select(0, 1);
  S* kc = ptr(k_cache);
  S* vc = ptr(v_cache);
  const int64_t cache_rows = kv.size(4);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t hq = 0; hq < s.heads; ++hq) {
      simd.rope(ptr(q_in) + t * q_in.stride(0) + hq * D, cos + t * D, sin_signed + t * D, D,
                  ptr(q_rot) + (hq * T + t) * D);
    }
    for (int64_t hk = 0; hk < s.kv_heads; ++hk) {
      const int64_t row = (hk * cache_rows + s.start + t) * D;
      simd.rope(ptr(k_in) + t * k_in.stride(0) + hk * D, cos + t * D, sin_signed + t * D, D, kc + row);
      std::memcpy(vc + row, ptr(v) + t * v.stride(0) + hk * D, D * sizeof(S));
    }
  }
  const at::Tensor attended = exact ? exact_tree_attention_cpu(q_rot, k_cache, v_cache, tree_mask, s.start, scaling)
                                    : tree_attention_cpu(q_rot, k_cache, v_cache, tree_mask, s.start, scaling);
  const at::Tensor flat = attended.transpose(1, 2).reshape({T, s.heads * D}).contiguous();  // [T, Hq * D]
  const at::Tensor o = project(flat, weights.get(first + kO), qtypes[first + kO], biases.get(first + kO));
  simd.add_into(ptr(x), ptr(o), T * H);

  rms_norm(simd, ptr(x), T, H, H, norm(1), eps, ptr(h));
  const std::vector<at::Tensor> gate_up = project_group(h, weights, qtypes, biases, first + kGate, 2);
  // SiLU on a contiguous gate, as transformers computes it (its vector and scalar exp differ)
  at::Tensor act = at::silu(gate_up[0].contiguous());
  const at::Tensor& up = gate_up[1];
  const int64_t inter = act.size(1);
  for (int64_t t = 0; t < T; ++t) simd.mul_into(ptr(act) + t * inter, ptr(up) + t * up.stride(0), inter);
  const at::Tensor down = project(act, weights.get(first + kDown), qtypes[first + kDown], biases.get(first + kDown));
  simd.add_into(ptr(x), ptr(down), T * H);
}

std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_stack_cpu(
    const at::Tensor& x_in, at::Tensor& kv, int64_t start, const at::Tensor& tree_mask, const at::Tensor& cos_in,
    const at::Tensor& sin_in, const c10::List<at::Tensor>& weights, at::IntArrayRef qtypes_in,
    const c10::List<std::optional<at::Tensor>>& biases, const c10::List<at::Tensor>& norms, at::IntArrayRef heads,
    double eps, double scaling, bool exact, at::IntArrayRef keep) {
  Shape s{};
  check_stack(x_in, kv, start, tree_mask, cos_in, sin_in, weights, qtypes_in, biases, norms, heads, keep, s);
  // The layers' ~20 ATen calls each (buffers, views, SiLU, the linears' outputs) dispatched below
  // autograd's keys: they make plain tensors, and the results are fresh tensors, never views.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  at::Tensor x = x_in.clone(at::MemoryFormat::Contiguous);
  const at::Tensor cos = cos_in.contiguous(), sin_signed = sin_in.contiguous();
  const std::vector<int64_t> qtypes(qtypes_in.begin(), qtypes_in.end());
  std::vector<at::Tensor> kept(keep.size());
  const layer::vec simd{layer::vec::choose(exact_isa_cap())};  // the elementwise steps' lanes
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "decoder_stack_cpu", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {  // refused by the checks
      for (int64_t l = 0; l < s.layers; ++l) {
        run_layer<scalar_t>(simd, x, kv, l, s, tree_mask, cos.const_data_ptr<scalar_t>(),
                            sin_signed.const_data_ptr<scalar_t>(), weights, qtypes, biases, norms, eps, scaling, exact);
        for (size_t i = 0; i < keep.size(); ++i) {
          if (keep[i] == l) kept[i] = x.clone();
        }
      }
    }
  });
  return {x, kept};
}

}  // namespace

TORCH_LIBRARY_IMPL(dartree, CPU, m) { m.impl("decoder_stack", &decoder_stack_cpu); }

}  // namespace dartree
