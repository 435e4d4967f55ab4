// The kernels, written once over the 16-lane type V of the including unit (vec_*.h), which
// also defines ES_MR x ES_NR, the register tile of the matrix product. Included inside one
// namespace per ISA. See isa.h for the invariance rule every function here keeps.
#pragma once

// ---- loads of 16 weights of a type; a tail of n < 16 is read through a zero-padded copy ----
// bytes of one weight of a type
template <int WT> static constexpr int64_t wbytes = WT == W_F32 ? 4 : WT == W_BF16 ? 2 : 1;
template <int WT> static inline V loadw(const void* w, int64_t off);
template <> inline V loadw<W_F32>(const void* w, int64_t off) {
  return vload(static_cast<const float*>(w) + off);
}
template <> inline V loadw<W_BF16>(const void* w, int64_t off) {
  return vload_bf16(static_cast<const uint16_t*>(w) + off);
}
template <> inline V loadw<W_I8>(const void* w, int64_t off) {
  return vload_i8(static_cast<const int8_t*>(w) + off);
}
template <int WT> static inline V loadw_tail(const void* w, int64_t off, int64_t n) {
  if (WT == W_F32) {
    float b[16] = {0};
    for (int64_t i = 0; i < n; ++i) b[i] = static_cast<const float*>(w)[off + i];
    return vload(b);
  } else if (WT == W_BF16) {
    uint16_t b[16] = {0};
    for (int64_t i = 0; i < n; ++i) b[i] = static_cast<const uint16_t*>(w)[off + i];
    return vload_bf16(b);
  } else {
    int8_t b[16] = {0};
    for (int64_t i = 0; i < n; ++i) b[i] = static_cast<const int8_t*>(w)[off + i];
    return vload_i8(b);
  }
}
static inline V loadx_tail(const float* p, int64_t n) {
  float b[16] = {0};
  for (int64_t i = 0; i < n; ++i) b[i] = p[i];
  return vload(b);
}

// out[i] = vhsum(a[i]) for 16 vectors (the unit's vhsum16v, stored)
static inline void vhsum16(const V* a, float* out) { vstore(out, vhsum16v(a)); }

