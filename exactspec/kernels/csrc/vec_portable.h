// 16 float lanes as a plain array: the same arithmetic as the vector units (fmaf for every
// fused multiply-add; compiled with -ffp-contract=off so nothing else is fused).
#pragma once
#include <cstdint>
#include <cstring>

struct V { float l[16]; };
#define ES_LANES(expr) { V r; for (int i = 0; i < 16; ++i) r.l[i] = (expr); return r; }
static inline V vzero() ES_LANES(0.0f)
static inline V vset1(float a) ES_LANES(a)
static inline V vload(const float* p) ES_LANES(p[i])
static inline V vload_bf16(const uint16_t* p) {
  V r;
  for (int i = 0; i < 16; ++i) {
    uint32_t u = static_cast<uint32_t>(p[i]) << 16;
    std::memcpy(&r.l[i], &u, 4);
  }
  return r;
}
static inline V vload_i8(const int8_t* p) ES_LANES(static_cast<float>(p[i]))
static inline void vstore(float* p, V a) { for (int i = 0; i < 16; ++i) p[i] = a.l[i]; }
static inline void vstore_i16(int16_t* p, V a) {  // integral lanes within int16
  for (int i = 0; i < 16; ++i) p[i] = static_cast<int16_t>(a.l[i]);
}
static inline V vfma(V a, V b, V c) ES_LANES(__builtin_fmaf(a.l[i], b.l[i], c.l[i]))
static inline V vadd(V a, V b) ES_LANES(a.l[i] + b.l[i])
static inline V vsub(V a, V b) ES_LANES(a.l[i] - b.l[i])
static inline V vmul(V a, V b) ES_LANES(a.l[i] * b.l[i])
static inline V vdiv(V a, V b) ES_LANES(a.l[i] / b.l[i])
static inline V vmin(V a, V b) ES_LANES(a.l[i] < b.l[i] ? a.l[i] : b.l[i])
static inline V vmax(V a, V b) ES_LANES(a.l[i] > b.l[i] ? a.l[i] : b.l[i])
static inline V vround(V a) ES_LANES(__builtin_rintf(a.l[i]))
static inline V vpow2i(V n) {
  V r;
  for (int i = 0; i < 16; ++i) {
    uint32_t u = static_cast<uint32_t>(static_cast<int32_t>(n.l[i]) + 127) << 23;
    std::memcpy(&r.l[i], &u, 4);
  }
  return r;
}
static inline float vhsum(V a) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = a.l[i] + a.l[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  float s2a = s4[0] + s4[2], s2b = s4[1] + s4[3];
  return s2a + s2b;
}
static inline V vhsum16v(const V* a) ES_LANES(vhsum(a[i]))  // lane i = vhsum(a[i])
// o[u]'s lanes [4h, 4h + 4) <-> o[h]'s lanes [4u, 4u + 4) for u, h < 4 (data movement only)
static inline void vblocks4(V* o) {
  V r[4];
  for (int u = 0; u < 4; ++u)
    for (int h = 0; h < 4; ++h)
      for (int t = 0; t < 4; ++t) r[u].l[4 * h + t] = o[h].l[4 * u + t];
  for (int u = 0; u < 4; ++u) o[u] = r[u];
}
// o[0] = (o[0]'s lanes 0-7, o[1]'s lanes 0-7), o[1] = (o[0]'s lanes 8-15, o[1]'s lanes 8-15)
static inline void vhalves2(V* o) {
  V r[2];
  for (int u = 0; u < 2; ++u)
    for (int t = 0; t < 8; ++t) {
      r[u].l[t] = o[0].l[8 * u + t];
      r[u].l[8 + t] = o[1].l[8 * u + t];
    }
  o[0] = r[0];
  o[1] = r[1];
}
#undef ES_LANES
// the tiling of attention's values (impl_attn.h; no effect on any result): queries x chunks
// of 16 of d in registers
#define ES_ATT_G 1
#define ES_ATT_CW 4
// the tiling of the matrix product (see vec_avx512.h)
#define ES_ROWS_NR1 1  // rows of x up to which tiles of ES_NR1 are used
#define ES_NR1 8  // columns of W per tile for one row of x
#define ES_AHEAD1 0
#define ES_MR 4
#define ES_MR_CONV 4
#define ES_NR_CONV ES_NR
#define ES_CONV_ONCE 64  // past this many rows of x, bf16 / int8 blocks converted once (linear_conv)
#define ES_MR_LARGE ES_MR  // ... for float32 weights past 16 rows of x
#define ES_NR 4
#define ES_NB 4
#define ES_NB_LARGE 32
#define ES_MB (int64_t{1} << 40)
// prefill (impl.h's linear_bc; no effect on any result): from this many rows of x, panels of
// 16 * ES_BC_NV outputs against blocks of ES_BC_MR rows (ES_BC_MR x ES_BC_NV accumulators)
#define ES_BC_ROWS 256
#define ES_BC_MR 4
#define ES_BC_NV 1
#define ES_BC_GROUP (256 << 10)  // bytes of packed panels per group (half of a 512 KB L2)
#define ES_PF_LOC 3
#define ES_AHEAD_F32 0
#define ES_PF_LOC1 ES_PF_LOC
#define ES_W8_MR 4  // the int8 product's tiling (see vec_avx512.h)
#define ES_W8_U1 2
#define ES_W8_U2MR 1
static inline void vkeep(V&) {}

