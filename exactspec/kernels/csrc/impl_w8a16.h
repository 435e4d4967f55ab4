// The int8-weight product with int16 activations (the int8 self-draft's format on the kernels),
// written once over the integer lanes VI / XI of the including unit (vec_*.h), included after
// impl.h inside one namespace per ISA.
//
// Each row of x is quantized to int16 first (quantize_i16 below: x_q = round(x * 32767 /
// amax), per row), so every product x_q * w is an integer and their sum over K is computed EXACTLY
// (int32 lanes, widened to int64 every KCHUNK inputs, before a lane can overflow): the total
// is the same integer whatever the order, the lanes, the tiling, the ISA or the thread, and
// y = (float(total) * sx[m]) * scale[n] is one fixed rounding of it. So the units agree bit
// for bit and a row's outputs never depend on the other rows of the call.
//
// Lanes along OUTPUTS: the weights are packed (kernels.pack_int8) in panels of NP = 32 output
// rows, each panel's K_p = K rounded up to 32 inputs (zero-padded) stored as K_p / 2 pairs of
// inputs, a pair holding [32 outputs][2 inputs], so a panel is one contiguous stream. A pair
// widened to int16 is two vectors whose lane i holds output i's two weights; a multiply-add
// with the row's two activations broadcast (vpdpwssd with an embedded broadcast on AVX-512
// VNNI) adds output i's two products to lane i. No horizontal sum: a lane is an output. Per 64
// weight bytes: 2 widening loads, then 2 multiply-adds per row of x (the 4-row groups with one
// horizontal int64 sum per output and 32 inputs per lane were slower: docs/performance.md).
#pragma once

// inputs per int32 lane run: a lane adds 2 products of |x_q| <= 32767, |w| <= 128 per pair of
// inputs, so 256 pairs reach at most 256 * 2 * 32767 * 128 = 2147418112 < 2^31
constexpr int64_t KCHUNK = 512;
constexpr int64_t NP = 32;  // output rows per panel (two vectors of 16 lanes)
// Software prefetch of the panel's stream: on Intel CPUs every tile 2048 bytes ahead into L1;
// on AMD's, tiles of 3 rows or more the same, tiles of 1 or 2 rows 256 bytes ahead
// non-temporal (prefetchnta), each the faster on its CPU (docs/performance.md)
constexpr int64_t W8_AHEAD = 2048, W8_AHEAD_NTA = 256;
static inline bool w8_prefetch_nta() {  // the CPU's vendor, read once
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return amd;
}

// y[i, n + j] for the MR rows at xq and the outputs n + j (j < nr <= NP) of the panel at wp;
// U independent accumulator sets over consecutive pairs (few rows: the multiply-add latency)
template <int MR, int U, bool NTA>
static void w8a16_tile(const int16_t* xq, int64_t ldx, int64_t Kp, const int8_t* wp,
                       const float* sx, const float* scale, float* y, int64_t ldy, int64_t n,
                       int64_t nr) {
  int64_t total[MR][NP];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP; ++j) total[i][j] = 0;
  for (int64_t c0 = 0; c0 < Kp; c0 += KCHUNK) {
    const int64_t c1 = c0 + KCHUNK < Kp ? c0 + KCHUNK : Kp;
    VI acc[U][MR][2];
    for (int u = 0; u < U; ++u)
      for (int i = 0; i < MR; ++i) acc[u][i][0] = acc[u][i][1] = vi_zero();
    for (int64_t k = c0; k < c1; k += 2 * U) {  // Kp and KCHUNK are multiples of 32 >= 2U
      for (int u = 0; u < U; ++u) {
        if (MR >= 3 || !NTA) __builtin_prefetch(wp + (k + 2 * u) * NP + W8_AHEAD, 0, 3);
        else __builtin_prefetch(wp + (k + 2 * u) * NP + W8_AHEAD_NTA, 0, 0);
      }
      for (int u = 0; u < U; ++u) {
        const int8_t* p = wp + (k + 2 * u) * NP;  // the pair (k + 2u) / 2: [32][2]
        const XI w0 = vi_w32(p), w1 = vi_w32(p + 32);
        for (int i = 0; i < MR; ++i) {
          const int16_t* xi = xq + i * ldx + k + 2 * u;
          acc[u][i][0] = vi_dot_pair(acc[u][i][0], w0, xi);
          acc[u][i][1] = vi_dot_pair(acc[u][i][1], w1, xi);
        }
      }
    }
    for (int u = 0; u < U; ++u)
      for (int i = 0; i < MR; ++i) {
        vi_add64(total[i], acc[u][i][0]);
        vi_add64(total[i] + 16, acc[u][i][1]);
      }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < nr; j += 16)
      vi_out16(total[i] + j, sx[i], scale ? scale + n + j : nullptr, y + i * ldy + n + j,
               static_cast<int>(nr - j < 16 ? nr - j : 16));
}

