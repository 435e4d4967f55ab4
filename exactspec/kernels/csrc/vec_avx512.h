// 16 float lanes as one AVX-512 register.
#pragma once
#include <immintrin.h>
#include <cstdint>

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
#define ES_MR 4  // rows of x per register tile
#define ES_ROWS_NR1 2  // rows of x up to which tiles of ES_NR1 are used
#define ES_NR1 16  // columns of W per tile for one row of x
#define ES_NR 4  // columns of W per register tile
