// The int4-weight product with int8 activations (the int4 self-draft's format on the kernels),
// written once over the lanes of the including unit (vec_*.h), included after impl.h inside one
// namespace per ISA.
//
// Weights: groups of 32 inputs, w[n, k] = scale[n] * (d[n, g] * q[n, k] + m[n, g]) with q in
// 0..15 and d, m bfloat16 (models/quantize.py quantize_int4_kernel). Activations: each group of
// 32 inputs of a row rounded to int8 (quantize_i8g below: x_q = round(x * 127 / amax_g), sx_g =
// amax_g / 127), with their sum X_g. So a group's part of an output is sx_g (d S + m X_g), where
// S = sum_k x_q q is an exact integer (the lanes' order and the ISA do not matter), and the
// groups are added in group order, per output lane, by the same float operations on every unit:
//   a = float(S) * d;  a = fma(m, X_g, a);  y = fma(a, sx_g, y)   (then y * scale[n])
// So every unit computes the same bits, and a row's outputs never depend on the other rows.
//
// Lanes along OUTPUTS: the weights are packed (kernels.pack_int4) in panels of 16 output rows;
// a panel is one stream of blocks of 320 bytes, one per group: 4 x 64 bytes of nibbles (lane i
// = output i, 4 bytes each: low nibbles inputs 8c..8c+3, high nibbles 8c+4..8c+7 of the group),
// then d[16] and m[16] as bfloat16. A 64-byte load, masked into low and high nibbles, meets a
// row's 4 broadcast activations in one multiply-add of unsigned by signed bytes (vpdpbusd).
#pragma once

constexpr int64_t W4_NP = 16;      // output rows per panel
constexpr int64_t W4_GROUP = 32;   // inputs per group
constexpr int64_t W4_BLOCK = 320;  // bytes of a (panel, group) block
constexpr int64_t W4_AHEAD = 2 * W4_BLOCK;  // prefetch distance of the panel's stream

// y[i, n + j] for the MR rows at xq (their groups' sx / X at sxg / xsg, row stride ldg) and the
// outputs n + j (j < nr <= 16) of the panel at wp
template <int MR>
static void w4a8_tile(const int8_t* xq, int64_t ldx, const float* sxg, const float* xsg,
                      int64_t ldg, int64_t G, const uint8_t* wp, const float* scale, float* y,
                      int64_t ldy, int64_t n, int64_t nr) {
  V acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = vzero();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = wp + g * W4_BLOCK;
    __builtin_prefetch(b + W4_AHEAD, 0, 3);
    __builtin_prefetch(b + W4_AHEAD + 64, 0, 3);
    __builtin_prefetch(b + W4_AHEAD + 128, 0, 3);
    __builtin_prefetch(b + W4_AHEAD + 192, 0, 3);
    __builtin_prefetch(b + W4_AHEAD + 256, 0, 3);
    VI s0[MR], s1[MR];  // low and high nibbles: two independent chains
    for (int i = 0; i < MR; ++i) s0[i] = s1[i] = vi_zero();
    for (int c = 0; c < 4; ++c) {
      const QB w = vq_load(b + 64 * c), lo = vq_lo(w), hi = vq_hi(w);
      for (int i = 0; i < MR; ++i) {
        const int8_t* x = xq + i * ldx + W4_GROUP * g + 8 * c;
        s0[i] = vq_dot(s0[i], lo, x);
        s1[i] = vq_dot(s1[i], hi, x + 4);
      }
    }
    const V d = vload_bf16(reinterpret_cast<const uint16_t*>(b + 256));
    const V m = vload_bf16(reinterpret_cast<const uint16_t*>(b + 288));
    for (int i = 0; i < MR; ++i) {
      V a = vmul(vi_float(vi_add(s0[i], s1[i])), d);
      a = vfma(m, vset1(xsg[i * ldg + g]), a);
      acc[i] = vfma(a, vset1(sxg[i * ldg + g]), acc[i]);
    }
  }
  const V s = nr == 16 ? vload(scale + n) : loadx_tail(scale + n, nr);
  for (int i = 0; i < MR; ++i) {
    const V r = vmul(acc[i], s);
    if (nr == 16) {
      vstore(y + i * ldy + n, r);
    } else {
      float t[16];
      vstore(t, r);
      for (int64_t j = 0; j < nr; ++j) y[i * ldy + n + j] = t[j];
    }
  }
}

