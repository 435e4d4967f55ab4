// One decoder layer of the lean forward as one operator (`exactspec::decoder_layer`): the same
// sequence of the same operators as exactspec/models/lean_kernels.py's per-operator loop
// (RMSNorm, fused q/k/v product, bias, q / k norms, RoPE, the SlotCache write, attention, the
// output product with its residual, the MLP), called as C++ functions (ops.h), so the same
// bits; what it saves is the per-operator cost of Python and the dispatcher (~20 calls per
// layer, 3.6 ms of a 25 ms smollm2 step and a third of the int8 draft's step, measured).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

namespace exactspec {
namespace {

// a product of the lean forward (formats.py's Matrix.kernel_args): float32 / bf16 / int8 parts
// with optional per-column scales (kernels.linear), or one int8 tensor packed by
// kernels.pack_int8 (4 dims) with its scales (kernels.linear_w8a16)
at::Tensor product(const at::Tensor& x, at::TensorList w, const c10::optional<at::Tensor>& scales,
                   const c10::optional<at::Tensor>& residual) {
  if (w.size() == 1 && w[0].dim() == 4) {
    TORCH_CHECK(scales.has_value(), "a packed int8 product needs its scales");
    return linear_w8a16(x, w[0], *scales, residual);
  }
  return linear(x, w, scales, residual);
}

// x + norm(y) when the layer has that (sandwich) norm, else y already holds x + product
at::Tensor add_normed(const at::Tensor& x, const at::Tensor& y,
                      const c10::optional<at::Tensor>& norm, double eps) {
  return x + rms_norm(y, *norm, eps);
}

// x [M, H] float32 (M = B * T rows, row-major by row then token); cos / sin [M, d]; the
// layer's SlotCache buffers k_cache / v_cache [B, kv, C, d] float32, written at slots
// write_start.. (every row alike, >= 0) or write_index [B, T], then attended over their first
// view_len slots under mask ([B, 1, T, S] / [B, T, S] bool, or none: all visible). act: 0 =
// SiLU, 1 = GELU (tanh). Returns the layer's output [M, H].
at::Tensor decoder_layer(
    const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
    const at::Tensor& v_cache, int64_t write_start, const c10::optional<at::Tensor>& write_index,
    int64_t view_len, const c10::optional<at::Tensor>& mask, int64_t batch,
    const at::Tensor& norm_in, double eps, at::TensorList qkv,
    const c10::optional<at::Tensor>& qkv_scales, const c10::optional<at::Tensor>& qkv_bias,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
    int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, at::TensorList o,
    const c10::optional<at::Tensor>& o_scales, const c10::optional<at::Tensor>& norm_attn_out,
    const at::Tensor& norm_mlp_in, at::TensorList gate_up,
    const c10::optional<at::Tensor>& gate_up_scales, int64_t act, at::TensorList down,
    const c10::optional<at::Tensor>& down_scales,
    const c10::optional<at::Tensor>& norm_mlp_out) {
  TORCH_CHECK(x.dim() == 2 && batch > 0 && x.size(0) % batch == 0,
              "decoder_layer: x must be [B * T, H] with B = ", batch, ", got ", x.sizes());
  const int64_t m = x.size(0), b = batch, t = m / b;
  const int64_t h = heads, kv = kv_heads, d = head_dim;
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == b && k_cache.size(1) == kv &&
                  k_cache.size(3) == d && v_cache.sizes() == k_cache.sizes() &&
                  view_len <= k_cache.size(2),
              "decoder_layer: the cache must be [", b, ", ", kv, ", >= ", view_len, ", ", d,
              "], got ", k_cache.sizes());
  const c10::optional<at::Tensor> none;
  at::Tensor y = product(rms_norm(x, norm_in, eps), qkv, qkv_scales, none);  // [M, (h+2kv) d]
  if (qkv_bias.has_value()) y = y + *qkv_bias;
  at::Tensor q, k;
  if (q_norm.has_value()) {  // per-head norms: rows of d in [M * heads, d] views
    q = rms_norm(y.slice(1, 0, h * d).reshape({m * h, d}), *q_norm, eps).view({m, h * d});
    k = rms_norm(y.slice(1, h * d, (h + kv) * d).reshape({m * kv, d}), *k_norm, eps)
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
  if (write_start >= 0) {  // SlotCache.update: every row writes at the same slots
    k_cache.narrow(2, write_start, t).copy_(k);
    v_cache.narrow(2, write_start, t).copy_(v);
  } else {
    TORCH_CHECK(write_index.has_value(), "decoder_layer: write_start < 0 needs write_index");
    const at::Tensor idx = write_index->view({b, 1, t, 1}).expand({b, kv, t, d});
    k_cache.scatter_(2, idx, k);
    v_cache.scatter_(2, idx, v);
  }
  at::Tensor a = attention(q, k_cache.narrow(2, 0, view_len), v_cache.narrow(2, 0, view_len),
                           mask, scale).view({m, h * d});
  at::Tensor out = norm_attn_out.has_value()
                       ? add_normed(x, product(a, o, o_scales, none), norm_attn_out, eps)
                       : product(a, o, o_scales, x);  // x + a W_o^T
  at::Tensor g = product(rms_norm(out, norm_mlp_in, eps), gate_up, gate_up_scales, none);
  g = act == 0 ? silu_mul(g) : gelu_tanh_mul(g);  // [M, I]
  return norm_mlp_out.has_value()
             ? add_normed(out, product(g, down, down_scales, none), norm_mlp_out, eps)
             : product(g, down, down_scales, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exactspec, m) {
  m.def(
      "decoder_layer(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "int write_start, Tensor? write_index, int view_len, Tensor? mask, int batch, "
      "Tensor norm_in, float eps, Tensor[] qkv, Tensor? qkv_scales, Tensor? qkv_bias, "
      "Tensor? q_norm, Tensor? k_norm, int heads, int kv_heads, int head_dim, float scale, "
      "Tensor[] o, Tensor? o_scales, Tensor? norm_attn_out, Tensor norm_mlp_in, "
      "Tensor[] gate_up, Tensor? gate_up_scales, int act, Tensor[] down, Tensor? down_scales, "
      "Tensor? norm_mlp_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(exactspec, CPU, m) {
  m.impl("decoder_layer", decoder_layer);
}

}  // namespace exactspec