// ---- matrix product: an MR x NR tile of outputs, each its own 16-lane accumulator ----
// (every loop over the tile is unrolled, so the accumulators live in registers)
#define ES_UNROLL _Pragma("GCC unroll 16")
template <int WT, int MR, int NR>
static void tile(const float* x, int64_t K, const void* w, const float* scale, float* y,
                 int64_t ldy, int64_t n, int64_t ahead) {
  V acc[MR][NR];
  ES_UNROLL for (int i = 0; i < MR; ++i)
    ES_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
  // ahead > 0: prefetch the weight rows `ahead` rows further on (the same tile of the next
  // block) into L2 while this tile computes, so memory streams under the arithmetic (see
  // linear_t); no effect on any result
  constexpr int64_t wb = wbytes<WT>;
  const char* pf = static_cast<const char*>(w) + (n + ahead) * K * wb;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    V wv[NR];
    if (ahead)
      ES_UNROLL for (int j = 0; j < NR; ++j) {
        if (MR == 1) __builtin_prefetch(pf + (j * K + k) * wb, 0, ES_PF_LOC1);
        else __builtin_prefetch(pf + (j * K + k) * wb, 0, ES_PF_LOC);
      }
    ES_UNROLL for (int j = 0; j < NR; ++j) wv[j] = loadw<WT>(w, (n + j) * K + k);
    ES_UNROLL for (int i = 0; i < MR; ++i) {
      V xv = vload(x + i * K + k);
      vkeep(xv);  // one load of x per row, not one per multiply-add
      ES_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {
    const int64_t r = K - k;
    V wv[NR];
    ES_UNROLL for (int j = 0; j < NR; ++j) wv[j] = loadw_tail<WT>(w, (n + j) * K + k, r);
    ES_UNROLL for (int i = 0; i < MR; ++i) {
      V xv = loadx_tail(x + i * K + k, r);
      ES_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  if constexpr (MR * NR >= 12) {  // the horizontal sums 16 at a time (vhsum16: the same bits)
    constexpr int T = MR * NR, C = (T + 15) / 16;
    V all[16 * C];
    ES_UNROLL for (int i = 0; i < MR; ++i)
      ES_UNROLL for (int j = 0; j < NR; ++j) all[i * NR + j] = acc[i][j];
    ES_UNROLL for (int t = T; t < 16 * C; ++t) all[t] = vzero();
    float s[16 * C];
    ES_UNROLL for (int c = 0; c < C; ++c) vhsum16(all + 16 * c, s + 16 * c);
    ES_UNROLL for (int i = 0; i < MR; ++i)
      ES_UNROLL for (int j = 0; j < NR; ++j)
        y[i * ldy + n + j] = scale ? s[i * NR + j] * scale[n + j] : s[i * NR + j];
  } else {
    ES_UNROLL for (int i = 0; i < MR; ++i)
      ES_UNROLL for (int j = 0; j < NR; ++j) {
        float s = vhsum(acc[i][j]);
        if (scale) s = s * scale[n + j];
        y[i * ldy + n + j] = s;
      }
  }
}

typedef void (*TileFn)(const float*, int64_t, const void*, const float*, float*, int64_t, int64_t,
                       int64_t);

// shape_table's (isa.h) tiles of each shape: tile<WT, mr, nr>
template <int WT> struct TileFns {
  using Fn = TileFn;
  template <int MR, int NR> static constexpr Fn of = tile<WT, MR, NR>;
};

#ifdef ES_HALF_TILES
// The tile above for a unit whose V is two 8-lane registers (AVX2), one half at a time: lanes
// 0-7 of every output of the tile over all of K, then lanes 8-15, so that MR x NR accumulators,
// MR rows of x and NR weight vectors fit the 16 registers. Each lane gets the same fused
// multiply-adds in the same order as in `tile` (V's halves never meet before the horizontal
// sum), the same tail (zero-padded) and the same sum: the same bits.
//
// The weights a call reads are prefetched by one cursor that every tile of the call advances
// (no effect on any result): one line of 64 bytes every `period` k-steps, the rate at which the
// tiles' passes (2 halves x the groups of rows) first touch the weights, starting a block of
// rows ahead. Each weight line is read from memory by one pass only; prefetching from that pass
// alone (as `tile` does) asks for a block's lines in a quarter of its time at 8 rows, and the
// memory then idles while the other passes compute (docs/performance.md, "eighth pass").
struct PfCursor {
  const char* cur;  // the next line to prefetch
  const char* end;  // the end of the weight rows of the call
  int period;       // k-steps (of 16 inputs, any tile, any half) per line
  int count;        // k-steps left before the next line
};
// the full k-steps [k0, k1) of both halves of an MR x NR tile at weight row n: each half's
// accumulators keep[(h * MR + i) * NR + j] loaded, advanced in k order and stored back (exactly)
template <int WT, int MR, int NR>
static void half_steps(const float* x, int64_t K, const void* w, int64_t n, int64_t k0,
                       int64_t k1, __m256* keep, PfCursor* pf) {
  const char* pc = pf->cur;
  int count = pf->count;
  ES_UNROLL for (int h = 0; h < 2; ++h) {
    __m256 acc[MR][NR];
    ES_UNROLL for (int i = 0; i < MR; ++i)
      ES_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = keep[(h * MR + i) * NR + j];
    for (int64_t k = k0; k < k1; k += 16) {
      if (--count == 0) {
        count = pf->period;
        if (pc < pf->end) {
          __builtin_prefetch(pc, 0, ES_PF_LOC);
          pc += 64;
        }
      }
      __m256 wv[NR];
      ES_UNROLL for (int j = 0; j < NR; ++j) wv[j] = whalf<WT>(w, (n + j) * K + k + 8 * h);
      ES_UNROLL for (int i = 0; i < MR; ++i) {
        __m256 xv = _mm256_loadu_ps(x + i * K + k + 8 * h);
        __asm__("" : "+x"(xv));  // one load of x per row, not one per multiply-add
        ES_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
    ES_UNROLL for (int i = 0; i < MR; ++i)
      ES_UNROLL for (int j = 0; j < NR; ++j) keep[(h * MR + i) * NR + j] = acc[i][j];
  }
  pf->cur = pc;
  pf->count = count;
}

// the tile's tail (inputs from KF = K - K % 16, zero-padded) on both halves, then its outputs:
// y[i * ldy + n + j] = scale[n + j] * vhsum of (half 0, half 1)
template <int WT, int MR, int NR>
static void half_finish(const float* x, int64_t K, const void* w, const float* scale, float* y,
                        int64_t ldy, int64_t n, __m256* keep) {
  const int64_t KF = K - K % 16;
  if (KF < K) {
    const int64_t r = K - KF;
    ES_UNROLL for (int h = 0; h < 2; ++h) {
      __m256 wv[NR];
      ES_UNROLL for (int j = 0; j < NR; ++j) {
        const V t = loadw_tail<WT>(w, (n + j) * K + KF, r);
        wv[j] = h ? t.b : t.a;
      }
      ES_UNROLL for (int i = 0; i < MR; ++i) {
        const V t = loadx_tail(x + i * K + KF, r);
        const __m256 xv = h ? t.b : t.a;
        ES_UNROLL for (int j = 0; j < NR; ++j)
          keep[(h * MR + i) * NR + j] = _mm256_fmadd_ps(xv, wv[j], keep[(h * MR + i) * NR + j]);
      }
    }
  }
  // the horizontal sums 8 at a time (vhsum8v: vhsum's bits in a third of the instructions of
  // 8 sums one by one)
  static_assert(MR * NR <= 8, "tile_half sums at most 8 outputs at once");
  V all[8];
  ES_UNROLL for (int i = 0; i < MR; ++i)
    ES_UNROLL for (int j = 0; j < NR; ++j)
      all[i * NR + j] = {keep[i * NR + j], keep[(MR + i) * NR + j]};
  ES_UNROLL for (int t = MR * NR; t < 8; ++t) all[t] = vzero();
  float s[8];
  _mm256_storeu_ps(s, vhsum8v(all));
  ES_UNROLL for (int i = 0; i < MR; ++i)
    ES_UNROLL for (int j = 0; j < NR; ++j)
      y[i * ldy + n + j] = scale ? s[i * NR + j] * scale[n + j] : s[i * NR + j];
}

template <int WT, int MR, int NR>
static void tile_half(const float* x, int64_t K, const void* w, const float* scale, float* y,
                      int64_t ldy, int64_t n, PfCursor* pf) {
  __m256 keep[2 * MR * NR];
  ES_UNROLL for (int i = 0; i < 2 * MR * NR; ++i) keep[i] = _mm256_setzero_ps();
  half_steps<WT, MR, NR>(x, K, w, n, 0, K - K % 16, keep, pf);
  half_finish<WT, MR, NR>(x, K, w, scale, y, ldy, n, keep);
}

// Rows of x whose K does not leave room in L1 for a pass of tile_half (a group's rows of x and
// a tile's weight rows; down_proj's K = 1536 at 3 or more rows, where the second half would
// read them all again from L2): a block's tiles and groups meet one chunk of K
// (ES_HALF_KC inputs) at a time, so that chunk of every row of x and of the block's weight
// rows stays in L1 while all of them use it; each tile's accumulators wait in memory between
// chunks (exactly), every lane still adds its products in k order, the tail and the sums last:
// the same bits as tile_half.
typedef void (*StepsFn)(const float*, int64_t, const void*, int64_t, int64_t, int64_t, __m256*,
                        PfCursor*);
typedef void (*FinishFn)(const float*, int64_t, const void*, const float*, float*, int64_t,
                         int64_t, __m256*);
template <int WT> struct StepsFns {
  using Fn = StepsFn;
  template <int MR, int NR> static constexpr Fn of = half_steps<WT, MR, NR>;
};
template <int WT> struct FinishFns {
  using Fn = FinishFn;
  template <int MR, int NR> static constexpr Fn of = half_finish<WT, MR, NR>;
};
template <int WT>
static void half_chunked(const float* x, int64_t M, int64_t K, const void* w, const float* scale,
                         float* y, int64_t ldy, int64_t n0, int64_t n1, PfCursor* pf) {
  static constexpr auto steps =
      shape_table<StepsFns<WT>, ES_HALF_NR>(std::make_integer_sequence<int, ES_HALF_MR>());
  static constexpr auto finish =
      shape_table<FinishFns<WT>, ES_HALF_NR>(std::make_integer_sequence<int, ES_HALF_MR>());
  constexpr int64_t NB = ES_HALF_CHUNK_NB, NR = ES_HALF_NR, MR = ES_HALF_MR;
  constexpr int64_t SLOT = 2 * MR * NR;  // a tile's accumulators
  const int64_t groups = (M + MR - 1) / MR;  // <= 4 (M <= 16)
  __m256 keep[4 * (NB / NR) * SLOT];
  const int64_t KF = K - K % 16;
  for (int64_t nb = n0; nb < n1; nb += NB) {
    const int64_t nbe = nb + NB < n1 ? nb + NB : n1;
    for (int64_t i = 0; i < groups * (NB / NR) * SLOT; ++i) keep[i] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < KF; k0 += ES_HALF_KC) {
      const int64_t k1 = KF - k0 > ES_HALF_KC ? k0 + ES_HALF_KC : KF;
      int64_t r0 = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r1 = M * (g + 1) / groups, mr = r1 - r0;
        for (int64_t n = nb, t = 0; n < nbe; n += NR, ++t) {
          const int64_t nr = nbe - n < NR ? nbe - n : NR;
          steps[mr - 1][nr - 1](x + r0 * K, K, w, n, k0, k1,
                                keep + (g * (NB / NR) + t) * SLOT, pf);
        }
        r0 = r1;
      }
    }
    int64_t r0 = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r1 = M * (g + 1) / groups, mr = r1 - r0;
      for (int64_t n = nb, t = 0; n < nbe; n += NR, ++t) {
        const int64_t nr = nbe - n < NR ? nbe - n : NR;
        finish[mr - 1][nr - 1](x + r0 * K, K, w, scale, y + r0 * ldy, ldy, n,
                               keep + (g * (NB / NR) + t) * SLOT);
      }
      r0 = r1;
    }
  }
}
typedef void (*HalfFn)(const float*, int64_t, const void*, const float*, float*, int64_t, int64_t,
                       PfCursor*);
template <int WT> struct HalfFns {
  using Fn = HalfFn;
  template <int MR, int NR> static constexpr Fn of = tile_half<WT, MR, NR>;
};
#endif

// The tiling (none of it changes a result: each output is its own accumulator):
// (the measurements behind each choice: docs/performance.md, "Kernels: measurements once
// quoted in their code")
// - one row of x (ES_ROWS_NR1): tiles of ES_NR1 weight rows, so that many rows stream from
//   memory at once, prefetching ES_AHEAD1 rows ahead (into ES_PF_LOC1);
// - more rows: the rows of x in groups of at most ES_MR (balanced: 17 rows = 6 + 6 + 5), the
//   weights in blocks of ES_NB rows; each block meets every group in tiles of ES_NR weight
//   rows while it is in L1 / L2, so each weight is read from memory once per call, and the
//   first group's tiles prefetch the next block into L2 (AVX2's half tiles: every pass
//   advances one prefetch cursor, see tile_half);
// - past ES_MB rows of x, the rows in chunks of ES_MB, each meeting 64 weight rows before the
//   next 64, so that a chunk of x and those weights both stay in L2 (prefill), whatever range
//   of rows the caller hands one call.
// mc rows of x in balanced groups of at most cap rows (17 = 6 + 6 + 5) against the weight rows
// [n0, n1) of w in tiles of at most nrmax of them; the tiles' last argument is `first` for the
// first group and `rest` for the others (`tile`: the first group's tiles prefetch `ahead` rows
// further on, the others none; `tile_half`: the call's cursor for every group)
template <class Fn, size_t R, size_t C, class Last>
static inline void groups_meet_block(const std::array<std::array<Fn, C>, R>& table,
                                     const float* x, int64_t mc, int64_t K, const void* w,
                                     const float* scale, float* y, int64_t ldy, int64_t n0,
                                     int64_t n1, int64_t cap, int64_t nrmax, Last first,
                                     Last rest) {
  const int64_t groups = (mc + cap - 1) / cap;
  int64_t r0 = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r1 = mc * (g + 1) / groups, mr = r1 - r0;
    for (int64_t n = n0; n < n1; n += nrmax) {
      const int64_t nr = n1 - n < nrmax ? n1 - n : nrmax;
      table[mr - 1][nr - 1](x + r0 * K, K, w, scale, y + r0 * ldy, ldy, n, g == 0 ? first : rest);
    }
    r0 = r1;
  }
}

// bf16 / int8 weights against more than ES_CONV_ONCE rows of x: each block of weight rows is
// converted to float32 once into a buffer of the thread (exact: every bf16 and int8 value is a
// float32) while the next block is prefetched, then every group of rows meets the block through the
// float32 tiles. Each output gets the same multiply-adds in the same order as when a tile
// converts the weights it loads (the one-row path), so the same bits; the conversion is paid
// once per block, not once per group of rows, and the groups are those of float32 weights.
template <int WT>
static void linear_conv(const float* x, int64_t M, int64_t K, const void* w, const float* scale,
                        float* y, int64_t ldy, int64_t n0, int64_t n1) {
  static constexpr auto table =
      shape_table<TileFns<W_F32>, ES_NR>(std::make_integer_sequence<int, ES_MR>());
  static_assert(ES_CONV_ONCE >= 16, "linear_conv runs past 16 rows: the large tiles");
  const int64_t cap = ES_MR_LARGE, NB = ES_NB_LARGE;
  constexpr int64_t wb = wbytes<WT>;
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < NB * K) buffer.resize(NB * K);
  float* buf = buffer.data();
  constexpr int64_t SB = 64;
  for (int64_t sb = n0; sb < n1; sb += SB) {
    const int64_t sbe = sb + SB < n1 ? sb + SB : n1;
    for (int64_t nb = sb; nb < sbe; nb += NB) {
      const int64_t nbe = nb + NB < sbe ? nb + NB : sbe;
      // the next block into L2 while this one converts
      const char* next = static_cast<const char*>(w) + nbe * K * wb;
      const int64_t ahead = (n1 - nbe < NB ? n1 - nbe : NB) * K * wb;
      for (int64_t b = 0; b < ahead; b += 64) __builtin_prefetch(next + b, 0, ES_PF_LOC);
      for (int64_t r = nb; r < nbe; ++r) {
        float* row = buf + (r - nb) * K;
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) vstore(row + k, loadw<WT>(w, r * K + k));
        if (k < K) {
          float t[16];
          vstore(t, loadw_tail<WT>(w, r * K + k, K - k));
          for (int64_t i = 0; i < K - k; ++i) row[k + i] = t[i];
        }
      }
      for (int64_t mb = 0; mb < M; mb += ES_MB)
        groups_meet_block(table, x + mb * K, M - mb < ES_MB ? M - mb : ES_MB, K, buf,
                          scale ? scale + nb : nullptr, y + mb * ldy + nb, ldy, 0, nbe - nb,
                          cap, ES_NR, int64_t{0}, int64_t{0});
    }
  }
}


