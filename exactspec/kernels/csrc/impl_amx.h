// The bf16-weight product on AMX tiles (the amx unit only: isa_amx.cpp), used at every width.
//
// Other bits than the FMA units' for bf16 weights, said wherever the amx unit is named: x is
// rounded to bf16 (round to nearest even, vcvtne2ps2bf16) and TDPBF16PS adds the products of
// 32 inputs at a time in its own fixed way into a float32 accumulator. The invariance rule of
// isa.h still holds within the unit: an output y[m, n] is accumulated over the blocks of 32
// inputs in block order by one TDPBF16PS each, whose result for element (n, m) depends on the
// weights of output n, the inputs of row m and that element's accumulator only (Intel's
// definition of the instruction; tests/kernels/test_amx.py checks that a row's bits do not
// depend on the rows, infinities included, or the outputs beside it). Every width, tile
// position and thread count therefore gives the same bits; float32 and int8 weights run the
// avx512vnni unit's code, so those bits are every unit's.
//
// Layout: the weights are the A operand as they lie in memory (16 output rows x 32 inputs of
// bf16, row stride 2K bytes: no copy), x the B operand packed per call into pairs (row kp of a
// B tile: inputs 2kp and 2kp + 1 of 16 rows of x), C = 16 outputs x 16 rows of x in float32.
// A part of K (K % 32) is read through a zero-padded copy of the 16 x 32 block, a part group of
// outputs as the 16 rows ending at n1 (outputs before n are computed and not stored), or through
// a zero-padded copy when fewer than 16 rows precede n1.
#pragma once
#include <immintrin.h>

#include <vector>

#include "impl_bf16dot.h"  // bf16_pairs

// blocks of 32 inputs per chunk of K past 16 rows of x (2 tiles x 16 rows x 8 x 64 bytes = 16 KB
// of weights in L1; no effect on any result)
constexpr int64_t kAmxChunk = 8;
// bytes of packed x per chunk of rows past 16 rows (kept in L2 while every weight tile meets it)
constexpr int64_t kAmxXChunk = 512 << 10;

