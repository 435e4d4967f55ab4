// 16 float lanes as one AVX-512 register.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

struct V { __m512 v; };
static inline V vzero() { return {_mm512_setzero_ps()}; }
static inline V vset1(float a) { return {_mm512_set1_ps(a)}; }
static inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline V vload_bf16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
static inline V vload_i8(const int8_t* p) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))};
}
static inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a.v); }
static inline void vstore_i16(int16_t* p, V a) {  // integral lanes within int16
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(a.v));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}
static inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline V vsub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline V vdiv(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
static inline V vmin(V a, V b) { return {_mm512_min_ps(a.v, b.v)}; }
static inline V vmax(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline V vround(V a) {  // to nearest, ties to even
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
static inline V vpow2i(V n) {  // 2^n for integral n in [-126, 127]
  __m512i i = _mm512_cvtps_epi32(n.v);
  i = _mm512_slli_epi32(_mm512_add_epi32(i, _mm512_set1_epi32(127)), 23);
  return {_mm512_castsi512_ps(i)};
}
// ((l0+l8) + (l4+l12)) + ((l2+l10) + (l6+l14)) + ... : halves, then quarters, then pairs
static inline float vhsum(V a) {
  __m256 lo = _mm512_castps512_ps256(a.v);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
  __m256 s8 = _mm256_add_ps(lo, hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}
// lane i = vhsum(a[i]) for 16 vectors, bit for bit: the same pairs added in the same tree
// (halves, quarters, pairs), four vectors' stages per instruction (attention's scores)
static inline V vhsum16v(const V* a) {
  __m512 t[8], u[4], v[2];
  for (int p = 0; p < 8; ++p)  // lanes 0-7: a[2p]'s l[i] + l[i+8]; lanes 8-15: a[2p+1]'s
    t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p].v, a[2 * p + 1].v, 0x44),
                         _mm512_shuffle_f32x4(a[2 * p].v, a[2 * p + 1].v, 0xEE));
  for (int r = 0; r < 4; ++r)  // block b: a[4r + b]'s s8[i] + s8[i+4]
    u[r] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * r], t[2 * r + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * r], t[2 * r + 1], 0xDD));
  for (int s = 0; s < 2; ++s)  // block b: [s4[0]+s4[2], s4[1]+s4[3]] of a[8s + b], a[8s + 4 + b]
    v[s] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * s], u[2 * s + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * s], u[2 * s + 1], 0xEE));
  // lane 4b + l: the sum of a[4l + b]
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88),
                                 _mm512_shuffle_ps(v[0], v[1], 0xDD));
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return {_mm512_permutexvar_ps(idx, w)};
}
// o[u]'s lanes [4h, 4h + 4) <-> o[h]'s lanes [4u, 4u + 4) for u, h < 4 (a transpose of 4-lane
// blocks; data movement only)
static inline void vblocks4(V* o) {
  const __m512 t0 = _mm512_shuffle_f32x4(o[0].v, o[1].v, 0x44);
  const __m512 t1 = _mm512_shuffle_f32x4(o[0].v, o[1].v, 0xEE);
  const __m512 t2 = _mm512_shuffle_f32x4(o[2].v, o[3].v, 0x44);
  const __m512 t3 = _mm512_shuffle_f32x4(o[2].v, o[3].v, 0xEE);
  o[0].v = _mm512_shuffle_f32x4(t0, t2, 0x88);
  o[1].v = _mm512_shuffle_f32x4(t0, t2, 0xDD);
  o[2].v = _mm512_shuffle_f32x4(t1, t3, 0x88);
  o[3].v = _mm512_shuffle_f32x4(t1, t3, 0xDD);
}
// o[0] = (o[0]'s lanes 0-7, o[1]'s lanes 0-7), o[1] = (o[0]'s lanes 8-15, o[1]'s lanes 8-15)
static inline void vhalves2(V* o) {
  const __m512 a = _mm512_shuffle_f32x4(o[0].v, o[1].v, 0x44);
  o[1].v = _mm512_shuffle_f32x4(o[0].v, o[1].v, 0xEE);
  o[0].v = a;
}
// the tiling of attention's values (impl_attn.h; no effect on any result): queries x chunks
// of 16 of d in registers
#define ES_ATT_G 6
#define ES_ATT_CW 4
// the tiling of the matrix product (impl.h's linear_t; no effect on any result)
#define ES_ROWS_NR1 1  // rows of x up to which tiles of ES_NR1 are used
#define ES_NR1 16  // columns of W per tile for one row of x
#define ES_AHEAD1 16  // weight rows ahead that those tiles prefetch (0: none)
#define ES_MR 8  // rows of x per register tile (float32 weights; 32 accumulators, a few spill)
#define ES_MR_CONV 8  // ... for bf16 / int8 weights up to 16 rows of x, in tiles of ES_NR_CONV columns
#define ES_NR_CONV 2
#define ES_CONV_ONCE 64  // past this many rows of x, bf16 / int8 blocks converted once (linear_conv)
#define ES_MR_LARGE 6  // ... for float32 weights past 16 rows of x (24 accumulators, no spill)
#define ES_NR 4  // columns of W per register tile
#define ES_NB 16  // weight rows per block, up to 16 rows of x
#define ES_NB_LARGE 16  // ... from 17 rows of x
#define ES_MB 64  // rows of x per chunk
// prefill (impl.h's linear_bc; no effect on any result): from this many rows of x, panels of
// 16 * ES_BC_NV outputs against blocks of ES_BC_MR rows (ES_BC_MR x ES_BC_NV accumulators)
#define ES_BC_ROWS 256
#define ES_BC_MR 8
#define ES_BC_NV 3
#define ES_BC_GROUP (512 << 10)  // bytes of packed panels per group (a fraction of L2)
#define ES_AHEAD_F32 2  // float32 weight rows ahead that the one-row stream prefetches
#define ES_PF_LOC1 2  // ... and the one-row tiles, into L2 (prefetcht1; into L1: no faster here)
#define ES_PF_LOC 2  // prefetch into L2 (prefetcht1): into L1 it evicts x (several rows)
// the tiling of the int8 product (impl_w8a16.h; no effect on any result): rows per tile at
// most, accumulator sets for one row, tiles of up to this many rows take 2 sets (2 x 32
// accumulators: the 32 registers)
#define ES_W8_MR 8
#define ES_W8_U1 4
#define ES_W8_U2MR 4
// keep a loaded vector in a register (the compiler would otherwise fold the load into every
// multiply-add that uses it)
static inline void vkeep(V& a) { __asm__("" : "+v"(a.v)); }

