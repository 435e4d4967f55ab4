// The bf16-weight product on AVX512-BF16's VDPBF16PS (the avx512bf16 unit: isa_avx512bf16.cpp),
// used at every width; and the rounding of x to bf16 that the amx unit shares.
//
// Other bits than the FMA units' for bf16 weights, said wherever the unit is named: x is rounded
// to bf16 (round to nearest even, vcvtne2ps2bf16), and an output's 16 lane sums run along K as
// the FMA units' do, but a lane takes two inputs per instruction: lane j adds, for each block b
// of 32 inputs in block order, the product of inputs 32 b + 2 j + 1 and then that of 32 b + 2 j
// (each product of two bf16 values exact in float32, each add rounded to nearest even; inputs
// and results below the normal range taken as zero: Intel's definition of VDPBF16PS, which AMD's
// Zen 4 computes bit for bit, tests/kernels/test_bf16_units.py), then vhsum's tree, times scale.
// An output's chain depends on its own weights and its own row of x only, the same instructions
// at every tile shape, so the invariance rule of isa.h holds within the unit: every width, row,
// tile position and thread count gives the same bits.
//
// Tiling (none of it changes a result): x is rounded once per call into a buffer of the thread
// (rows of KB * 32 bf16, zeros past K); one row of x meets tiles of 4 weight rows that prefetch
// 16 rows ahead; more rows go in balanced groups of at most 8 against tiles of 3 weight rows
// (24 accumulators, 3 weight vectors and one of x in the 32 registers), in blocks of
// kDotNB weight rows that every group of a chunk of kDotMB rows meets while they are in L1, the
// first group prefetching the next block. Where a chunk's rows of x fill kDotXBytes (8 rows
// from K = 2048, 5 past K = 3264, 29 at K = 576: prefill too), more than 4 rows go in groups of
// at most 4 against tiles of 6 weight rows instead (dot_groups4): with weights streaming from
// memory, 8 lines of x a k-step cost the 8-row tiles 1.3-2.0x one row's time at K = 2048-8192,
// where 4 lines cost 1.0-1.1x (scripts/bf16dot_stream.cpp; docs/performance.md, "The Zen 4
// machine, fifth pass").
#pragma once
#include <immintrin.h>

#include <array>
#include <utility>
#include <vector>

// 32 inputs of a row of x from k (zeros past K) rounded to bf16: element i = input k + i, so
// dword j holds the pair k + 2 j, k + 2 j + 1 (round to nearest even)
static inline __m512 bf16_pairs(const float* xr, int64_t k, int64_t K) {
  const int64_t r = K - k;
  __m512 lo, hi;
  if (r >= 32) {
    lo = _mm512_loadu_ps(xr + k);
    hi = _mm512_loadu_ps(xr + k + 16);
  } else {
    const __mmask16 mlo = r >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << r) - 1);
    const __mmask16 mhi = r <= 16 ? 0 : static_cast<__mmask16>((1u << (r - 16)) - 1);
    lo = _mm512_maskz_loadu_ps(mlo, xr + k);
    hi = _mm512_maskz_loadu_ps(mhi, xr + k + 16);
  }
  return reinterpret_cast<__m512>(_mm512_cvtne2ps_pbh(hi, lo));
}

#ifdef ES_BF16DOT
#define ES_DOT_UNROLL _Pragma("GCC unroll 16")
constexpr int64_t kDotNB = 12;  // weight rows per block past 8 rows of x (a multiple of 3)
constexpr int64_t kDotMB = 64;  // rows of x per chunk past 8 rows
constexpr int64_t kDotAhead1 = 16;  // weight rows ahead that the one-row tiles prefetch
constexpr int kDotC1 = 4;  // weight rows per one-row tile
constexpr int64_t kDotXBytes = 32 << 10;  // a chunk's bytes of x from which dot_groups4 runs
constexpr int64_t kDotBlockBytes = 96 << 10;  // ... and its blocks' bytes of weight rows

// a prefetch cursor: `per_k` lines a k-step from cur, up to cap (the next block's end)
struct DotCursor {
  const char* cur;
  const char* cap;
  int per_k;
};