// ---- prefill: the same sums with the lanes along the outputs ----
//
// The tile above keeps, for each output, 16 lane sums (lane l: the products of inputs k = l,
// l + 16, l + 32, ... added in k order by fused multiply-adds) and adds them by vhsum's tree.
// At prefill widths the same 16 sums are computed with the lanes along 16 outputs instead:
// "class" l of an output is its lane-l sum, accumulated over the same k in the same order by
// the same fused multiply-adds (x[k] broadcast against 16 outputs' weights), the classes one
// after another, then combined by vhsum's tree elementwise ((c0 + c8) + (c4 + c12)) + ...; the
// same bits as the tile's, with no horizontal sum and a weight panel packed once per call
// (float32, classes of K16 / 16 rows of 16 * ES_BC_NV outputs: its K's tail padded with zeros,
// which x's padding meets as the tile's zero-padded tail does).
template <int MR, int NV>
static void bc_block(const float* x, int64_t ldx, const float* wp, int64_t kc, float* y,
                     int64_t ldy, int64_t nvalid, const float* scale) {
  // the classes in the order of vhsum's tree (0, 8 | 4, 12 || 2, 10 | 6, 14 ||| 1, 9 ...), each
  // combined as soon as its partner is done: level q holds a sum of 2^q classes waiting for the
  // next (the adds of the tree, no more than 4 x MR x NV vectors kept)
  static constexpr int kOrder[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  V wait[4][MR][NV];
  for (int t = 0; t < 16; ++t) {
    const int l = kOrder[t];
    V acc[MR][NV];
    ES_UNROLL for (int i = 0; i < MR; ++i)
      ES_UNROLL for (int v = 0; v < NV; ++v) acc[i][v] = vzero();
    const float* w = wp + l * kc * 16 * NV;
    const float* xl = x + l;
    for (int64_t j = 0; j < kc; ++j) {
      V wv[NV];
      ES_UNROLL for (int v = 0; v < NV; ++v) wv[v] = vload(w + (j * NV + v) * 16);
      ES_UNROLL for (int i = 0; i < MR; ++i) {
        const V xb = vset1(xl[i * ldx + 16 * j]);
        ES_UNROLL for (int v = 0; v < NV; ++v) acc[i][v] = vfma(xb, wv[v], acc[i][v]);
      }
    }
    int q = 0;
    for (; q < 4 && ((t >> q) & 1); ++q)  // this sum's partner waits at level q: add them
      ES_UNROLL for (int i = 0; i < MR; ++i)
        ES_UNROLL for (int v = 0; v < NV; ++v) acc[i][v] = vadd(wait[q][i][v], acc[i][v]);
    if (q < 4) {
      ES_UNROLL for (int i = 0; i < MR; ++i)
        ES_UNROLL for (int v = 0; v < NV; ++v) wait[q][i][v] = acc[i][v];
      continue;
    }
    ES_UNROLL for (int i = 0; i < MR; ++i)  // t = 15: every class added
      ES_UNROLL for (int v = 0; v < NV; ++v) {
        V s1 = acc[i][v];
        const int64_t n0 = 16 * v, r = nvalid - n0;
        if (r <= 0) continue;
        if (scale) s1 = vmul(s1, r >= 16 ? vload(scale + n0) : loadx_tail(scale + n0, r));
        if (r >= 16) {
          vstore(y + i * ldy + n0, s1);
        } else {
          float out[16];
          vstore(out, s1);
          for (int64_t c = 0; c < r; ++c) y[i * ldy + n0 + c] = out[c];
        }
      }
  }
}

typedef void (*BcFn)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                     const float*);
template <int... MR>
static constexpr auto bc_table(std::integer_sequence<int, MR...>) {
  return std::array<BcFn, sizeof...(MR)>{bc_block<MR + 1, ES_BC_NV>...};
}

