// 16 float lanes as two AVX2 registers (lanes 0-7, 8-15): the same arithmetic as AVX-512.
#pragma once
#include <immintrin.h>
#include <unistd.h>
#include <cstdint>
#include <cstring>

// the L1 data cache's bytes (glibc's reading of CPUID; 32 KB where it says nothing)
static inline int64_t l1d_bytes() {
  static const int64_t bytes = [] {
    const long b = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return static_cast<int64_t>(b > 0 ? b : 32768);
  }();
  return bytes;
}
struct V { __m256 a, b; };
static inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
// 8 bf16 as 8 floats (exact): the 16 bytes broadcast to both 128-bit lanes by the load, then one
// in-lane byte shuffle puts each into the high half of its float (zeros below), a single µop
// off the multiply-adds' ports (a widening and a shift took two, one of them on theirs)
static inline __m256 bf16x8(const uint16_t* p) {
  const __m256i b =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i idx = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,
                                       -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14,
                                       15);
  return _mm256_castsi256_ps(_mm256_shuffle_epi8(b, idx));
}
static inline V vload_bf16(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
static inline __m256 i8x8(const int8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
static inline V vload_i8(const int8_t* p) { return {i8x8(p), i8x8(p + 8)}; }
// 8 weights of a type at w + off as floats (impl.h's half tiles)
template <int WT> static inline __m256 whalf(const void* w, int64_t off) {
  if (WT == W_F32) return _mm256_loadu_ps(static_cast<const float*>(w) + off);
  if (WT == W_BF16) return bf16x8(static_cast<const uint16_t*>(w) + off);
  return i8x8(static_cast<const int8_t*>(w) + off);
}
static inline void vstore(float* p, V x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
static inline void vstore_i16(int16_t* p, V x) {  // integral lanes within int16
  __m256i h = _mm256_packs_epi32(_mm256_cvtps_epi32(x.a), _mm256_cvtps_epi32(x.b));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(h, 0xD8));
}
static inline V vfma(V x, V y, V z) {
  return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)};
}
#define ES_V2(name, op) \
  static inline V name(V x, V y) { return {op(x.a, y.a), op(x.b, y.b)}; }
