// The decoder layers of the lean forward as one operator (`exactspec::decoder_stack`): the same
// sequence of the same operators as exactspec/models/lean_kernels.py's per-operator loop
// (RMSNorm, fused q/k/v product, bias, q / k norms, RoPE, the SlotCache write, attention, the
// output product with its residual, the MLP), called as C++ functions (ops.h), so the same
// bits; what it saves is the per-operator cost of Python and the dispatcher (about 20 calls
// per layer; docs/performance.md), and a layer stack (LayerStack, built once per forward)
// keeps the weights' arguments in C++. A layer arrives as the fields of its declaration
// (exactspec/models/lean_layer.py) with their names, checked against kTensorNames /
// kSettingNames below.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "isa.h"
#include "ops.h"

namespace exactspec {

// a product of the lean forward (formats.py's Matrix.kernel_args): float32 / bf16 / int8 parts
// with optional per-column scales (kernels.linear), or one int8 tensor packed by
// kernels.pack_int8 (4 dims) with its scales (kernels.linear_w8a16), or one int4 tensor packed
// by kernels.pack_int4 (3 dims, uint8) with its scales (kernels.linear_w4a8)
at::Tensor product(const at::Tensor& x, at::TensorList w, const c10::optional<at::Tensor>& scales,
                   const c10::optional<at::Tensor>& residual) {
  if (w.size() == 1 && w[0].dim() == 4) {
    TORCH_CHECK(scales.has_value(), "a packed int8 product needs its scales");
    return linear_w8a16(x, w[0], *scales, residual);
  }
  if (w.size() == 1 && w[0].dim() == 3 && w[0].scalar_type() == at::kByte) {
    TORCH_CHECK(scales.has_value(), "a packed int4 product needs its scales");
    return linear_w4a8(x, w[0], *scales, residual);
  }
  return linear(x, w, scales, residual);
}

namespace {

// x + norm(y) when the layer has that (sandwich) norm, else y already holds x + product
at::Tensor add_normed(const at::Tensor& x, const at::Tensor& y,
                      const c10::optional<at::Tensor>& norm, double eps) {
  return x + rms_norm(y, *norm, eps);
}

// One decoder layer's weights and settings, read from the fields of its declaration
// (models/lean_layer.py: LayerShape, then LeanLayer), which LayerStack.add receives as two
// lists in declared order with their names. The names below are that order; add() refuses
// any other, so a field added to, removed from or moved in the declaration fails loudly when
// the stack is built instead of shifting the fields after it.
enum TensorField {
  kNormIn, kQkv, kQkvScales, kQkvBias, kQNorm, kKNorm, kO, kOScales, kNormAttnOut, kNormMlpIn,
  kGateUp, kGateUpScales, kDown, kDownScales, kNormMlpOut, kTensorFields
};
const char* const kTensorNames[kTensorFields] = {
    "norm_in", "qkv", "qkv_scales", "qkv_bias", "q_norm", "k_norm", "o", "o_scales",
    "norm_attn_out", "norm_mlp_in", "gate_up", "gate_up_scales", "down", "down_scales",
    "norm_mlp_out"};
enum SettingField { kHeads, kKvHeads, kHeadDim, kScale, kAct, kKind, kEps, kSettingFields };
// a choice lists its values in index order: act 0 = SiLU, 1 = GELU (tanh); kind 1 = sliding
const char* const kSettingNames[kSettingFields] = {
    "heads", "kv_heads", "head_dim", "scale", "act:silu,gelu_tanh",
    "kind:full_attention,sliding_attention", "eps"};

// A product as the rows stack runs it (rows_stack): the same kernel calls as product() makes,
// split over the threads on the same units (16 columns of a float product, panels of 32 int8 /
// 16 int4 outputs), its pointers read once when the layer is added
struct Prod {
  enum Kind { kParts, kW8, kW4 } kind = kParts;
  int64_t N = 0, K = 0, Kp = 0;
  struct Part { const void* w; int wt; const float* scale; int64_t col, rows; };
  std::vector<Part> parts;   // kParts: the float32 / bf16 / int8 parts
  const void* w = nullptr;   // kW8 / kW4: the packed weights
  const float* scales = nullptr;
  bool ok = false;  // a layout rows_stack takes (else the operator path runs)
  int64_t unit() const { return kind == kW8 ? 32 : 16; }  // outputs per unit
  int64_t units() const { return (N + unit() - 1) / unit(); }
};

Prod prod_of(at::TensorList w, const c10::optional<at::Tensor>& scales) {
  Prod p;
  if (w.size() == 1 && w[0].dim() == 4 && w[0].scalar_type() == at::kChar && scales.has_value()) {
    p.kind = Prod::kW8;
    p.N = scales->size(0);
    p.Kp = w[0].size(1) * 2;  // the row's K: rounded up to Kp (checked in rows_ok)
    p.w = w[0].data_ptr();
  } else if (w.size() == 1 && w[0].dim() == 3 && w[0].scalar_type() == at::kByte &&
             scales.has_value()) {
    p.kind = Prod::kW4;
    p.N = scales->size(0);
    p.Kp = w[0].size(1) * 32;
    p.w = w[0].data_ptr();
  } else {
    p.kind = Prod::kParts;
    for (const at::Tensor& t : w) {
      if (t.dim() != 2 || !t.is_contiguous()) return p;
      int wt;
      switch (t.scalar_type()) {
        case at::kFloat: wt = W_F32; break;
        case at::kBFloat16: wt = W_BF16; break;
        case at::kChar: wt = W_I8; break;
        default: return p;
      }
      if (p.K && t.size(1) != p.K) return p;
      p.K = t.size(1);
      p.parts.push_back({t.data_ptr(), wt, nullptr, p.N, t.size(0)});
      p.N += t.size(0);
    }
    p.Kp = p.K;
  }
  if (scales.has_value()) {
    const at::Tensor& s = *scales;
    if (s.scalar_type() != at::kFloat || s.dim() != 1 || s.size(0) != p.N || !s.is_contiguous())
      return p;
    p.scales = s.data_ptr<float>();
    for (auto& part : p.parts) part.scale = p.scales + part.col;
  }
  p.ok = p.N > 0;
  return p;
}

// a norm's or a bias's values as float32 (what rms_norm and `y + bias` compute with)
at::Tensor as_f32(const at::Tensor& t) { return t.contiguous().to(at::kFloat).contiguous(); }

struct Layer {
  at::Tensor norm_in;
  double eps;
  std::vector<at::Tensor> qkv;
  c10::optional<at::Tensor> qkv_scales, qkv_bias, q_norm, k_norm;
  int64_t heads, kv_heads, head_dim;
  double scale;
  std::vector<at::Tensor> o;
  c10::optional<at::Tensor> o_scales, norm_attn_out;
  at::Tensor norm_mlp_in;
  std::vector<at::Tensor> gate_up;
  c10::optional<at::Tensor> gate_up_scales;
  int64_t act;  // 0 = SiLU, 1 = GELU (tanh)
  std::vector<at::Tensor> down;
  c10::optional<at::Tensor> down_scales, norm_mlp_out;
  int64_t local;  // 1: a sliding-window layer (takes the local RoPE and mask), else 0
  // for rows_stack: the products' pointers, the norms and the bias as float32
  Prod p_qkv, p_o, p_gate_up, p_down;
  at::Tensor f_norm_in, f_q_norm, f_k_norm, f_norm_attn_out, f_norm_mlp_in, f_norm_mlp_out,
      f_qkv_bias;
};

// "a, b, c": a list of names, for the messages below
std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

template <size_t N>
void check_layout(const char* what, const std::vector<std::string>& got,
                  const char* const (&want)[N]) {
  const std::vector<std::string> expected(want, want + N);
  TORCH_CHECK(got == expected, "LayerStack.add: the layer's ", what, " fields [", joined(got),
              "] are not the ", what, " fields of ops_layer.cpp [", joined(expected),
              "]: models/lean_layer.py's declaration and the C++ operator differ (rebuild the "
              "kernels, or change both)");
}

// the one tensor of a required field / the tensor or none of an optional one
at::Tensor one(const std::vector<std::vector<at::Tensor>>& t, TensorField f) {
  TORCH_CHECK(t[f].size() == 1, "LayerStack.add: field ", kTensorNames[f],
              " takes one tensor, got ", t[f].size());
  return t[f][0];
}
c10::optional<at::Tensor> maybe(const std::vector<std::vector<at::Tensor>>& t, TensorField f) {
  TORCH_CHECK(t[f].size() <= 1, "LayerStack.add: field ", kTensorNames[f],
              " takes one tensor or none, got ", t[f].size());
  return t[f].empty() ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(t[f][0]);
}
std::vector<at::Tensor> parts(const std::vector<std::vector<at::Tensor>>& t, TensorField f) {
  TORCH_CHECK(!t[f].empty(), "LayerStack.add: product ", kTensorNames[f], " has no weights");
  return t[f];
}
int64_t integer(const std::vector<double>& s, SettingField f) {
  const double v = s[f];
  TORCH_CHECK(v >= 0 && v <= 1e15 && v == std::floor(v), "LayerStack.add: setting ",
              kSettingNames[f], " must be a non-negative integer, got ", v);
  return static_cast<int64_t>(v);
}

// the per-step arguments every layer shares
struct Step {
  int64_t batch, write_start, view_len;
  const c10::optional<at::Tensor>* write_index;
};

// x [M, H] float32 (M = B * T rows, row-major by row then token); cos / sin [M, d]; the
// layer's SlotCache buffers k_cache / v_cache [B, kv, C, d] float32, written at slots
// write_start.. (every row alike, >= 0) or write_index [B, T], then attended over their first
// view_len slots under mask ([B, 1, T, S] / [B, T, S] bool, or none: all visible).
// Returns the layer's output [M, H].
at::Tensor run_layer(const Layer& L, const at::Tensor& x, const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const c10::optional<at::Tensor>& mask, const Step& st) {
  TORCH_CHECK(x.dim() == 2 && st.batch > 0 && x.size(0) % st.batch == 0,
              "decoder layer: x must be [B * T, H] with B = ", st.batch, ", got ", x.sizes());
  const int64_t m = x.size(0), b = st.batch, t = m / b;
  const int64_t h = L.heads, kv = L.kv_heads, d = L.head_dim;
  const double eps = L.eps;
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == b && k_cache.size(1) == kv &&
                  k_cache.size(3) == d && v_cache.sizes() == k_cache.sizes() &&
                  st.view_len <= k_cache.size(2),
              "decoder layer: the cache must be [", b, ", ", kv, ", >= ", st.view_len, ", ", d,
              "], got ", k_cache.sizes());
  const c10::optional<at::Tensor> none;
  at::Tensor y = product(rms_norm(x, L.norm_in, eps), L.qkv, L.qkv_scales, none);
  if (L.qkv_bias.has_value()) y = y + *L.qkv_bias;  // [M, (h + 2 kv) d]
  at::Tensor q, k;
  if (L.q_norm.has_value()) {  // per-head norms: rows of d in [M * heads, d] views
    q = rms_norm(y.slice(1, 0, h * d).reshape({m * h, d}), *L.q_norm, eps).view({m, h * d});
    k = rms_norm(y.slice(1, h * d, (h + kv) * d).reshape({m * kv, d}), *L.k_norm, eps)
            .view({m, kv * d});
    rope_(q, cos, sin, h);
    rope_(k, cos, sin, kv);
    q = q.view({b, t, h, d});
    k = k.view({b, t, kv, d}).transpose(1, 2);  // [B, kv, T, d]
  } else {
    rope_(y, cos, sin, h + kv);  // q and k heads, in place
    const at::Tensor yv = y.view({b, t, -1});
    q = yv.slice(2, 0, h * d).view({b, t, h, d});
    k = yv.slice(2, h * d, (h + kv) * d).view({b, t, kv, d}).transpose(1, 2);
  }
  const at::Tensor v = y.view({b, t, -1}).slice(2, (h + kv) * d).view({b, t, kv, d}).transpose(1, 2);
  if (st.write_start >= 0) {  // SlotCache.update: every row writes at the same slots
    k_cache.narrow(2, st.write_start, t).copy_(k);
    v_cache.narrow(2, st.write_start, t).copy_(v);
  } else {
    TORCH_CHECK(st.write_index->has_value(), "decoder layer: write_start < 0 needs write_index");
    const at::Tensor idx = (*st.write_index)->view({b, 1, t, 1}).expand({b, kv, t, d});
    // a bf16 cache: rounded as copy_ rounds (to nearest even)
    k_cache.scatter_(2, idx, k.to(k_cache.scalar_type()));
    v_cache.scatter_(2, idx, v.to(v_cache.scalar_type()));
  }
  at::Tensor a = attention(q, k_cache.narrow(2, 0, st.view_len),
                           v_cache.narrow(2, 0, st.view_len), mask, L.scale).view({m, h * d});
  at::Tensor out = L.norm_attn_out.has_value()
                       ? add_normed(x, product(a, L.o, L.o_scales, none), L.norm_attn_out, eps)
                       : product(a, L.o, L.o_scales, x);  // x + a W_o^T
  at::Tensor g = product(rms_norm(out, L.norm_mlp_in, eps), L.gate_up, L.gate_up_scales, none);
  g = L.act == 0 ? silu_mul(g) : gelu_tanh_mul(g);  // [M, I]
  return L.norm_mlp_out.has_value()
             ? add_normed(out, product(g, L.down, L.down_scales, none), L.norm_mlp_out, eps)
             : product(g, L.down, L.down_scales, out);
}

// The kept decoder layers of one LeanLlama, built once (lean_kernels.layer_stack), so a
// forward passes only what changes per step: one operator call for the whole stack.
struct LayerStack : torch::CustomClassHolder {
  std::vector<Layer> layers;