// y[r * ldy + n + c] = scale[n + c] * (vhsum of lane sums) for the R x C tile at weight row n:
// xb rows of Kp bf16 (zeros past K), w rows of K bf16; prefetching, block by block, the weight
// rows `ahead` further on (0: none; a prefetch never faults, past the end included)
template <int R, int C>
static void dot_tile(const uint16_t* xb, int64_t Kp, const uint16_t* w, int64_t K,
                     const float* scale, float* y, int64_t ldy, int64_t n, int64_t ahead,
                     DotCursor* pf) {
  const int64_t KF = K / 32;
  const uint16_t* wr = w + n * K;
  V acc[R * C];
  ES_DOT_UNROLL for (int i = 0; i < R * C; ++i) acc[i] = vzero();
  auto step = [&](const __m512i* wv, int64_t kb) {
    ES_DOT_UNROLL for (int r = 0; r < R; ++r) {
      const __m512bh xv = reinterpret_cast<__m512bh>(
          _mm512_load_si512(reinterpret_cast<const __m512i*>(xb + r * Kp + 32 * kb)));
      ES_DOT_UNROLL for (int c = 0; c < C; ++c)
        acc[r * C + c].v = _mm512_dpbf16_ps(acc[r * C + c].v, xv,
                                            reinterpret_cast<__m512bh>(wv[c]));
    }
  };
  const char* cur = pf ? pf->cur : nullptr;
  for (int64_t kb = 0; kb < KF; ++kb) {
    __m512i wv[C];
    ES_DOT_UNROLL for (int c = 0; c < C; ++c)
      wv[c] = _mm512_loadu_si512(reinterpret_cast<const __m512i*>(wr + c * K + 32 * kb));
    if (ahead)
      ES_DOT_UNROLL for (int c = 0; c < C; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(wr + (c + ahead) * K + 32 * kb),
                     _MM_HINT_T1);
    if (pf)
      for (int p = 0; p < pf->per_k && cur < pf->cap; ++p, cur += 64)
        _mm_prefetch(cur, _MM_HINT_T1);
    step(wv, kb);
  }
  if (pf) pf->cur = cur;
  if (KF * 32 < K) {  // the tail: weights past K read as zeros (x is zero there too)
    const __mmask32 m = static_cast<__mmask32>((1ull << (K - 32 * KF)) - 1);
    __m512i wv[C];
    ES_DOT_UNROLL for (int c = 0; c < C; ++c)
      wv[c] = _mm512_maskz_loadu_epi16(m, wr + c * K + 32 * KF);
    step(wv, KF);
  }
  // the lane sums by vhsum's tree, 16 outputs at a time (vhsum16v: bit for bit vhsum's)
  for (int i0 = 0; i0 < R * C; i0 += 16) {
    V t[16];
    alignas(64) float s[16];
    for (int i = 0; i < 16; ++i) t[i] = i0 + i < R * C ? acc[i0 + i] : vzero();
    vstore(s, vhsum16v(t));
    for (int i = i0; i < R * C && i < i0 + 16; ++i) {
      const int r = i / C, c = i % C;
      y[r * ldy + n + c] = scale ? s[i - i0] * scale[n + c] : s[i - i0];
    }
  }
}

typedef void (*DotFn)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, float*,
                      int64_t, int64_t, int64_t, DotCursor*);
// shape_table's (isa.h) tiles of each shape: dot_tile<r, c>, r rows of x and c weight rows
struct DotFns {
  using Fn = DotFn;
  template <int R, int C> static constexpr Fn of = dot_tile<R, C>;
};