// y[m, n] for the outputs [n0, n1) of every row m < M through bc_block: panels of 16 * ES_BC_NV
// outputs packed a group at a time (then every row of x meets them in blocks of ES_BC_MR rows);
// x padded to K16 columns when K is not a multiple of 16
template <int WT>
static void linear_bc(const float* x, int64_t M, int64_t K, const void* w, const float* scale,
                      float* y, int64_t ldy, int64_t n0, int64_t n1) {
  static constexpr auto table = bc_table(std::make_integer_sequence<int, ES_BC_MR>());
  constexpr int64_t NP = 16 * ES_BC_NV;
  const int64_t K16 = (K + 15) / 16 * 16, kc = K16 / 16;
  thread_local std::vector<float> panel, xpad;
  const int64_t PS = K16 * NP;  // floats in one packed panel
  const int64_t PG = ES_BC_GROUP / (PS * 4) > 1 ? ES_BC_GROUP / (PS * 4) : 1;
  if (static_cast<int64_t>(panel.size()) < PS * PG + 16) panel.resize(PS * PG + 16);
  const float* xs = x;
  int64_t ldx = K;
  if (K16 != K) {
    if (static_cast<int64_t>(xpad.size()) < M * K16) xpad.resize(M * K16);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K16; ++k) xpad[m * K16 + k] = k < K ? x[m * K + k] : 0.0f;
    xs = xpad.data();
    ldx = K16;
  }
  // panels packed a group at a time (as many as fit ES_BC_GROUP bytes), then every block of
  // rows of x meets each panel of the group while its rows are in L1 (no effect on any
  // result); the panels 64-byte aligned, so that no vector load splits across two lines
  float* wp = panel.data();
  wp += (16 - (reinterpret_cast<uintptr_t>(wp) / 4) % 16) % 16;
  for (int64_t gb = n0; gb < n1; gb += NP * PG) {
    const int64_t ge = gb + NP * PG < n1 ? gb + NP * PG : n1;
    for (int64_t nb = gb; nb < ge; nb += NP) {
      const int64_t nv = ge - nb < NP ? ge - nb : NP;
      float* pp = wp + (nb - gb) / NP * PS;
      // pack: pp[(l * kc + j) * NP + c] = w[nb + c, 16 j + l] (zeros past K and past n1), a
      // block of 16 inputs of the NP rows at a time, written as 16 runs of NP floats
      for (int64_t j = 0; j < kc; ++j) {
        const int64_t k = 16 * j;
        float t[NP][16];
        for (int64_t c = 0; c < NP; ++c) {
          if (c < nv)
            vstore(t[c], k + 16 <= K ? loadw<WT>(w, (nb + c) * K + k)
                                     : loadw_tail<WT>(w, (nb + c) * K + k, K - k));
          else
            vstore(t[c], vzero());
        }
        for (int l = 0; l < 16; ++l) {
          float* dst = pp + (l * kc + j) * NP;
          for (int64_t c = 0; c < NP; ++c) dst[c] = t[c][l];
        }
      }
    }
    for (int64_t m = 0; m < M; m += ES_BC_MR) {
      const int64_t mr = M - m < ES_BC_MR ? M - m : ES_BC_MR;
      for (int64_t nb = gb; nb < ge; nb += NP)
        table[mr - 1](xs + m * ldx, ldx, wp + (nb - gb) / NP * PS, kc, y + m * ldy + nb, ldy,
                      ge - nb < NP ? ge - nb : NP, scale ? scale + nb : nullptr);
    }
  }
}

