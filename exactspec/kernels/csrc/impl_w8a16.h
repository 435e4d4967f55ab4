// The int8-weight product with int16 activations (the int8 self-draft's format on the kernels),
// written once over the integer lanes VI / XI of the including unit (vec_*.h), included after
// impl.h inside one namespace per ISA.
//
// Each row of x is quantized to int16 by the caller (ops.cpp: x_q = round(x * 32767 / amax),
// per row), so every product x_q * w is an integer and their sum over K is computed EXACTLY
// (int32 lanes, widened to int64 every KCHUNK inputs, long before a lane can overflow): the
// total is the same integer whatever the order, the lanes, the tiling, the ISA or the thread,
// and y = (float(total) * sx[m]) * scale[n] is one fixed rounding of it. So the three units
// agree bit for bit and a row's outputs never depend on the other rows of the call.
// Per 32 weights: one widening load and one multiply-add (AVX-512 VNNI: vpdpwssd), against
// two conversions and two FMAs per 32 on the float-activation path.
#pragma once

// inputs per int32 lane run: a lane adds 2 products of |x_q| <= 32767, |w| <= 128 per 32
// inputs, so 128 runs of 32 stay below 2^31 / (2 * 32767 * 128) = 256 runs
constexpr int64_t KCHUNK = 4096;

// The weights are packed (kernels.pack_int8): groups of 4 output rows, each group's K_p = K
// rounded up to 32 inputs (zero-padded) stored as K_p / 32 blocks of [4][32], so a group is one
// contiguous stream (measured, one-row, AVX-512 EPYC, 2 threads: 25 GB/s against 11 GB/s
// for four row-major rows of 576 bytes read side by side).

// y[i, 4g + j] for the MR rows at xq and the 4 rows of group g (j < nr: a padded last group)
template <int MR>
static void w8a16_tile(const int16_t* xq, int64_t ldx, int64_t Kp, const int8_t* wg,
                       const float* sx, const float* scale, float* y, int64_t ldy, int64_t n,
                       int64_t nr) {
  int64_t total[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) total[i][j] = 0;
  for (int64_t c0 = 0; c0 < Kp; c0 += KCHUNK) {
    const int64_t c1 = c0 + KCHUNK < Kp ? c0 + KCHUNK : Kp;
    VI acc[MR][4];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = vi_zero();
    for (int64_t k = c0; k < c1; k += 32) {
      const int8_t* p = wg + k * 4;  // block k / 32 of the group: [4][32]
      XI wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = vi_w32(p + j * 32);
      for (int i = 0; i < MR; ++i) {
        XI xv = vi_x32(xq + i * ldx + k);
        for (int j = 0; j < 4; ++j) acc[i][j] = vi_dot(acc[i][j], xv, wv[j]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 4; ++j) total[i][j] += vi_sum(acc[i][j]);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < nr; ++j) {
      float s = static_cast<float>(total[i][j]) * sx[i];
      if (scale) s = s * scale[n + j];
      y[i * ldy + n + j] = s;
    }
}

typedef void (*W8Fn)(const int16_t*, int64_t, int64_t, const int8_t*, const float*,
                     const float*, float*, int64_t, int64_t, int64_t);

// y[m, n] for the groups g in [g0, g1) (outputs n = 4g + j < N), m in [0, M): each group
// meets every row of x while in L1
static void linear_w8a16(const int16_t* xq, int64_t ldx, int64_t M, int64_t Kp,
                         const int8_t* w, const float* sx, const float* scale, float* y,
                         int64_t ldy, int64_t N, int64_t g0, int64_t g1) {
  static const W8Fn table[4] = {w8a16_tile<1>, w8a16_tile<2>, w8a16_tile<3>, w8a16_tile<4>};
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n = 4 * g, nr = N - n < 4 ? N - n : 4;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t mr = M - m0 < 4 ? M - m0 : 4;
      table[mr - 1](xq + m0 * ldx, ldx, Kp, w + g * 4 * Kp, sx + m0, scale, y + m0 * ldy, ldy,
                    n, nr);
    }
  }
}