  // one layer: models/lean_layer.py's fused_args (its fields' names and values, in order)
  void add(std::vector<std::string> tensor_names, std::vector<std::vector<at::Tensor>> t,
           std::vector<std::string> setting_names, std::vector<double> s) {
    check_layout("tensor", tensor_names, kTensorNames);
    check_layout("setting", setting_names, kSettingNames);
    TORCH_CHECK(t.size() == kTensorFields && s.size() == kSettingFields,
                "LayerStack.add: one value per named field");
    const int64_t act = integer(s, kAct), local = integer(s, kKind);
    TORCH_CHECK(act <= 1 && local <= 1, "LayerStack.add: act and kind take 0 or 1");
    Layer L;
    L.norm_in = one(t, kNormIn);
    L.eps = s[kEps];
    L.qkv = parts(t, kQkv);
    L.qkv_scales = maybe(t, kQkvScales);
    L.qkv_bias = maybe(t, kQkvBias);
    L.q_norm = maybe(t, kQNorm);
    L.k_norm = maybe(t, kKNorm);
    L.heads = integer(s, kHeads);
    L.kv_heads = integer(s, kKvHeads);
    L.head_dim = integer(s, kHeadDim);
    L.scale = s[kScale];
    L.o = parts(t, kO);
    L.o_scales = maybe(t, kOScales);
    L.norm_attn_out = maybe(t, kNormAttnOut);
    L.norm_mlp_in = one(t, kNormMlpIn);
    L.gate_up = parts(t, kGateUp);
    L.gate_up_scales = maybe(t, kGateUpScales);
    L.act = act;
    L.down = parts(t, kDown);
    L.down_scales = maybe(t, kDownScales);
    L.norm_mlp_out = maybe(t, kNormMlpOut);
    L.local = local;
    TORCH_CHECK(L.q_norm.has_value() == L.k_norm.has_value(), "q_norm and k_norm come together");
    L.p_qkv = prod_of(L.qkv, L.qkv_scales);
    L.p_o = prod_of(L.o, L.o_scales);
    L.p_gate_up = prod_of(L.gate_up, L.gate_up_scales);
    L.p_down = prod_of(L.down, L.down_scales);
    L.f_norm_in = as_f32(L.norm_in);
    L.f_norm_mlp_in = as_f32(L.norm_mlp_in);
    if (L.q_norm.has_value()) L.f_q_norm = as_f32(*L.q_norm);
    if (L.k_norm.has_value()) L.f_k_norm = as_f32(*L.k_norm);
    if (L.norm_attn_out.has_value()) L.f_norm_attn_out = as_f32(*L.norm_attn_out);
    if (L.norm_mlp_out.has_value()) L.f_norm_mlp_out = as_f32(*L.norm_mlp_out);
    if (L.qkv_bias.has_value()) L.f_qkv_bias = as_f32(*L.qkv_bias);
    layers.push_back(std::move(L));
  }
  int64_t size() const { return static_cast<int64_t>(layers.size()); }
};


// ---- a few rows: the whole stack in one parallel region ----
//
// A decode step (one token of a few sequences), a verify (K + 1 tokens of one) or a short
// prompt spends a good part of its time outside the weights' bytes when each operator is its
// own call: about 20 tensor operations a layer and 4-6 parallel regions, each waiting for a
// thread without a core on a busy machine (docs/performance.md, "The AMX machine, fourth
// pass"). rows_stack runs the same kernel calls in the same order on raw buffers, in one
// parallel region for every layer: the products split over the threads on the units product()
// splits them on, attention over the (sequence, query head) pairs (or, past 512 keys, over
// (sequence, key/value head, run) items, then the pairs combine their runs), the rows of the
// elementwise operators over the threads or on one, a barrier where a result crosses threads.
// Every output is computed by the same kernel call with the same inputs as on the operator path,
// so the same bits (tests/kernels/test_decoder_stack.py).
constexpr int64_t kRowsMax = 64;  // rows (sequences x tokens) rows_stack takes

// A barrier for a team of n threads: a short spin, then the core is given away (sched_yield)
// so that a partner without a core (a busy machine) gets one instead of a spinning thread
struct Barrier {
  std::atomic<int> count{0}, gen{0};
  void wait(int n) {
    if (n == 1) return;
    const int g = gen.load(std::memory_order_acquire);
    if (count.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      count.store(0, std::memory_order_relaxed);
      gen.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spin = 0; gen.load(std::memory_order_acquire) == g; ++spin) {
      if (spin < 2000) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      } else {
        sched_yield();
      }
    }
  }
};