// The largest of mx's lanes (|x| so far), and whether a lane of bad (the sum of x * 0) is not 0:
// a NaN or an infinity passed. The rows' rounding (quantize_i16, impl_w4.h's quantize_i8g).
static inline float lanes_amax(V mx, V bad, bool* nonfinite) {
  float m[16], b[16];
  vstore(m, mx);
  vstore(b, bad);
  float amax = 0.0f, sum = 0.0f;
  for (int i = 0; i < 16; ++i) {
    amax = m[i] > amax ? m[i] : amax;
    sum += b[i];
  }
  *nonfinite = sum != 0.0f;
  return amax;
}

// One row of x rounded to int16 for the product: q[k] = round(x[k] * (32767 / amax)) (the
// product rounded to float, then to the nearest integer, ties to even), clamped to +-32767,
// for k < K and 0 up to Kp; *sx = amax / 32767. A row of zeros: zeros, sx 0; a NaN or an
// infinity anywhere: zeros, sx NaN (NaN outputs). Over the float lanes V, so every unit
// computes the same integers.
static void quantize_i16(const float* x, int64_t K, int64_t Kp, int16_t* q, float* sx) {
  const V zero = vzero();
  V mx = zero, bad = zero;
  for (int64_t k = 0; k < K; k += 16) {
    const V v = K - k >= 16 ? vload(x + k) : loadx_tail(x + k, K - k);
    mx = vmax(mx, vmax(v, vsub(zero, v)));  // |v| (finite v)
    bad = vadd(bad, vmul(v, zero));         // stays 0 unless some v is NaN or infinite
  }
  bool nonfinite;
  const float amax = lanes_amax(mx, bad, &nonfinite);
  if (nonfinite || !(amax > 0.0f)) {
    for (int64_t k = 0; k < Kp; ++k) q[k] = 0;
    *sx = nonfinite ? __builtin_nanf("") : 0.0f;
    return;
  }
  const V inv = vset1(32767.0f / amax), hi = vset1(32767.0f), lo = vset1(-32767.0f);
  for (int64_t k = 0; k < K; k += 16) {
    const int64_t r = K - k < 16 ? K - k : 16;
    const V v = vmax(vmin(vround(vmul(r == 16 ? vload(x + k) : loadx_tail(x + k, r), inv)), hi),
                     lo);
    if (r == 16) {
      vstore_i16(q + k, v);
    } else {
      int16_t t[16];
      vstore_i16(t, v);
      for (int64_t i = 0; i < r; ++i) q[k + i] = t[i];
    }
  }
  for (int64_t k = K; k < Kp; ++k) q[k] = 0;
  *sx = amax / 32767.0f;
}

typedef void (*W8Fn)(const int16_t*, int64_t, int64_t, const int8_t*, const float*,
                     const float*, float*, int64_t, int64_t, int64_t);

// accumulator sets for a tile of MR rows (the unit's register budget: vec_*.h)
constexpr int w8_unroll(int mr) { return mr == 1 ? ES_W8_U1 : (mr <= ES_W8_U2MR ? 2 : 1); }
template <class S, bool NTA> struct W8Table;
template <int... I, bool NTA> struct W8Table<std::integer_sequence<int, I...>, NTA> {
  static constexpr W8Fn fns[] = {w8a16_tile<I + 1, w8_unroll(I + 1), NTA>...};
};

// y[m, n] for the panels g in [g0, g1) (outputs n = NP g + j < N), m in [0, M): each panel
// meets every row of x while in L1
static void linear_w8a16(const int16_t* xq, int64_t ldx, int64_t M, int64_t Kp,
                         const int8_t* w, const float* sx, const float* scale, float* y,
                         int64_t ldy, int64_t N, int64_t g0, int64_t g1) {
  using Rows = std::make_integer_sequence<int, ES_W8_MR>;
  static const W8Fn* table = w8_prefetch_nta() ? W8Table<Rows, true>::fns
                                                : W8Table<Rows, false>::fns;
  // rows in ceil(M / ES_W8_MR) balanced tiles (AVX-512, 8: 45 rows as 7 8 7 8 7 8, not
  // 8 x 5 + 5; 9 rows as 4 5, not 8 + a one-row pass)
  const int64_t tiles = (M + ES_W8_MR - 1) / ES_W8_MR;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n = NP * g, nr = N - n < NP ? N - n : NP;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t m0 = M * t / tiles, mr = M * (t + 1) / tiles - m0;
      table[mr - 1](xq + m0 * ldx, ldx, Kp, w + g * NP * Kp, sx + m0, scale, y + m0 * ldy,
                    ldy, n, nr);
    }
  }
}