// ---- 16 int32 lanes for the int8-weight x int16-activation product (impl_w8a16.h) ----
struct VI { __m512i v; };
static inline VI vi_zero() { return {_mm512_setzero_si512()}; }
// 32 int8 weights widened to int16
static inline __m512i vi_w32(const int8_t* w) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
// lane i += a[2i] b[2i] + a[2i+1] b[2i+1] (int16 pairs)
static inline VI vi_dot(VI acc, __m512i a, __m512i b) {
#ifdef ES_VNNI
  return {_mm512_dpwssd_epi32(acc.v, a, b)};
#else
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(a, b))};
#endif
}
// two int16 activations (x[0], x[1]) in every lane (folded into vpdpwssd's embedded broadcast)
static inline __m512i vi_pair(const int16_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}
// acc lane i += w[2i] x[0] + w[2i+1] x[1]: vi_dot(acc, w, vi_pair(x)) with the broadcast
// embedded in vpdpwssd (the compiler shares one vpbroadcastd between the multiply-adds of a
// row, an extra vector instruction where the broadcast in the memory operand costs none)
static inline VI vi_dot_pair(VI acc, __m512i w, const int16_t* x) {
#ifdef ES_VNNI
  __asm__("vpdpwssd %2%{1to16%}, %1, %0"
          : "+v"(acc.v) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
#else
  return vi_dot(acc, w, vi_pair(x));
#endif
}
static inline void vi_add64(int64_t* t, VI a) {  // t[i] += lane i, exact: widened first
  __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(a.v));
  __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a.v, 1));
  _mm512_storeu_si512(t, _mm512_add_epi64(_mm512_loadu_si512(t), lo));
  _mm512_storeu_si512(t + 8, _mm512_add_epi64(_mm512_loadu_si512(t + 8), hi));
}
// y[j] = (float(t[j]) * sx) * scale[j] (scale null: float(t[j]) * sx) for j < nr <= 16, with
// |t[j]| < 2^51: float(t) as float(double(t)), double(t) exact by the 1.5 * 2^52 trick (no
// AVX-512 DQ), one rounding to float: the bits of the scalar static_cast<float>(t)
static inline void vi_out16(const int64_t* t, float sx, const float* scale, float* y, int nr) {
  const __m512i magic_i = _mm512_set1_epi64(0x4338000000000000LL);
  const __m512d magic_d = _mm512_set1_pd(6755399441055744.0);  // 1.5 * 2^52
  __m256 f[2];
  for (int h = 0; h < 2; ++h) {
    __m512i v = _mm512_add_epi64(_mm512_loadu_si512(t + 8 * h), magic_i);
    f[h] = _mm512_cvtpd_ps(_mm512_sub_pd(_mm512_castsi512_pd(v), magic_d));
  }
  __m512 r = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(f[0])),
                                                 _mm256_castps_pd(f[1]), 1));
  r = _mm512_mul_ps(r, _mm512_set1_ps(sx));
  const __mmask16 m = nr >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nr) - 1);
  if (scale) r = _mm512_mul_ps(r, _mm512_maskz_loadu_ps(m, scale));
  _mm512_mask_storeu_ps(y, m, r);
}
typedef __m512i XI;  // 32 int16 activations / weights widened to int16

// ---- the int4-weight x int8-activation product (impl_w4.h) ----
typedef __m512i QB;  // 64 bytes of packed weights: lane i's 4 bytes, two nibbles each
static inline QB vq_load(const uint8_t* p) { return _mm512_loadu_si512(p); }
static inline QB vq_lo(QB w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
static inline QB vq_hi(QB w) {
  return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F));
}
// lane i += sum_b w[4i + b] x[b] (w unsigned 0..15, x four int8 activations): vpdpbusd with
// the activations' broadcast in its memory operand; without VNNI vpmaddubsw (|pair| <= 3810,
// no saturation) and vpmaddwd by ones: the same integers
static inline VI vq_dot(VI acc, QB w, const int8_t* x) {
#ifdef ES_VNNI
  __asm__("vpdpbusd %2%{1to16%}, %1, %0"
          : "+v"(acc.v) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
#else
  int32_t v;
  std::memcpy(&v, x, 4);
  const __m512i p = _mm512_maddubs_epi16(w, _mm512_set1_epi32(v));
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(p, _mm512_set1_epi16(1)))};
#endif
}
static inline VI vi_add(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
static inline V vi_float(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }  // exact below 2^24
#define ES_W4_MR 8  // rows per tile of the int4 product (3 accumulators a row; impl_w4.h)