// a thread's buffers (its own copies of what it quantizes and normalizes)
struct RowScratch {
  std::vector<float> xn, sx, scratch, partial;
  std::vector<int16_t> xq;
};

// [b0, b1): part t of n of [0, total) (as ops.cpp's Chunks: no effect on any result)
inline void share(int64_t total, int t, int n, int64_t* b0, int64_t* b1) {
  *b0 = total * t / n;
  *b1 = total * (t + 1) / n;
}

// d floats of x into a cache buffer at element `at`: copied (float32), or rounded to bf16 to
// nearest even (as torch's float-to-bfloat16 copy, the operator path's cache update)
inline void store_row(void* buf, bool bf16, int64_t at, const float* x, int64_t d) {
  if (!bf16) {
    std::memcpy(static_cast<float*>(buf) + at, x, d * sizeof(float));
    return;
  }
  c10::BFloat16* o = static_cast<c10::BFloat16*>(buf) + at;
  for (int64_t c = 0; c < d; ++c) o[c] = c10::BFloat16(x[c]);
}

// thread t's share of y = x P^T (+ r, or + bias) for M rows of K floats (x's quantized copy in s
// when P is packed), y and r [M, P.N], bias [P.N]
void rows_product(const Isa& k, const Prod& P, const float* x, int64_t M, int64_t K,
                  const float* r, float* y, RowScratch& s, int t, int n,
                  const float* bias = nullptr) {
  int64_t u0, u1;
  share(P.units(), t, n, &u0, &u1);
  if (u0 >= u1) return;
  const int64_t c0 = u0 * P.unit(), c1 = std::min(u1 * P.unit(), P.N), N = P.N;
  if (P.kind == Prod::kParts) {
    for (const auto& p : P.parts) {
      const int64_t r0 = std::max(c0, p.col) - p.col;
      const int64_t r1 = std::min(c1, p.col + p.rows) - p.col;
      if (r0 >= r1) continue;
      k.linear(x, M, K, p.w, p.wt, p.scale, y + p.col, N, r0, r1);
    }
  } else if (P.kind == Prod::kW8) {
    for (int64_t m = 0; m < M; ++m)
      k.quantize_i16(x + m * K, K, P.Kp, s.xq.data() + m * P.Kp, s.sx.data() + m);
    k.linear_w8a16(s.xq.data(), P.Kp, M, P.Kp, static_cast<const int8_t*>(P.w), s.sx.data(),
                   P.scales, y, N, N, u0, u1);
  } else {
    const int64_t G = P.Kp / 32;
    int8_t* q = reinterpret_cast<int8_t*>(s.xq.data());
    float* sx = s.sx.data();
    float* xs = sx + M * G;
    for (int64_t m = 0; m < M; ++m)
      k.quantize_i8g(x + m * K, K, P.Kp, q + m * P.Kp, sx + m * G, xs + m * G);
    k.linear_w4a8(q, P.Kp, sx, xs, M, G, static_cast<const uint8_t*>(P.w), P.scales, y, N, N,
                  u0, u1);
  }
  if (r) add_residual(y, r, M, N, c0, c1);
  if (bias)  // `y + bias` of the operator path
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = c0; c < c1; ++c) y[m * N + c] = y[m * N + c] + bias[c];
}