template <int WT>
static void linear_t(const float* x, int64_t M, int64_t K, const void* w, const float* scale,
                     float* y, int64_t ldy, int64_t n0, int64_t n1) {
  static constexpr auto table = shape_table<TileFns<WT>, ES_NR>(std::make_integer_sequence<
      int, WT == W_F32 ? ES_MR : (ES_MR_CONV > ES_MR_LARGE ? ES_MR_CONV : ES_MR_LARGE)>());
  // bf16 / int8 weights need registers for their conversion: 4 rows, as below
  constexpr int NR1 = (WT == W_F32 || ES_NR1 <= 4) ? ES_NR1 : 4;
  if (M == 1 && WT == W_F32) {
    // one row, float32: one weight row after another, so memory is read as one sequential
    // stream (the rows' chains overlap out of order), ES_AHEAD_F32 rows prefetched ahead; the
    // same bits, as every tile's
    for (int64_t n = n0; n < n1; ++n)
      tile<WT, 1, 1>(x, K, w, scale, y, ldy, n, n + ES_AHEAD_F32 < n1 ? ES_AHEAD_F32 : 0);
    return;
  }
  if (M <= ES_ROWS_NR1) {
    int64_t n = n0;
    for (; n + NR1 <= n1; n += NR1)
      for (int64_t m = 0; m < M; ++m)
        tile<WT, 1, NR1>(x + m * K, K, w, scale, y + m * ldy, ldy, n,
                         m == 0 ? ES_AHEAD1 : 0);
    n0 = n;
  }
  if (M >= ES_BC_ROWS) {  // prefill: lanes along the outputs, the same sums
    linear_bc<WT>(x, M, K, w, scale, y, ldy, n0, n1);
    return;
  }
  if (WT != W_F32 && M > ES_CONV_ONCE) {  // bf16 / int8 weights, long prefill
    linear_conv<WT>(x, M, K, w, scale, y, ldy, n0, n1);
    return;
  }
  // rows of x per tile, and columns of W: bf16 / int8 weights at verify widths in tiles of
  // ES_MR_CONV rows x ES_NR_CONV columns, so that each converted weight vector meets as many
  // rows as the registers allow; past 16 rows (prefill, bound by the arithmetic) tiles whose
  // accumulators all fit in registers
  const bool conv = WT != W_F32 && M <= 16;
  const int64_t cap = conv ? ES_MR_CONV : M <= 16 ? ES_MR : ES_MR_LARGE;
  const int64_t nrmax = conv ? ES_NR_CONV : ES_NR;
  const int64_t NB = M <= 16 ? ES_NB : ES_NB_LARGE;
  constexpr int64_t SB = 64;  // weight rows that every chunk of x meets before the next ones
  // every chunk of x's rows meets the weight rows SB at a time, in blocks of NB, through the
  // tiles of `tiles` (at most `mr` rows x `nr` columns)
  // tiles' last argument: `first` for the first group of rows, `rest` for the others
  auto walk = [&](const auto& tiles, int64_t mr, int64_t nr, auto first, auto rest) {
    for (int64_t sb = n0; sb < n1; sb += SB) {
      const int64_t sbe = sb + SB < n1 ? sb + SB : n1;
      for (int64_t mb = 0; mb < M; mb += ES_MB) {
        const int64_t mc = M - mb < ES_MB ? M - mb : ES_MB;  // rows in this chunk
        for (int64_t nb = sb; nb < sbe; nb += NB)
          groups_meet_block(tiles, x + mb * K, mc, K, w, scale, y + mb * ldy, ldy, nb,
                            nb + NB < sbe ? nb + NB : sbe, mr, nr, mb == 0 ? first : rest,
                            rest);
      }
    }
  };
#ifdef ES_HALF_TILES
  if (M <= 16) {  // verify widths: half tiles (above), the weights prefetched by one cursor
    static constexpr auto half =
        shape_table<HalfFns<WT>, ES_HALF_NR>(std::make_integer_sequence<int, ES_HALF_MR>());
    constexpr int64_t wb = wbytes<WT>;
    const int64_t groups = (M + ES_HALF_MR - 1) / ES_HALF_MR;
    // k-steps a line lasts over the passes (2 halves x the groups)
    const int64_t period = 2 * groups * 64 / (ES_HALF_NR * 16 * wb);
    const char* base = static_cast<const char*>(w);
    // a pass (a group's rows of x and a tile's weight rows over all of K) in L1, so that the
    // other half finds them there (all of L1 for a single group, 7/8 where other groups' rows
    // pass through it too); else K in chunks (half_chunked)
    const int64_t mr = (M + groups - 1) / groups;  // the largest group
    const int64_t pass = (mr * 4 + ES_HALF_NR * wb) * K;
    const bool whole = pass <= (groups == 1 ? l1d_bytes() : l1d_bytes() * 7 / 8);
    const int64_t ahead = whole ? NB : ES_HALF_CHUNK_NB;
    PfCursor pf{base + (n0 + ahead < n1 ? n0 + ahead : n1) * K * wb, base + n1 * K * wb,
                static_cast<int>(period > 1 ? period : 1), 1};
    if (whole)
      walk(half, ES_HALF_MR, ES_HALF_NR, &pf, &pf);
    else
      half_chunked<WT>(x, M, K, w, scale, y, ldy, n0, n1, &pf);
    return;
  }
#endif
  walk(table, cap, nrmax, M > 1 ? NB : int64_t{0}, int64_t{0});
}