ES_V2(vadd, _mm256_add_ps)
ES_V2(vsub, _mm256_sub_ps)
ES_V2(vmul, _mm256_mul_ps)
ES_V2(vdiv, _mm256_div_ps)
ES_V2(vmin, _mm256_min_ps)
ES_V2(vmax, _mm256_max_ps)
static inline V vround(V x) {
  const int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.a, r), _mm256_round_ps(x.b, r)};
}
static inline __m256 pow2i8(__m256 n) {
  __m256i i = _mm256_cvtps_epi32(n);
  i = _mm256_slli_epi32(_mm256_add_epi32(i, _mm256_set1_epi32(127)), 23);
  return _mm256_castsi256_ps(i);
}
static inline V vpow2i(V n) { return {pow2i8(n.a), pow2i8(n.b)}; }
static inline float vhsum(V x) {
  __m256 s8 = _mm256_add_ps(x.a, x.b);  // lane i: l[i] + l[i + 8], as AVX-512's halves
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}
// lane i = vhsum(x[i]) for 8 vectors, bit for bit: the same pairs added in the same tree
// (halves, quarters, pairs), two vectors' stages per instruction
static inline __m256 vhsum8v(const V* x) {
  __m256 u[4], v[2];
  for (int r = 0; r < 4; ++r) {  // 128-bit half h: x[2r + h]'s s8[i] + s8[i+4]
    const __m256 s0 = _mm256_add_ps(x[2 * r].a, x[2 * r].b);
    const __m256 s1 = _mm256_add_ps(x[2 * r + 1].a, x[2 * r + 1].b);
    u[r] = _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20),
                         _mm256_permute2f128_ps(s0, s1, 0x31));
  }
  for (int s = 0; s < 2; ++s)
    v[s] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * s], u[2 * s + 1], 0x44),
                         _mm256_shuffle_ps(u[2 * s], u[2 * s + 1], 0xEE));
  // lane 4h + l: the sum of x[2l + h]
  const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(v[0], v[1], 0x88),
                                 _mm256_shuffle_ps(v[0], v[1], 0xDD));
  const __m256i idx = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  return _mm256_permutevar8x32_ps(w, idx);
}
// lane i = vhsum(a[i]) for 16 vectors, in two groups of 8
static inline V vhsum16v(const V* a) { return {vhsum8v(a), vhsum8v(a + 8)}; }
// o[u]'s lanes [4h, 4h + 4) <-> o[h]'s lanes [4u, 4u + 4) for u, h < 4 (a transpose of 4-lane
// blocks; data movement only)
static inline void vblocks4(V* o) {
  const V p0 = o[0], p1 = o[1], p2 = o[2], p3 = o[3];
  o[0] = {_mm256_permute2f128_ps(p0.a, p1.a, 0x20), _mm256_permute2f128_ps(p2.a, p3.a, 0x20)};
  o[1] = {_mm256_permute2f128_ps(p0.a, p1.a, 0x31), _mm256_permute2f128_ps(p2.a, p3.a, 0x31)};
  o[2] = {_mm256_permute2f128_ps(p0.b, p1.b, 0x20), _mm256_permute2f128_ps(p2.b, p3.b, 0x20)};
  o[3] = {_mm256_permute2f128_ps(p0.b, p1.b, 0x31), _mm256_permute2f128_ps(p2.b, p3.b, 0x31)};
}
// o[0] = (o[0]'s lanes 0-7, o[1]'s lanes 0-7), o[1] = (o[0]'s lanes 8-15, o[1]'s lanes 8-15)
static inline void vhalves2(V* o) {
  const V p0 = o[0], p1 = o[1];
  o[0] = {p0.a, p1.a};
  o[1] = {p0.b, p1.b};
}
// the tiling of attention's values (impl_attn.h; no effect on any result): queries x chunks
// of 16 of d in registers: 6 queries x one chunk (12 accumulators; the chunk's 2 registers,
// loaded once for 6 queries, and a query's weight), faster at verify widths than 2 x 2
// (docs/performance.md, "The AMX machine, seventh pass")
#define ES_ATT_G 6
#define ES_ATT_CW 1
// the tiling of the matrix product (see vec_avx512.h; 16 registers and an accumulator takes
// two, so 4 rows x 1 column: 8 accumulator registers, the weight and the row of x in 4 more;
// the figures in docs/performance.md, "Register tiles")
#define ES_ROWS_NR1 1  // rows of x up to which tiles of ES_NR1 are used
#define ES_NR1 4  // columns of W per tile for one row of x
#define ES_AHEAD1 16
#define ES_MR 4
#define ES_NR 1
// 2-16 rows of x: tiles of one 8-lane half of V at a time (impl.h's tile_half), ES_HALF_MR rows
// x ES_HALF_NR columns: 8 accumulators, 4 x and 2 weight registers, each x load meeting 2
// columns (V's tiles load x once per multiply-add pair: bound by loads, not multiply-adds)
#define ES_HALF_TILES 1
#define ES_HALF_MR 4
#define ES_HALF_NR 2
// ... where a pass (a group's rows of x and a tile's weight rows over all of K) does not fit L1
// (down_proj's K = 1536 at 3 or more rows): blocks of this many weight rows meet every group in
// chunks of ES_HALF_KC inputs (impl.h's half_chunked)
#define ES_HALF_CHUNK_NB 8
#define ES_HALF_KC 256
#define ES_MR_CONV 4  // ... for bf16 / int8 weights up to 16 rows of x, in tiles of ES_NR_CONV columns
#define ES_NR_CONV 1
#define ES_CONV_ONCE 64  // past this many rows of x, bf16 / int8 blocks converted once (linear_conv)
#define ES_MR_LARGE ES_MR  // ... for float32 weights past 16 rows of x
// weight rows per block up to 16 rows of x: a float32 block of K = 576 and 8 rows of x stay in
// L1 through the half tiles' four passes (8 rows where L1 holds 48 KB, 4 where it holds 32 KB;
// docs/performance.md)
#define ES_NB (l1d_bytes() >= (48 << 10) ? 8 : 4)
#define ES_NB_LARGE 32
#define ES_MB (int64_t{1} << 40)
// prefill (impl.h's linear_bc; no effect on any result): from this many rows of x, panels of
// 16 * ES_BC_NV outputs against blocks of ES_BC_MR rows (ES_BC_MR x ES_BC_NV accumulators)
#define ES_BC_ROWS 256
#define ES_BC_MR 6
#define ES_BC_NV 1
#define ES_BC_GROUP (256 << 10)  // bytes of packed panels per group (half of a 512 KB L2)
#define ES_PF_LOC 2
#define ES_AHEAD_F32 2  // float32 weight rows ahead that the one-row stream prefetches (as AVX-512)
#define ES_PF_LOC1 ES_PF_LOC
// the int8 product's tiling (see vec_avx512.h; 16 registers, an accumulator takes two: fewer
// rows per tile than AVX-512's, docs/performance.md)
#define ES_W8_MR 4
#define ES_W8_U1 2
#define ES_W8_U2MR 1
static inline void vkeep(V&) {}