struct AmxConfig {  // the 64-byte tile configuration (palette 1)
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// every tile 16 rows x 64 bytes (which tile holds what: amx_tiles, amx_chunk)
static inline void amx_configure() {
  alignas(64) AmxConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// 16 x 16 32-bit values transposed in registers: the off-diagonal blocks of 8, 4, 2 and 1
// swapped in turn
static inline void transpose16(__m512* t) {
  // the permutation indices of stage b (block size 8, 4, 2, 1): lo[j] = (j & b) ? 16 + j - b : j,
  // hi[j] = (j & b) ? 16 + j : j + b
  alignas(64) static const int kIdx[4][2][16] = {
      {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
       {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}},
      {{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
       {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}},
      {{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
       {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}},
      {{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
       {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}}};
  _Pragma("GCC unroll 4") for (int s = 0; s < 4; ++s) {
    const int b = 8 >> s;
    const __m512i ilo = _mm512_load_si512(kIdx[s][0]), ihi = _mm512_load_si512(kIdx[s][1]);
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i)
      if (!(i & b)) {
        const __m512 a = t[i], d = t[i + b];
        t[i] = _mm512_permutex2var_ps(a, ilo, d);
        t[i + b] = _mm512_permutex2var_ps(a, ihi, d);
      }
  }
}

// the dword offsets 0, 16, ..., 240: column m of a 16 x 16 tile of dwords from element m
static inline __m512i amx_column() {
  return _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224,
                           240);
}

// xb[((g * KB + kb) * 16 + kp) * 32 + 2 * m + e] = bf16(x[16 g + m, 32 kb + 2 kp + e]) (zeros
// past K): a group of 4 or more rows as 16 x 16 pairs transposed in registers (rows past M
// zero), fewer rows scattered a pair at a time (the columns of rows past M left as they are:
// they only reach outputs that are not stored)
static void amx_pack_x(const float* x, int64_t M, int64_t K, int64_t KB, uint16_t* xb) {
  const __m512i idx = amx_column();  // dword kp of a row's pairs at kp * 64 bytes
  for (int64_t g = 0; g * 16 < M; ++g) {
    const int64_t mr = M - 16 * g < 16 ? M - 16 * g : 16;
    const float* xg = x + 16 * g * K;
    uint16_t* bg = xb + g * KB * 512;
    for (int64_t kb = 0; kb < KB; ++kb) {
      if (mr >= 4) {
        __m512 t[16];
        for (int64_t m = 0; m < 16; ++m)
          t[m] = m < mr ? bf16_pairs(xg + m * K, 32 * kb, K) : _mm512_setzero_ps();
        transpose16(t);  // t[kp] = dword kp of rows 0-15
        float* tile = reinterpret_cast<float*>(bg + kb * 512);
        for (int kp = 0; kp < 16; ++kp) _mm512_store_ps(tile + kp * 16, t[kp]);
      } else {
        for (int64_t m = 0; m < mr; ++m)
          _mm512_i32scatter_epi32(bg + kb * 512 + 2 * m, idx,
                                  reinterpret_cast<__m512i>(bf16_pairs(xg + m * K, 32 * kb, K)), 4);
      }
    }
  }
}

// c (16 outputs x 16 rows of x, row-major) transposed: t[m] = the 16 outputs of row m
static inline void amx_transpose(const float* c, __m512* t) {
  for (int i = 0; i < 16; ++i) t[i] = _mm512_load_ps(c + 16 * i);
  transpose16(t);
}

// the C tile's outputs [lo, hi) (times scale) for the rows [m0, m0 + mr) of y: y[.., n + o]
static inline void amx_store(const float* c, float* y, int64_t ldy, int64_t m0, int64_t mr,
                             int64_t n, int64_t lo, int64_t hi, const float* scale) {
  const __mmask16 keep = static_cast<__mmask16>((0xFFFFu << lo) & (0xFFFFu >> (16 - hi)));
  if (mr <= 2) {  // a row or two: gathered
    const __m512i col = amx_column();
    for (int64_t m = 0; m < mr; ++m) {
      __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32(m)), c, 4);
      if (scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(keep, scale + n));
      _mm512_mask_storeu_ps(y + (m0 + m) * ldy + n, keep, v);
    }
    return;
  }
  __m512 t[16];
  amx_transpose(c, t);
  const __m512 sv = scale ? _mm512_maskz_loadu_ps(keep, scale + n) : _mm512_setzero_ps();
  for (int64_t m = 0; m < mr; ++m) {
    const __m512 v = scale ? _mm512_mul_ps(t[m], sv) : t[m];
    _mm512_mask_storeu_ps(y + (m0 + m) * ldy + n, keep, v);
  }
}

// one weight tile: 16 rows from `a` (row stride lda elements), its part block of K from `tail`
struct AmxTile {
  const uint16_t* a;
  int64_t lda;
  const uint16_t* tail;  // 16 x 32, zero-padded (null when K % 32 == 0)
  int64_t n, lo, hi;     // its first output row in y, and its rows [lo, hi) to store
};

// (tile numbers are immediates: C tile J, weights in A = 5 or 6 by turns)
#define ES_AMX_STEP(J, A, T)                                                                 \
  if (J < T) {                                                                               \
    _tile_loadd(A, tiles[J].a + kb * 32, tiles[J].lda * 2);                                  \
    _tile_dpbf16ps(J, A, 4);                                                                 \
  }
#define ES_AMX_TAIL(J, A, T)                                                                 \
  if (J < T) {                                                                               \
    _tile_loadd(A, tiles[J].tail, 64);                                                       \
    _tile_dpbf16ps(J, A, 4);                                                                 \
  }
#define ES_AMX_OUT(J, T)                                                                     \
  if (J < T) {                                                                               \
    _tile_stored(J, c, 64);                                                                  \
    amx_store(c, y, ldy, 16 * g, mr, tiles[J].n, tiles[J].lo, tiles[J].hi, scale);           \
  }

// T (1-4) weight tiles against every group of 16 rows of x (packed in xb): C tile J in tmm J,
// x in tmm4, the weights in tmm5 / tmm6 by turns
template <int T>
static void amx_tiles(const AmxTile* tiles, const uint16_t* xb, int64_t M, int64_t KB,
                      int64_t KF, const float* scale, float* y, int64_t ldy) {
  alignas(64) float c[256];
  const int64_t groups = (M + 15) / 16;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t mr = M - 16 * g < 16 ? M - 16 * g : 16;
    const uint16_t* xg = xb + g * KB * 512;
    if (0 < T) _tile_zero(0);
    if (1 < T) _tile_zero(1);
    if (2 < T) _tile_zero(2);
    if (3 < T) _tile_zero(3);
    for (int64_t kb = 0; kb < KF; ++kb) {
      _tile_loadd(4, xg + kb * 512, 64);
      ES_AMX_STEP(0, 5, T)
      ES_AMX_STEP(1, 6, T)
      ES_AMX_STEP(2, 5, T)
      ES_AMX_STEP(3, 6, T)
    }
    if (KF < KB) {
      _tile_loadd(4, xg + KF * 512, 64);
      ES_AMX_TAIL(0, 5, T)
      ES_AMX_TAIL(1, 6, T)
      ES_AMX_TAIL(2, 5, T)
      ES_AMX_TAIL(3, 6, T)
    }
    ES_AMX_OUT(0, T)
    ES_AMX_OUT(1, T)
    ES_AMX_OUT(2, T)
    ES_AMX_OUT(3, T)
  }
}
#undef ES_AMX_STEP
#undef ES_AMX_TAIL
#undef ES_AMX_OUT