// whether rows_stack takes this call (else the operator path runs, the same bits)
bool rows_ok(const LayerStack& stack, const at::Tensor& x, at::TensorList k_caches,
             at::TensorList v_caches, int64_t write_start, int64_t view_len, int64_t batch) {
  const char* env = std::getenv("EXACTSPEC_ROWS_STACK");
  if (env && env[0] == '0') return false;
  if (x.dim() != 2 || x.size(0) < 1 || x.size(0) > kRowsMax || x.scalar_type() != at::kFloat ||
      write_start < 0 || batch < 1 || x.size(0) % batch != 0)
    return false;
  const int64_t H = x.size(1), T = x.size(0) / batch;
  for (size_t i = 0; i < stack.layers.size(); ++i) {
    const Layer& L = stack.layers[i];
    const at::Tensor& kc = k_caches[i];
    const at::Tensor& vc = v_caches[i];
    if (!L.p_qkv.ok || !L.p_o.ok || !L.p_gate_up.ok || !L.p_down.ok) return false;
    const int64_t h = L.heads, kv = L.kv_heads, d = L.head_dim;
    if (kv <= 0 || h % kv != 0 || h / kv > 64 || d % 2 != 0) return false;
    const int64_t I = L.p_gate_up.N / 2;
    if (L.p_qkv.N != (h + 2 * kv) * d || L.p_o.N != H || L.p_down.N != H ||
        L.p_gate_up.N % 2 != 0)
      return false;
    // each product's input length: its K (float parts) or rounded up to 32, its Kp (packed)
    const std::pair<const Prod*, int64_t> ins[] = {
        {&L.p_qkv, H}, {&L.p_o, h * d}, {&L.p_gate_up, H}, {&L.p_down, I}};
    for (const auto& pk : ins)
      if (pk.first->kind == Prod::kParts ? pk.first->K != pk.second
                                         : pk.first->Kp != (pk.second + 31) / 32 * 32)
        return false;
    if ((kc.scalar_type() != at::kFloat && kc.scalar_type() != at::kBFloat16) ||
        vc.scalar_type() != kc.scalar_type() || kc.dim() != 4 ||
        kc.size(0) != batch || kc.size(1) != kv || kc.size(3) != d || vc.sizes() != kc.sizes() ||
        kc.strides() != vc.strides() || kc.stride(3) != 1 || view_len > kc.size(2) ||
        write_start + T > view_len)
      return false;
    if (L.f_qkv_bias.defined() && L.f_qkv_bias.numel() != L.p_qkv.N) return false;
  }
  return true;
}