// ---- 16 int32 lanes for the int8-weight x int16-activation product (impl_w8a16.h) ----
struct VI { __m256i a, b; };
struct XI { __m256i a, b; };  // 32 int16 values
static inline VI vi_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline XI vi_w32(const int8_t* w) {
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))),
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)))};
}
static inline XI vi_pair(const int16_t* x) {  // (x[0], x[1]) in every lane
  int32_t v;
  std::memcpy(&v, x, 4);
  return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)};
}
static inline VI vi_dot(VI acc, XI x, XI w) {
  return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(x.a, w.a)),
          _mm256_add_epi32(acc.b, _mm256_madd_epi16(x.b, w.b))};
}
static inline VI vi_dot_pair(VI acc, XI w, const int16_t* x) { return vi_dot(acc, w, vi_pair(x)); }
static inline void vi_add64(int64_t* t, VI a) {  // t[i] += lane i, exact: widened first
  int32_t l[16];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(l), a.a);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(l + 8), a.b);
  for (int i = 0; i < 16; ++i) t[i] += l[i];
}
// y[j] = (float(t[j]) * sx) * scale[j] (scale null: float(t[j]) * sx) for j < nr <= 16
static inline void vi_out16(const int64_t* t, float sx, const float* scale, float* y, int nr) {
  for (int j = 0; j < nr; ++j) {
    float s = static_cast<float>(t[j]) * sx;
    if (scale) s = s * scale[j];
    y[j] = s;
  }
}

// ---- the int4-weight x int8-activation product (impl_w4.h) ----
struct QB { __m256i a, b; };  // 64 bytes of packed weights: lane i's 4 bytes, two nibbles each
static inline QB vq_load(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
static inline QB vq_lo(QB w) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(w.a, m), _mm256_and_si256(w.b, m)};
}
static inline QB vq_hi(QB w) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(w.a, 4), m),
          _mm256_and_si256(_mm256_srli_epi16(w.b, 4), m)};
}
// lane i += sum_b w[4i + b] x[b] (w unsigned 0..15): vpmaddubsw (|pair| <= 3810, no
// saturation), then vpmaddwd by ones: the integers of AVX-512 VNNI's vpdpbusd
static inline VI vq_dot(VI acc, QB w, const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  const __m256i b = _mm256_set1_epi32(v), one = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(_mm256_maddubs_epi16(w.a, b), one)),
          _mm256_add_epi32(acc.b, _mm256_madd_epi16(_mm256_maddubs_epi16(w.b, b), one))};
}
static inline VI vi_add(VI x, VI y) {
  return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)};
}
static inline V vi_float(VI x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
#define ES_W4_MR 2  // rows per tile of the int4 product (16 registers; impl_w4.h)
