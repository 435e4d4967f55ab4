// Activations beyond impl.h's (the Llama relatives of exactspec/models/lean_arch.py), written
// once over the 16-lane type V of the including unit, included after impl.h inside one
// namespace per ISA; the invariance rule of isa.h holds: each output is computed from its own
// inputs by the same V operations in every unit, whether it sits in a full 16-lane chunk or
// in the tail (read through a zero-padded copy), so a value never depends on the call's width.
#pragma once

// ---- gelu_tanh(gate) * up, elementwise (transformers' gelu_pytorch_tanh, GeGLU) ----
// 0.5 x (1 + tanh(u)) = x sigmoid(2u) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3):
// one exp, no cancellation near tanh = -1
static void gelu_tanh_mul(const float* g, int64_t I, float* y, int64_t m0, int64_t m1) {
  const V one = vset1(1.0f), c3 = vset1(0.044715f);
  const V minus_two_k = vset1(-1.5957691216057308f);  // -2 sqrt(2/pi)
  gated(g, I, y, m0, m1, [&](V x) {  // impl.h
    V inner = vfma(vmul(c3, vmul(x, x)), x, x);  // x + 0.044715 x^3
    return vdiv(x, vadd(one, vexp(vmul(minus_two_k, inner))));
  });
}

#include "impl_w8a16.h"
#include "impl_w4.h"
#include "impl_attn.h"
const Isa isa = {ES_NAME, linear, rms_norm, silu_mul, rope, attend_run<float>, attend_finish,
                 gelu_tanh_mul, linear_w8a16, quantize_i16, linear_w4a8, quantize_i8g,
                 attend_run<uint16_t>};