static void linear(const float* x, int64_t M, int64_t K, const void* w, int wtype,
                   const float* scale, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if (wtype == W_F32) linear_t<W_F32>(x, M, K, w, scale, y, ldy, n0, n1);
#ifdef ES_AMX
  else if (wtype == W_BF16)  // the amx unit: every width on AMX tiles (impl_amx.h)
    linear_amx(x, M, K, static_cast<const uint16_t*>(w), scale, y, ldy, n0, n1);
#elif defined(ES_BF16DOT)
  else if (wtype == W_BF16)  // the avx512bf16 unit: every width on VDPBF16PS (impl_bf16dot.h)
    linear_bf16dot(x, M, K, static_cast<const uint16_t*>(w), scale, y, ldy, n0, n1);
#else
  else if (wtype == W_BF16) linear_t<W_BF16>(x, M, K, w, scale, y, ldy, n0, n1);
#endif
  else linear_t<W_I8>(x, M, K, w, scale, y, ldy, n0, n1);
}

// ---- a dot product of two float vectors of length n, the same order as the product above ----
static inline float dot(const float* a, const float* b, int64_t n) {
  V acc = vzero();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) acc = vfma(vload(a + k), vload(b + k), acc);
  if (k < n) acc = vfma(loadx_tail(a + k, n - k), loadx_tail(b + k, n - k), acc);
  return vhsum(acc);
}