// the queries' view of one mask [B, 1, T, S] / [B, T, S] bool (or none): per row (b, t), its
// mask row (null: every key up to its last) and its last visible key
struct RowsMask {
  at::Tensor keep;  // the contiguous rows, alive while the stack runs
  std::vector<const uint8_t*> row;
  std::vector<int64_t> last;
  int64_t runs_max = 1;
};
RowsMask rows_mask(const c10::optional<at::Tensor>& mask, int64_t B, int64_t T, int64_t S) {
  RowsMask m;
  m.row.assign(B * T, nullptr);
  m.last.assign(B * T, S - 1);
  if (mask.has_value()) {
    at::Tensor t = *mask;
    if (t.dim() == 4) t = t.select(1, 0);
    TORCH_CHECK(t.scalar_type() == at::kBool && t.dim() == 3 && t.size(0) == B &&
                    t.size(1) == T && t.size(2) == S, "attention: mask must be bool [B, T, S]");
    m.keep = t.contiguous();
    const uint8_t* p = reinterpret_cast<const uint8_t*>(m.keep.data_ptr<bool>());
    for (int64_t r = 0; r < B * T; ++r) {
      bool dense;
      m.last[r] = last_visible(p + r * S, S, &dense);
      m.row[r] = dense ? nullptr : p + r * S;
    }
  }
  for (int64_t r = 0; r < B * T; ++r)
    m.runs_max = std::max(m.runs_max, attn_runs(m.last[r]));
  return m;
}

// Where attention reads a layer's queries and keys: q rows of ldq floats, the cache's key / value
// buffers with their strides, the mask's rows
struct AttnView {
  const float* q;
  int64_t ldq;
  const void* k;  // float, or bf16 (uint16_t) where bf16
  const void* v;
  bool bf16;
  int64_t ks0, ks1, ks2, d;
  float scale;
  const RowsMask* mask;
};

// run r of the keys of key/value head gi of sequence b for nq queries (row[u], head[u]): each
// query's partial (top, sum, acc[d]) at part + u * (d + 2) (ops.cpp's attention, run_one)
void attend_queries(const Isa& k, const AttnView& A, int64_t b, int64_t gi, int64_t r,
                    int64_t nq, const int64_t* row, const int64_t* head, float* scratch,
                    float* part) {
  const int64_t j0 = r * kAttnRun, stride = A.d + 2;
  const float* qs[64];
  const uint8_t* ms[64];
  int64_t rel[64];
  float* acc[64];
  float top[64], sum[64];
  for (int64_t u = 0; u < nq; ++u) {
    const uint8_t* mrow = A.mask->row[row[u]];
    qs[u] = A.q + row[u] * A.ldq + head[u] * A.d;
    ms[u] = mrow ? mrow + j0 : nullptr;
    rel[u] = std::min(A.mask->last[row[u]], j0 + kAttnRun - 1) - j0;
    acc[u] = part + u * stride + 2;
  }
  const int64_t off = b * A.ks0 + gi * A.ks1 + j0 * A.ks2;
  attend_cache(k, A.bf16, nq, qs, ms, rel, A.k, A.v, off, A.ks2, A.d, A.scale, scratch,
               kAttnRun + 32, top, sum, acc);
  for (int64_t u = 0; u < nq; ++u) {
    part[u * stride] = top[u];
    part[u * stride + 1] = sum[u];
  }
}