// Past 16 rows of x (prefill): TN (1-2) weight tiles against TM (1-2) groups of 16 rows, over
// the blocks [kb0, kb1) of K only, the accumulators loaded from cb (or zeroed at kb0 = 0) and
// stored back: the caller walks K in chunks whose weights stay in L1 while every group of x
// meets them. A float32 tile stored and loaded again is exact, so every output gets the same
// TDPBF16PS in the same block order as in amx_tiles: the same bits. C(i, j) (weight tile i,
// group j) in tmm 2i + j (the immediate T), kept at cb + (2 j + i) * 256; weights i in
// tmm 4 + i, x group j in tmm 6 + j.
#define ES_AMX_C(I, J, T, OP) \
  if (I < TN && J < TM) OP(T, cb + (2 * J + I) * 256, 64);
#define ES_AMX_ZERO(I, J, T) \
  if (I < TN && J < TM) _tile_zero(T);
template <int TN, int TM>
static void amx_chunk(const AmxTile* tiles, const uint16_t* xg, int64_t KB, int64_t KF,
                      int64_t kb0, int64_t kb1, float* cb) {
  if (kb0 == 0) {
    ES_AMX_ZERO(0, 0, 0) ES_AMX_ZERO(0, 1, 1) ES_AMX_ZERO(1, 0, 2) ES_AMX_ZERO(1, 1, 3)
  } else {
    ES_AMX_C(0, 0, 0, _tile_loadd) ES_AMX_C(0, 1, 1, _tile_loadd)
    ES_AMX_C(1, 0, 2, _tile_loadd) ES_AMX_C(1, 1, 3, _tile_loadd)
  }
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    _tile_loadd(6, xg + kb * 512, 64);
    if (TM > 1) _tile_loadd(7, xg + (KB + kb) * 512, 64);
    if (kb < KF) {
      _tile_loadd(4, tiles[0].a + kb * 32, tiles[0].lda * 2);
      if (TN > 1) _tile_loadd(5, tiles[1].a + kb * 32, tiles[1].lda * 2);
    } else {
      _tile_loadd(4, tiles[0].tail, 64);
      if (TN > 1) _tile_loadd(5, tiles[1].tail, 64);
    }
    _tile_dpbf16ps(0, 4, 6);
    if (TM > 1) _tile_dpbf16ps(1, 4, 7);
    if (TN > 1) _tile_dpbf16ps(2, 5, 6);
    if (TN > 1 && TM > 1) _tile_dpbf16ps(3, 5, 7);
  }
  ES_AMX_C(0, 0, 0, _tile_stored) ES_AMX_C(0, 1, 1, _tile_stored)
  ES_AMX_C(1, 0, 2, _tile_stored) ES_AMX_C(1, 1, 3, _tile_stored)
}
#undef ES_AMX_C
#undef ES_AMX_ZERO

// the part block of K of 16 weight rows (row stride lda) into tb, zero-padded to 16 x 32
static inline void amx_tail_copy(const uint16_t* a, int64_t lda, int64_t K, int64_t KF,
                                 uint16_t* tb) {
  std::memset(tb, 0, 512 * sizeof(uint16_t));
  for (int64_t r = 0; r < 16; ++r)
    std::memcpy(tb + r * 32, a + r * lda + KF * 32, (K - KF * 32) * sizeof(uint16_t));
}

// the weight tiles of the output rows [n, min(n + 16 * most, n1)) of w (n1 >= 16): 16 rows
// each, a part tile as the 16 rows ending at n1 (the rows before its first new output computed
// again, not stored); K's part block copied to tails; returns how many
static inline int amx_set_tiles(const uint16_t* w, int64_t K, int64_t KF, int64_t n, int64_t n1,
                                int most, uint16_t* tails, AmxTile* tiles) {
  int t = 0;
  for (int64_t nt = n; nt < n1 && t < most; nt += 16, ++t) {
    AmxTile& a = tiles[t];
    a.n = nt + 16 <= n1 ? nt : n1 - 16;
    a.lo = nt - a.n;
    a.hi = 16;
    a.a = w + a.n * K;
    a.lda = K;
    a.tail = nullptr;
    if (KF * 32 < K) {
      amx_tail_copy(a.a, K, K, KF, tails + t * 512);
      a.tail = tails + t * 512;
    }
  }
  return t;
}

