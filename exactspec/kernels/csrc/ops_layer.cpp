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
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <vector>

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
    k_cache.scatter_(2, idx, k);
    v_cache.scatter_(2, idx, v);
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
    layers.push_back(std::move(L));
  }
  int64_t size() const { return static_cast<int64_t>(layers.size()); }
};

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