// ---- 16 int32 lanes for the int8-weight x int16-activation product (impl_w8a16.h) ----
struct VI { int32_t l[16]; };
struct XI { int16_t l[32]; };
static inline VI vi_zero() { VI r; for (int i = 0; i < 16; ++i) r.l[i] = 0; return r; }
static inline XI vi_w32(const int8_t* w) { XI r; for (int i = 0; i < 32; ++i) r.l[i] = w[i]; return r; }
static inline XI vi_pair(const int16_t* x) {  // (x[0], x[1]) in every lane
  XI r; for (int i = 0; i < 32; ++i) r.l[i] = x[i & 1]; return r;
}
static inline VI vi_dot(VI acc, XI x, XI w) {
  for (int i = 0; i < 16; ++i)
    acc.l[i] += x.l[2 * i] * w.l[2 * i] + x.l[2 * i + 1] * w.l[2 * i + 1];
  return acc;
}
static inline VI vi_dot_pair(VI acc, XI w, const int16_t* x) { return vi_dot(acc, w, vi_pair(x)); }
static inline void vi_add64(int64_t* t, VI a) { for (int i = 0; i < 16; ++i) t[i] += a.l[i]; }
// y[j] = (float(t[j]) * sx) * scale[j] (scale null: float(t[j]) * sx) for j < nr <= 16
static inline void vi_out16(const int64_t* t, float sx, const float* scale, float* y, int nr) {
  for (int j = 0; j < nr; ++j) {
    float s = static_cast<float>(t[j]) * sx;
    if (scale) s = s * scale[j];
    y[j] = s;
  }
}

// ---- the int4-weight x int8-activation product (impl_w4.h) ----
struct QB { uint8_t l[64]; };
static inline QB vq_load(const uint8_t* p) { QB r; for (int i = 0; i < 64; ++i) r.l[i] = p[i]; return r; }
static inline QB vq_lo(QB w) { for (int i = 0; i < 64; ++i) w.l[i] &= 0x0F; return w; }
static inline QB vq_hi(QB w) { for (int i = 0; i < 64; ++i) w.l[i] >>= 4; return w; }
static inline VI vq_dot(VI acc, QB w, const int8_t* x) {
  for (int i = 0; i < 16; ++i)
    for (int b = 0; b < 4; ++b) acc.l[i] += static_cast<int32_t>(w.l[4 * i + b]) * x[b];
  return acc;
}
static inline VI vi_add(VI a, VI b) { for (int i = 0; i < 16; ++i) a.l[i] += b.l[i]; return a; }
static inline V vi_float(VI a) {
  float f[16];
  for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(a.l[i]);
  return vload(f);
}
#define ES_W4_MR 4
