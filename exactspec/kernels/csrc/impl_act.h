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
  for (int64_t m = m0; m < m1; ++m) {
    const float* gate = g + m * 2 * I;
    const float* up = gate + I;
    float* yr = y + m * I;
    for (int64_t i = 0; i < I; i += 16) {
      const int64_t r = I - i < 16 ? I - i : 16;
      V x = r == 16 ? vload(gate + i) : loadx_tail(gate + i, r);
      V uv = r == 16 ? vload(up + i) : loadx_tail(up + i, r);
      V inner = vfma(vmul(c3, vmul(x, x)), x, x);  // x + 0.044715 x^3
      V s = vdiv(x, vadd(one, vexp(vmul(minus_two_k, inner))));
      float out[16];
      vstore(out, vmul(s, uv));
      for (int64_t j = 0; j < r; ++j) yr[i + j] = out[j];
    }
  }
}

#include "impl_w8a16.h"
const Isa isa = {ES_NAME, linear, rms_norm, silu_mul, rope, attend, gelu_tanh_mul,
                 linear_w8a16};