// a query's output o[:d] from the partials of its runs, run r's at part + r * run_stride
void finish_query(const Isa& k, int64_t last, const float* part, int64_t run_stride, int64_t d,
                  float* o) {
  const int64_t runs = attn_runs(last);
  float rt[kAttnMaxRuns], rs[kAttnMaxRuns];
  const float* ra[kAttnMaxRuns];
  for (int64_t r = 0; r < runs; ++r) {
    rt[r] = part[r * run_stride];
    rs[r] = part[r * run_stride + 1];
    ra[r] = part + r * run_stride + 2;
  }
  k.attend_finish(runs, rt, rs, ra, d, o);
}

std::vector<at::Tensor> rows_stack(
    const LayerStack& stack, const at::Tensor& x_, const at::Tensor& cos_, const at::Tensor& sin_,
    const c10::optional<at::Tensor>& cos_local, const c10::optional<at::Tensor>& sin_local,
    at::TensorList k_caches, at::TensorList v_caches, int64_t write_start, int64_t view_len,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& mask_local,
    int64_t B, at::IntArrayRef keep) {
  const Isa& k = current_unit();
  const int64_t M = x_.size(0), T = M / B, H = x_.size(1);
  const int64_t nl = static_cast<int64_t>(stack.layers.size());
  const at::Tensor cos = cos_.contiguous(), sin = sin_.contiguous();
  at::Tensor cosl, sinl;
  if (cos_local.has_value()) cosl = cos_local->contiguous(), sinl = sin_local->contiguous();
  const RowsMask mg = rows_mask(mask, B, T, view_len);
  const RowsMask ml = mask_local.has_value() ? rows_mask(mask_local, B, T, view_len) : mg;
  TORCH_CHECK(std::max(mg.runs_max, ml.runs_max) <= kAttnMaxRuns, "attention: at most ",
              kAttnMaxRuns * kAttnRun, " keys, got ", view_len);
  int64_t qkv_max = 0, hd_max = 0, kv_max = 0, i2_max = 0, k_max = H;
  for (const Layer& L : stack.layers) {
    TORCH_CHECK(!L.local || (cosl.defined() && sinl.defined()),
                "decoder_stack: a sliding-window layer needs the local RoPE");
    const int64_t d = L.head_dim;
    const at::Tensor& c = L.local ? cosl : cos;
    const at::Tensor& sn = L.local ? sinl : sin;
    TORCH_CHECK(c.scalar_type() == at::kFloat && sn.scalar_type() == at::kFloat &&
                    c.dim() == 2 && c.size(0) == M && c.size(1) == d && sn.sizes() == c.sizes(),
                "rope: cos / sin must be float32 [", M, ", ", d, "]");
    qkv_max = std::max(qkv_max, L.p_qkv.N);
    hd_max = std::max(hd_max, L.heads * d);
    kv_max = std::max(kv_max, L.kv_heads * d);
    i2_max = std::max(i2_max, L.p_gate_up.N);
    for (const Prod* P : {&L.p_qkv, &L.p_o, &L.p_gate_up, &L.p_down})
      k_max = std::max(k_max, P->Kp);
  }
  std::vector<at::Tensor> out(1);
  std::vector<float*> keep_at(nl, nullptr);
  for (size_t i = 0; i < keep.size(); ++i) {
    TORCH_CHECK(keep[i] >= 0 && keep[i] < nl && (i == 0 || keep[i] > keep[i - 1]),
                "decoder_stack: keep must be increasing layer indices < ", nl);
    out.push_back(at::empty({M, H}, x_.options()));
    keep_at[keep[i]] = out.back().data_ptr<float>();
  }
  at::Tensor result = at::empty({M, H}, x_.options());
  // the shared rows: x (two, in turn), q/k/v, q and k after their norms, the attention's output,
  // a product's output before a sandwich norm, the residual stream after attention, gate/up, the
  // activation
  std::vector<float> xa(M * H), xb(M * H), y(M * qkv_max), qn(M * hd_max), kn(M * kv_max),
      a(M * hd_max), yo(M * H), mid(M * H), g(M * i2_max), act(M * i2_max / 2);
  std::vector<float> shared_partial;  // attention's runs, by (sequence, group, run)
  std::atomic<int64_t> next_item{0};   // the next of attention's (sequence, group, run) items
  std::memcpy(xa.data(), x_.contiguous().data_ptr<float>(), M * H * sizeof(float));
  Barrier bar;
  const int threads = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());

  auto body = [&](int t, int n) {
    thread_local RowScratch s;
    s.xn.resize(M * H);
    s.xq.resize(M * k_max);
    s.sx.resize(2 * M * (k_max / 32 + 1));
    s.scratch.resize(64 * (kAttnRun + 32));
    float* x = xa.data();
    float* xnext = xb.data();
    int64_t r0, r1;  // this thread's rows of the elementwise operators
    share(M, t, n, &r0, &r1);
    for (int64_t li = 0; li < nl; ++li) {
      const Layer& L = stack.layers[li];
      const float eps = static_cast<float>(L.eps);
      const int64_t h = L.heads, kv = L.kv_heads, d = L.head_dim, rep = h / kv;
      const int64_t N = L.p_qkv.N, I = L.p_gate_up.N / 2;
      if (t == 0 && keep_at[li]) std::memcpy(keep_at[li], x, M * H * sizeof(float));
      // q, k, v
      k.rms_norm(x, L.f_norm_in.data_ptr<float>(), eps, H, s.xn.data(), 0, M);
      rows_product(k, L.p_qkv, s.xn.data(), M, H, nullptr, y.data(), s, t, n,
                   L.f_qkv_bias.defined() ? L.f_qkv_bias.data_ptr<float>() : nullptr);
      bar.wait(n);
      // q / k norms, RoPE and the cache's new slots, for this thread's rows
      const float* cp = (L.local ? cosl : cos).data_ptr<float>();
      const float* sp = (L.local ? sinl : sin).data_ptr<float>();
      const bool qk_norm = L.f_q_norm.defined();
      const float* q = qk_norm ? qn.data() : y.data();
      const float* kr = qk_norm ? kn.data() : y.data() + h * d;
      const int64_t ldq = qk_norm ? h * d : N, ldk = qk_norm ? kv * d : N;
      const at::Tensor& kc = k_caches[li];
      const at::Tensor& vc = v_caches[li];
      const bool bf16 = kc.scalar_type() == at::kBFloat16;
      void* kcp = kc.data_ptr();
      void* vcp = vc.data_ptr();
      const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
      if (qk_norm) {
        for (int64_t m = r0; m < r1; ++m) {
          k.rms_norm(y.data() + m * N, L.f_q_norm.data_ptr<float>(), eps, d, qn.data() + m * h * d,
                     0, h);
          k.rms_norm(y.data() + m * N + h * d, L.f_k_norm.data_ptr<float>(), eps, d,
                     kn.data() + m * kv * d, 0, kv);
        }
        k.rope(qn.data(), h * d, h, d, cp, sp, r0, r1);
        k.rope(kn.data(), kv * d, kv, d, cp, sp, r0, r1);
      } else {
        k.rope(y.data(), N, h + kv, d, cp, sp, r0, r1);
      }
      for (int64_t m = r0; m < r1; ++m) {
        const int64_t b = m / T, slot = write_start + m % T;
        for (int64_t gi = 0; gi < kv; ++gi) {
          const int64_t at = b * ks0 + gi * ks1 + slot * ks2;
          store_row(kcp, bf16, at, kr + m * ldk + gi * d, d);
          store_row(vcp, bf16, at, y.data() + m * N + (h + kv + gi) * d, d);
        }
      }
      bar.wait(n);
      // attention. Over a long context with few groups of queries (a decode step or a verify
      // past 512 keys), the (sequence, key/value head, run of keys) items are taken by whichever
      // thread is free, every whole run before the last, shorter ones, each item reading its
      // run's keys once for every query of the group; then each thread combines its (sequence,
      // query head) pairs' runs. Otherwise each thread takes an equal share of the queries,
      // ordered (sequence, key/value head, position, head of the group), in calls of at most 64
      // queries of one key/value head. (A static share of the items had given one thread every
      // whole run and the other every short one; a share by query head, 5 heads against 4.)
      const RowsMask& msk = L.local ? ml : mg;
      const AttnView av{q, ldq, kcp, vcp, bf16, ks0, ks1, ks2, d, static_cast<float>(L.scale),
                        &msk};
      const int64_t stride = d + 2;  // floats of a query's partial
      if (msk.runs_max > 1 && T * rep <= 64 && B * kv < 4 * n) {
        const int64_t nq = T * rep, groups = B * kv, items = groups * msk.runs_max;
        const int64_t slot = nq * stride;  // floats of one item's partials
        if (t == 0) {
          shared_partial.resize(items * slot);
          next_item.store(0);
        }
        bar.wait(n);
        for (int64_t w = next_item++; w < items; w = next_item++) {
          const int64_t r = w / groups, bg = w % groups, b = bg / kv, gi = bg % kv;
          int64_t row[64], head[64];
          for (int64_t u = 0; u < nq; ++u) {
            row[u] = b * T + u / rep;
            head[u] = gi * rep + u % rep;
          }
          attend_queries(k, av, b, gi, r, nq, row, head, s.scratch.data(),
                         shared_partial.data() + (bg * msk.runs_max + r) * slot);
        }
        bar.wait(n);
        int64_t i0, i1;  // this thread's (sequence, query head) pairs
        share(B * h, t, n, &i0, &i1);
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t b = i / h, head = i % h, gi = head / rep;
          for (int64_t p = 0; p < T; ++p) {
            const int64_t row = b * T + p, u = p * rep + head % rep;
            finish_query(k, msk.last[row],
                         shared_partial.data() + (b * kv + gi) * msk.runs_max * slot + u * stride,
                         slot, d, a.data() + row * h * d + head * d);
          }
        }
      } else {
        s.partial.resize(msk.runs_max * 64 * stride);
        const int64_t per_group = T * rep;  // the queries of one (sequence, key/value head)
        int64_t q0, q1;
        share(B * kv * per_group, t, n, &q0, &q1);
        for (int64_t qi = q0; qi < q1;) {
          const int64_t bg = qi / per_group, b = bg / kv, gi = bg % kv;
          const int64_t qe = std::min(std::min(q1, (bg + 1) * per_group), qi + 64);
          const int64_t nq = qe - qi;
          int64_t row[64], head[64], runs = 1;
          for (int64_t u = 0; u < nq; ++u) {
            const int64_t w = qi + u - bg * per_group;  // (position, head of the group)
            row[u] = b * T + w / rep;
            head[u] = gi * rep + w % rep;
            runs = std::max(runs, attn_runs(msk.last[row[u]]));
          }
          for (int64_t r = 0; r < runs; ++r)
            attend_queries(k, av, b, gi, r, nq, row, head, s.scratch.data(),
                           s.partial.data() + r * 64 * stride);
          for (int64_t u = 0; u < nq; ++u)
            finish_query(k, msk.last[row[u]], s.partial.data() + u * stride, 64 * stride, d,
                         a.data() + row[u] * h * d + head[u] * d);
          qi = qe;
        }
      }
      bar.wait(n);
      // the output product and its residual
      if (L.f_norm_attn_out.defined()) {
        rows_product(k, L.p_o, a.data(), M, h * d, nullptr, yo.data(), s, t, n);
        bar.wait(n);
        k.rms_norm(yo.data(), L.f_norm_attn_out.data_ptr<float>(), eps, H, s.xn.data(), r0, r1);
        for (int64_t c = r0 * H; c < r1 * H; ++c) mid[c] = x[c] + s.xn[c];
      } else {
        rows_product(k, L.p_o, a.data(), M, h * d, x, mid.data(), s, t, n);
      }
      bar.wait(n);
      // the MLP
      k.rms_norm(mid.data(), L.f_norm_mlp_in.data_ptr<float>(), eps, H, s.xn.data(), 0, M);
      rows_product(k, L.p_gate_up, s.xn.data(), M, H, nullptr, g.data(), s, t, n);
      bar.wait(n);
      if (L.act == 0) k.silu_mul(g.data(), I, act.data(), r0, r1);
      else k.gelu_tanh_mul(g.data(), I, act.data(), r0, r1);
      bar.wait(n);
      if (L.f_norm_mlp_out.defined()) {
        rows_product(k, L.p_down, act.data(), M, I, nullptr, yo.data(), s, t, n);
        bar.wait(n);
        k.rms_norm(yo.data(), L.f_norm_mlp_out.data_ptr<float>(), eps, H, s.xn.data(), r0, r1);
        for (int64_t c = r0 * H; c < r1 * H; ++c) xnext[c] = mid[c] + s.xn[c];
      } else {
        rows_product(k, L.p_down, act.data(), M, I, mid.data(), xnext, s, t, n);
      }
      bar.wait(n);
      std::swap(x, xnext);
    }
    if (t == 0) std::memcpy(result.data_ptr<float>(), x, M * H * sizeof(float));
  };
  if (threads == 1) {
    body(0, 1);
  } else {
#pragma omp parallel num_threads(threads)
    body(omp_get_thread_num(), omp_get_num_threads());
  }
  out[0] = result;
  return out;
}