// A chunk of mc > 4 rows of x filling kDotXBytes: balanced groups of at most 4 rows (x's lines a
// k-step halved) against tiles of 6 weight rows, in blocks of about kDotBlockBytes that every
// group of the chunk meets (the later groups from L2), each tile prefetching its share of the
// next block (6 / groups lines a k-step, rounded up: the cursor stops at the block's end)
static void dot_groups4(const uint16_t* xc, int64_t Kp, int64_t mc, const uint16_t* w,
                        int64_t K, const float* scale, float* yc, int64_t ldy, int64_t n0,
                        int64_t n1) {
  static constexpr auto table = shape_table<DotFns, 6>(std::make_integer_sequence<int, 4>());
  const int64_t groups = (mc + 3) / 4, row_bytes = K * 2;
  int64_t nbw = kDotBlockBytes / row_bytes / 6 * 6;
  if (nbw < 6) nbw = 6;
  const char* base = reinterpret_cast<const char*>(w);
  for (int64_t nb = n0; nb < n1; nb += nbw) {
    const int64_t nbe = nb + nbw < n1 ? nb + nbw : n1;
    const int64_t next_end = nbe + nbw < n1 ? nbe + nbw : n1;
    DotCursor pf{base + nbe * row_bytes, base + next_end * row_bytes,
                 static_cast<int>((6 + groups - 1) / groups)};
    int64_t r0 = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r1 = mc * (g + 1) / groups, mr = r1 - r0;
      for (int64_t n = nb; n < nbe; n += 6) {
        const int64_t nr = nbe - n < 6 ? nbe - n : 6;
        table[mr - 1][nr - 1](xc + r0 * Kp, Kp, w, K, scale, yc + r0 * ldy, ldy, n, 0, &pf);
      }
      r0 = r1;
    }
  }
}

// y[m, n] = scale[n] * sum_k bf16(x[m, k]) w[n, k] for n in [n0, n1), every m < M (see above)
static void linear_bf16dot(const float* x, int64_t M, int64_t K, const uint16_t* w,
                           const float* scale, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if (n0 >= n1 || M <= 0) return;
  static constexpr auto one = shape_row<DotFns, 1>(std::make_integer_sequence<int, kDotC1>());
  static constexpr auto table = shape_table<DotFns, 3>(std::make_integer_sequence<int, 8>());
  const int64_t KB = (K + 31) / 32, Kp = KB * 32;
  thread_local std::vector<uint16_t> xbuf;
  if (xbuf.size() < static_cast<size_t>(M * Kp + 32)) xbuf.resize(M * Kp + 32);
  uint16_t* xb = xbuf.data() + (32 - (reinterpret_cast<uintptr_t>(xbuf.data()) / 2) % 32) % 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t kb = 0; kb < KB; ++kb)
      _mm512_store_ps(reinterpret_cast<float*>(xb + m * Kp + 32 * kb),
                      bf16_pairs(x + m * K, 32 * kb, K));
  if (M == 1) {
    for (int64_t n = n0; n < n1; n += kDotC1) {
      const int64_t nr = n1 - n < kDotC1 ? n1 - n : kDotC1;
      one[nr - 1](xb, Kp, w, K, scale, y, ldy, n, n + kDotAhead1 < n1 ? kDotAhead1 : 0,
                  nullptr);
    }
    return;
  }
  // balanced groups of at most 8 rows in each chunk of kDotMB rows (17 = 6 + 6 + 5)
  for (int64_t mb = 0; mb < M; mb += kDotMB) {
    const int64_t mc = M - mb < kDotMB ? M - mb : kDotMB, groups = (mc + 7) / 8;
    const uint16_t* xc = xb + mb * Kp;
    float* yc = y + mb * ldy;
    if (mc > 4 && mc * Kp * 2 >= kDotXBytes) {
      dot_groups4(xc, Kp, mc, w, K, scale, yc, ldy, n0, n1);
      continue;
    }
    for (int64_t nb = n0; nb < n1; nb += kDotNB) {
      const int64_t nbe = nb + kDotNB < n1 ? nb + kDotNB : n1;
      int64_t r0 = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r1 = mc * (g + 1) / groups, mr = r1 - r0;
        // the first group reads the block from memory: it prefetches the next block (one group:
        // two tiles ahead)
        const int64_t ahead = g > 0 ? 0 : groups == 1 ? 6 : kDotNB;
        for (int64_t n = nb; n < nbe; n += 3) {
          const int64_t nr = nbe - n < 3 ? nbe - n : 3;
          table[mr - 1][nr - 1](xc + r0 * Kp, Kp, w, K, scale, yc + r0 * ldy, ldy, n,
                                n + ahead < n1 ? ahead : 0, nullptr);
        }
        r0 = r1;
      }
    }
  }
}
#endif
