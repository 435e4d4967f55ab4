// The operators of ops.cpp and ops_act.cpp as C++ functions, for operators that compose them
// (ops_layer.cpp's decoder layer): the same code, hence the same bits, without the dispatcher.
#pragma once
#include <ATen/ATen.h>

namespace exactspec {

at::Tensor linear(const at::Tensor& x, at::TensorList weights,
                  const c10::optional<at::Tensor>& scales,
                  const c10::optional<at::Tensor>& residual);
at::Tensor linear_w8a16(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& residual);
// a product of the lean forward as the decoder layer takes it (ops_layer.cpp): float32 / bf16 /
// int8 parts with optional per-column scales (linear), or one packed int8 (linear_w8a16) or
// int4 (linear_w4a8) tensor with its scales
at::Tensor product(const at::Tensor& x, at::TensorList w, const c10::optional<at::Tensor>& scales,
                   const c10::optional<at::Tensor>& residual);
at::Tensor linear_w4a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& residual);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up);
void rope_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads);
// y[m, c] += r[m, c] for the columns [c0, c1) of M rows of N: the bits of torch's x + linear(...)
void add_residual(float* y, const float* r, int64_t M, int64_t N, int64_t c0, int64_t c1);
// the last key a query sees under its mask row of S bools (null: every key), -1 for none, and
// whether it sees every key up to that one (attention's plan of a query)
int64_t last_visible(const uint8_t* visible, int64_t S, bool* dense);
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, double scale);

}  // namespace exactspec