// Every layer of `stack` in turn on x [M, H]: layer i reads / writes k_caches[i] / v_caches[i]
// and takes the global (cos, sin, mask) or, for a sliding-window layer, the local ones.
// Returns [the last layer's output, then the input of each layer listed in `keep`].
std::vector<at::Tensor> decoder_stack(
    const c10::intrusive_ptr<LayerStack>& stack, const at::Tensor& x_, const at::Tensor& cos,
    const at::Tensor& sin, const c10::optional<at::Tensor>& cos_local,
    const c10::optional<at::Tensor>& sin_local, at::TensorList k_caches,
    at::TensorList v_caches, int64_t write_start, const c10::optional<at::Tensor>& write_index,
    int64_t view_len, const c10::optional<at::Tensor>& mask,
    const c10::optional<at::Tensor>& mask_local, int64_t batch, at::IntArrayRef keep) {
  const int64_t n = stack->size();
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == n &&
                  static_cast<int64_t>(v_caches.size()) == n,
              "decoder_stack: one key and one value buffer per layer (", n, ")");
  if (rows_ok(*stack, x_, k_caches, v_caches, write_start, view_len, batch))
    return rows_stack(*stack, x_, cos, sin, cos_local, sin_local, k_caches, v_caches,
                      write_start, view_len, mask, mask_local, batch, keep);
  const Step st{batch, write_start, view_len, &write_index};
  std::vector<at::Tensor> out(1);
  at::Tensor x = x_;
  size_t next = 0;
  for (int64_t i = 0; i < n; ++i) {
    while (next < keep.size() && keep[next] == i) {
      out.push_back(x);
      ++next;
    }
    const Layer& L = stack->layers[i];
    if (L.local)
      TORCH_CHECK(cos_local.has_value() && sin_local.has_value(),
                  "decoder_stack: a sliding-window layer needs the local RoPE");
    x = run_layer(L, x, L.local ? *cos_local : cos, L.local ? *sin_local : sin, k_caches[i],
                  v_caches[i], L.local ? mask_local : mask, st);
  }
  TORCH_CHECK(next == keep.size(), "decoder_stack: keep must be increasing layer indices < ", n);
  out[0] = x;
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exactspec, m) {
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<>())
      .def("add", &LayerStack::add)
      .def("size", &LayerStack::size);
  m.def(
      "decoder_stack(__torch__.torch.classes.exactspec.LayerStack stack, Tensor x, Tensor cos, "
      "Tensor sin, Tensor? cos_local, Tensor? sin_local, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, int write_start, Tensor? write_index, int view_len, Tensor? mask, "
      "Tensor? mask_local, int batch, int[] keep) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(exactspec, CPU, m) {
  m.impl("decoder_stack", decoder_stack);
}

}  // namespace exactspec