// y[m, n] = scale[n] * sum_k bf16(x[m, k]) w[n, k] for n in [n0, n1), every m < M (see above)
static void linear_amx(const float* x, int64_t M, int64_t K, const uint16_t* w,
                       const float* scale, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if (n0 >= n1 || M <= 0) return;
  const int64_t KB = (K + 31) / 32, KF = K / 32, groups = (M + 15) / 16;
  thread_local std::vector<uint16_t> xbuf, tails, pad;
  thread_local std::vector<float> cbuf;
  const size_t xsize = static_cast<size_t>(groups * KB * 512);
  if (xbuf.size() < xsize + 32) xbuf.resize(xsize + 32);
  uint16_t* xb = xbuf.data() + (32 - (reinterpret_cast<uintptr_t>(xbuf.data()) / 2) % 32) % 32;
  amx_pack_x(x, M, K, KB, xb);  // 64-byte aligned tiles
  if (KF < KB && tails.size() < 4 * 512) tails.resize(4 * 512);
  amx_configure();
  if (n1 < 16) {  // fewer than 16 weight rows up to n1: rows [n0, n1) through a padded copy
    if (pad.size() < static_cast<size_t>(16 * K)) pad.resize(16 * K);
    std::memset(pad.data(), 0, 16 * K * sizeof(uint16_t));
    std::memcpy(pad.data(), w + n0 * K, (n1 - n0) * K * sizeof(uint16_t));
    AmxTile a{pad.data(), K, nullptr, n0, 0, n1 - n0};
    if (KF < KB) {
      amx_tail_copy(pad.data(), K, K, KF, tails.data());
      a.tail = tails.data();
    }
    amx_tiles<1>(&a, xb, M, KB, KF, scale, y, ldy);
  } else if (M <= 16) {  // one group of x: weight tiles four at a time
    for (int64_t n = n0; n < n1; n += 64) {
      AmxTile tiles[4];
      switch (amx_set_tiles(w, K, KF, n, n1, 4, tails.data(), tiles)) {
        case 1: amx_tiles<1>(tiles, xb, M, KB, KF, scale, y, ldy); break;
        case 2: amx_tiles<2>(tiles, xb, M, KB, KF, scale, y, ldy); break;
        case 3: amx_tiles<3>(tiles, xb, M, KB, KF, scale, y, ldy); break;
        default: amx_tiles<4>(tiles, xb, M, KB, KF, scale, y, ldy);
      }
    }
  } else {  // prefill: two weight tiles against pairs of groups, x and K in chunks (amx_chunk)
    if (cbuf.size() < static_cast<size_t>(groups * 2 * 256 + 16))
      cbuf.resize(groups * 2 * 256 + 16);
    float* cb = cbuf.data() + (16 - (reinterpret_cast<uintptr_t>(cbuf.data()) / 4) % 16) % 16;
    // the groups of x in chunks whose packed rows stay in L2 (kAmxXChunk bytes) while every
    // weight tile meets them, an even number: pairs of groups
    const int64_t gx = kAmxXChunk / (KB * 1024) / 2 * 2, gc = gx > 2 ? gx : 2;
    for (int64_t g0 = 0; g0 < groups; g0 += gc) {
      const int64_t g1 = g0 + gc < groups ? g0 + gc : groups;
      for (int64_t n = n0; n < n1; n += 32) {
        AmxTile tiles[2];
        const int t = amx_set_tiles(w, K, KF, n, n1, 2, tails.data(), tiles);
        for (int64_t kb0 = 0; kb0 < KB; kb0 += kAmxChunk) {
          const int64_t kb1 = kb0 + kAmxChunk < KB ? kb0 + kAmxChunk : KB;
          for (int64_t g = g0; g < g1; g += 2) {
            const uint16_t* xg = xb + g * KB * 512;
            float* c = cb + g * 2 * 256;  // group g's tiles, then group g + 1's
            const bool two = g + 1 < g1;
            if (t == 2 && two) amx_chunk<2, 2>(tiles, xg, KB, KF, kb0, kb1, c);
            else if (t == 2) amx_chunk<2, 1>(tiles, xg, KB, KF, kb0, kb1, c);
            else if (two) amx_chunk<1, 2>(tiles, xg, KB, KF, kb0, kb1, c);
            else amx_chunk<1, 1>(tiles, xg, KB, KF, kb0, kb1, c);
          }
        }
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t mr = M - 16 * g < 16 ? M - 16 * g : 16;
          for (int i = 0; i < t; ++i)
            amx_store(cb + (g * 2 + i) * 256, y, ldy, 16 * g, mr, tiles[i].n, tiles[i].lo,
                      tiles[i].hi, scale);
        }
      }
    }
  }
  _tile_release();
}