// One row of x [K] rounded to int8 in groups of 32 for linear_w4a8: for each group g < Kp / 32,
// xq[k] = round(x[k] * (127 / amax_g)) (the product rounded to float, then to the nearest
// integer, ties to even), clamped to +-127, zeros from K to Kp; sx[g] = amax_g / 127 and xs[g]
// = sum of the group's xq (exact). A group of zeros: zeros, sx 0; a NaN or an infinity in a
// group: zeros, sx NaN (NaN outputs). Over the float lanes V, so every unit computes the same.
static void quantize_i8g(const float* x, int64_t K, int64_t Kp, int8_t* xq, float* sx,
                         float* xs) {
  const V zero = vzero();
  for (int64_t k0 = 0; k0 < Kp; k0 += W4_GROUP) {
    V v[2];
    for (int h = 0; h < 2; ++h) {
      const int64_t k = k0 + 16 * h, r = K - k < 16 ? (K > k ? K - k : 0) : 16;
      v[h] = r == 16 ? vload(x + k) : (r > 0 ? loadx_tail(x + k, r) : zero);
    }
    const V mx = vmax(vmax(v[0], vsub(zero, v[0])), vmax(v[1], vsub(zero, v[1])));
    const V bad = vadd(vmul(v[0], zero), vmul(v[1], zero));
    bool nonfinite;
    const float amax = lanes_amax(mx, bad, &nonfinite);
    const int64_t g = k0 / W4_GROUP;
    if (nonfinite || !(amax > 0.0f)) {
      for (int64_t k = 0; k < W4_GROUP; ++k) xq[k0 + k] = 0;
      sx[g] = nonfinite ? __builtin_nanf("") : 0.0f;
      xs[g] = 0.0f;
      continue;
    }
    const V inv = vset1(127.0f / amax), hi = vset1(127.0f), lo = vset1(-127.0f);
    int32_t sum = 0;
    for (int h = 0; h < 2; ++h) {
      float t[16];
      vstore(t, vmax(vmin(vround(vmul(v[h], inv)), hi), lo));
      for (int i = 0; i < 16; ++i) {
        const int8_t q = static_cast<int8_t>(t[i]);
        xq[k0 + 16 * h + i] = q;
        sum += q;
      }
    }
    sx[g] = amax / 127.0f;
    xs[g] = static_cast<float>(sum);
  }
}

typedef void (*W4Fn)(const int8_t*, int64_t, const float*, const float*, int64_t, int64_t,
                     const uint8_t*, const float*, float*, int64_t, int64_t, int64_t);
template <class S> struct W4Table;
template <int... I> struct W4Table<std::integer_sequence<int, I...>> {
  static constexpr W4Fn fns[] = {w4a8_tile<I + 1>...};
};

// y[m, n] for the panels p in [p0, p1) (outputs n = 16 p + j < N), m in [0, M): each panel
// meets every row of x while in L1; G = Kp / 32 groups; xq rows of stride ldx, sx / xs rows
// of stride G
static void linear_w4a8(const int8_t* xq, int64_t ldx, const float* sx, const float* xs,
                        int64_t M, int64_t G, const uint8_t* w, const float* scale, float* y,
                        int64_t ldy, int64_t N, int64_t p0, int64_t p1) {
  const W4Fn* table = W4Table<std::make_integer_sequence<int, ES_W4_MR>>::fns;
  const int64_t tiles = (M + ES_W4_MR - 1) / ES_W4_MR;  // balanced tiles, as linear_w8a16's
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n = W4_NP * p, nr = N - n < W4_NP ? N - n : W4_NP;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t m0 = M * t / tiles, mr = M * (t + 1) / tiles - m0;
      table[mr - 1](xq + m0 * ldx, ldx, sx + m0 * G, xs + m0 * G, G, G, w + p * G * W4_BLOCK,
                    scale, y + m0 * ldy, ldy, n, nr);
    }
  }
}