// ---- exp: Cody-Waite reduction and the Cephes polynomial, the same ops in every unit ----
static inline V vexp(V x) {
  x = vmax(vmin(x, vset1(88.0f)), vset1(-87.0f));
  V n = vround(vmul(x, vset1(1.44269504088896341f)));
  V r = vfma(n, vset1(-0.693359375f), x);
  r = vfma(n, vset1(2.12194440e-4f), r);
  V p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vadd(vfma(p, vmul(r, r), r), vset1(1.0f));
  return vmul(p, vpow2i(n));
}

// ---- RMSNorm, one row at a time ----
static void rms_norm(const float* x, const float* w, float eps, int64_t H, float* y,
                     int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * H;
    float* yr = y + m * H;
    const float ms = dot(xr, xr, H) / static_cast<float>(H);
    const float inv = 1.0f / __builtin_sqrtf(ms + eps);
    for (int64_t i = 0; i < H; ++i) yr[i] = (xr[i] * inv) * w[i];
  }
}

// ---- act(gate) * up, elementwise, for g = [gate | up] rows; act maps 16 lanes to 16 ----
template <class Act>
static void gated(const float* g, int64_t I, float* y, int64_t m0, int64_t m1, Act act) {
  for (int64_t m = m0; m < m1; ++m) {
    const float* gate = g + m * 2 * I;
    const float* up = gate + I;
    float* yr = y + m * I;
    for (int64_t i = 0; i < I; i += 16) {
      const int64_t r = I - i < 16 ? I - i : 16;
      V gv = r == 16 ? vload(gate + i) : loadx_tail(gate + i, r);
      V uv = r == 16 ? vload(up + i) : loadx_tail(up + i, r);
      float out[16];
      vstore(out, vmul(act(gv), uv));
      for (int64_t j = 0; j < r; ++j) yr[i + j] = out[j];
    }
  }
}

// ---- silu(gate) * up ----
static void silu_mul(const float* g, int64_t I, float* y, int64_t m0, int64_t m1) {
  const V one = vset1(1.0f), zero = vzero();
  gated(g, I, y, m0, m1, [&](V x) { return vdiv(x, vadd(one, vexp(vsub(zero, x)))); });
}

// ---- RoPE (rotate-half), in place: x*cos + rotate_half(x)*sin, each product rounded ----
static void rope(float* x, int64_t ldx, int64_t heads, int64_t d, const float* cos,
                 const float* sin, int64_t m0, int64_t m1) {
  const int64_t half = d / 2;
  for (int64_t m = m0; m < m1; ++m) {
    const float* c = cos + m * d;
    const float* s = sin + m * d;
    for (int64_t h = 0; h < heads; ++h) {
      float* p = x + m * ldx + h * d;
      for (int64_t i = 0; i < half; ++i) {
        const float a = p[i], b = p[i + half];
        const float lo = a * c[i] - b * s[i];
        const float hi = b * c[i + half] + a * s[i + half];
        p[i] = lo;
        p[i + half] = hi;
      }
    }
  }
}

// (attention: impl_attn.h)

// (the unit's `const Isa isa` table is at the end of impl_act.h, included after this file)
