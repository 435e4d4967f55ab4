// Attention for a group of queries that read the same keys and values (the query heads of one
// key/value head, at one or more positions), written once over the 16-lane type V of the
// including unit, included after impl.h inside one namespace per ISA.
//
// Each query's output is computed exactly as it would be alone, so it never depends on which
// other queries share the call, on how many keys follow its last visible one, or on the thread:
// - score_j = dot(q, k_j) * scale for its visible keys j (impl.h's dot: 16 lanes along d in
//   index order, one horizontal-sum tree; here 16 keys' sums at once by vhsum16v, which adds
//   the same pairs in the same tree);
// - mx = the largest visible score (a maximum: the order does not matter);
// - e_j = exp(score_j - mx) in chunks of 16 fixed by key index, elementwise;
// - sum = e_0 + e_1 + ... over the visible keys, one add after another in key order;
// - o[c] = (sum over visible j, in key order, of e_j v_j[c], fused multiply-adds in one lane
//   per c) / sum.
// Only the loops around those reductions are tiled: the keys in blocks of 16 against every
// query of the group while they are in L1, the values against ES_ATT_G queries at a time with
// ES_ATT_CW chunks of 16 of d in registers, so no output waits on one chain of multiply-adds.
#pragma once

// While a block of 16 keys is scored, the keys ES_ATT_PF blocks ahead are prefetched into L2;
// the values pass prefetches the values ES_ATT_VPF keys ahead into L1 (and the first ones
// before it starts), so memory streams through both passes, for a decode step (bound by
// reading the cache) and a verify alike (docs/performance.md, "The AMX machine, sixth pass",
// "eighth pass" and "The Zen 4 machine": the values prefetched with the keys instead kept
// memory idle through the values pass). No effect on any result.
#ifndef ES_ATT_PF
#define ES_ATT_PF 4
#endif
#ifndef ES_ATT_VPF
#define ES_ATT_VPF 32
#endif
// prefetch a key's or value's row of d elements, a line at a time (LOC: __builtin_prefetch's
// locality)
template <int LOC, class KT>
static inline void prefetch_row(const KT* p, int64_t d) {
  for (int64_t c = 0; c < d; c += 64 / static_cast<int64_t>(sizeof(KT)))
    __builtin_prefetch(p + c, 0, LOC);
}

// The cache's elements (KT): float32, or bf16 (uint16_t) for a bf16 cache, each widened
// exactly to float32 as it is loaded, so every function below computes on a bf16 cache what
// it computes on a float32 cache holding the same (rounded) values, bit for bit.
static inline V kv_load(const float* p) { return vload(p); }
static inline V kv_load(const uint16_t* p) { return vload_bf16(p); }
// n < 16 elements, zeros after
static inline V kv_tail(const float* p, int64_t n) { return loadx_tail(p, n); }
static inline V kv_tail(const uint16_t* p, int64_t n) {
  uint16_t b[16] = {0};
  for (int64_t i = 0; i < n; ++i) b[i] = p[i];
  return vload_bf16(b);
}

#ifdef ES_HALF_TILES
// 8 of the cache's elements as floats (the half tiles' kv_load)
static inline __m256 kv_half(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 kv_half(const uint16_t* p) { return bf16x8(p); }

// AVX2 (V: two 8-lane registers): the 16 accumulators of V below would take 32 of the 16
// registers, and they lived on the stack, a load and a store around every multiply-add. Here the
// same accumulators are computed an 8-lane half at a time (as impl.h's tile_half): half h of
// Q queries x P keys' accumulators in registers over all of d, stored, then the two halves meet
// in V for the same vhsum16v tree. Each lane gets the same multiply-adds in the same order
// (the same zero-padded tail): the same bits as the 16-lane functions after the #else.
//
// part[(h * Q + u) * 16 + t0 + t] = half h of the accumulator of query u and key j + t
template <int Q, int P, class KT>
static inline void dots_half(const float* const* q, const KT* k, int64_t ldk, int64_t j,
                             int64_t d, __m256* part, int t0) {
  ES_UNROLL for (int h = 0; h < 2; ++h) {
    __m256 acc[Q][P];
    ES_UNROLL for (int u = 0; u < Q; ++u)
      ES_UNROLL for (int t = 0; t < P; ++t) acc[u][t] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= d; c += 16) {
      if (Q == 1) {  // each key's half meets one query: read as the multiply-add's operand
        const __m256 qv = _mm256_loadu_ps(q[0] + c + 8 * h);
        ES_UNROLL for (int t = 0; t < P; ++t)
          acc[0][t] = _mm256_fmadd_ps(qv, kv_half(k + (j + t) * ldk + c + 8 * h), acc[0][t]);
        continue;
      }
      __m256 kv[P];
      ES_UNROLL for (int t = 0; t < P; ++t) kv[t] = kv_half(k + (j + t) * ldk + c + 8 * h);
      ES_UNROLL for (int u = 0; u < Q; ++u) {
        __m256 qv = _mm256_loadu_ps(q[u] + c + 8 * h);
        __asm__("" : "+x"(qv));  // one load of the query half for its P keys
        ES_UNROLL for (int t = 0; t < P; ++t) acc[u][t] = _mm256_fmadd_ps(qv, kv[t], acc[u][t]);
      }
    }
    if (c < d) {
      __m256 kv[P];
      ES_UNROLL for (int t = 0; t < P; ++t) {
        const V x = kv_tail(k + (j + t) * ldk + c, d - c);
        kv[t] = h ? x.b : x.a;
      }
      ES_UNROLL for (int u = 0; u < Q; ++u) {
        const V x = loadx_tail(q[u] + c, d - c);
        const __m256 qv = h ? x.b : x.a;
        ES_UNROLL for (int t = 0; t < P; ++t) acc[u][t] = _mm256_fmadd_ps(qv, kv[t], acc[u][t]);
      }
    }
    ES_UNROLL for (int u = 0; u < Q; ++u)
      ES_UNROLL for (int t = 0; t < P; ++t) part[(h * Q + u) * 16 + t0 + t] = acc[u][t];
  }
}

// query u's 16 scores from part (keys t >= n: zero accumulators), times scale
template <int Q>
static inline V scores_from_halves(const __m256* part, int u, int64_t n, float scale) {
  V acc[16];
  for (int t = 0; t < 16; ++t)
    acc[t] = t < n ? V{part[u * 16 + t], part[(Q + u) * 16 + t]} : vzero();
  return vmul(vhsum16v(acc), vset1(scale));
}

// scores of the query q against keys [j0, j0 + n), n <= 16; lane t = dot(q, k_{j0+t}) * scale
template <class KT>
static inline V scores16(const float* q, const KT* k, int64_t ldk, int64_t j0, int64_t n,
                         int64_t d, float scale) {
  __m256 part[2 * 16];
  const float* qs[1] = {q};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) dots_half<1, 8>(qs, k, ldk, j0 + t, d, part, static_cast<int>(t));
  for (; t < n; ++t) dots_half<1, 1>(qs, k, ldk, j0 + t, d, part, static_cast<int>(t));
  return scores_from_halves<1>(part, 0, n, scale);
}

// scores16 for Q queries (2 or 4) against the same 16 keys: s[u] = query u's 16 scores
template <int Q, class KT>
static inline void scores16xq(const float* const* q, const KT* k, int64_t ldk, int64_t j0,
                              int64_t d, float scale, V* s) {
  static_assert(Q == 2 || Q == 4, "scores16xq: 2 or 4 queries");
  constexpr int P = 8 / Q;  // Q x P accumulators of a half, each query half loaded once
  __m256 part[2 * Q * 16];
  ES_UNROLL for (int t0 = 0; t0 < 16; t0 += P) dots_half<Q, P>(q, k, ldk, j0 + t0, d, part, t0);
  for (int u = 0; u < Q; ++u) s[u] = scores_from_halves<Q>(part, u, 16, scale);
}
#else
// scores of the query q against keys [j0, j0 + n), n <= 16: 16 dot-product accumulators, then
// one vhsum16v; lane t = dot(q, k_{j0+t}) * scale (t < n)
template <class KT>
static inline V scores16(const float* q, const KT* k, int64_t ldk, int64_t j0, int64_t n,
                         int64_t d, float scale) {
  V acc[16];
  ES_UNROLL for (int t = 0; t < 16; ++t) acc[t] = vzero();
  int64_t c = 0;
  if (n == 16) {  // unrolled: the 16 accumulators stay in registers
    for (; c + 16 <= d; c += 16) {
      const V qv = vload(q + c);
      ES_UNROLL for (int t = 0; t < 16; ++t)
        acc[t] = vfma(qv, kv_load(k + (j0 + t) * ldk + c), acc[t]);
    }
  } else {
    for (; c + 16 <= d; c += 16) {
      const V qv = vload(q + c);
      for (int64_t t = 0; t < n; ++t) acc[t] = vfma(qv, kv_load(k + (j0 + t) * ldk + c), acc[t]);
    }
  }
  if (c < d) {
    const V qv = loadx_tail(q + c, d - c);
    for (int64_t t = 0; t < n; ++t)
      acc[t] = vfma(qv, kv_tail(k + (j0 + t) * ldk + c, d - c), acc[t]);
  }
  return vmul(vhsum16v(acc), vset1(scale));
}

// scores16 for Q queries (2 or 4) against the same 16 keys (d a multiple of 16): each key's
// vector loaded once for the Q queries, 16 / Q keys x Q queries in 16 accumulators at a time;
// every score the same chain of multiply-adds and the same vhsum16v tree as scores16's, so the
// same bits. s[u]: query u's 16 scores times scale
template <int Q, class KT>
static inline void scores16xq(const float* const* q, const KT* k, int64_t ldk, int64_t j0,
                              int64_t d, float scale, V* s) {
  constexpr int P = 16 / Q;  // keys per pass
  static_assert(Q == 2 || Q == 4, "scores16xq: 2 or 4 queries");
  V o[Q];  // pass h: query u's P scores of keys P h .. P h + P - 1 in lanes [P u, P u + P)
  for (int h = 0; h < Q; ++h) {
    V acc[16];
    ES_UNROLL for (int t = 0; t < 16; ++t) acc[t] = vzero();
    for (int64_t c = 0; c < d; c += 16) {
      V qv[Q];
      ES_UNROLL for (int u = 0; u < Q; ++u) qv[u] = vload(q[u] + c);
      ES_UNROLL for (int t = 0; t < P; ++t) {
        const V kv = kv_load(k + (j0 + P * h + t) * ldk + c);
        ES_UNROLL for (int u = 0; u < Q; ++u) acc[u * P + t] = vfma(qv[u], kv, acc[u * P + t]);
      }
    }
    o[h] = vhsum16v(acc);
  }
  // query u's 16 scores in key order: the passes' blocks of P lanes regathered in registers
  if constexpr (Q == 4) vblocks4(o);
  else vhalves2(o);
  for (int u = 0; u < Q; ++u) s[u] = vmul(o[u], vset1(scale));
}
#endif

// acc_g += e_g[j] v_j over the visible keys j <= last_g, in key order, for G queries and the
// chunks [c0, c0 + 16 CW) of d (in registers), then stored (attend_finish divides)
template <int G, int CW, class KT>
static void values_tile(const float* const* e, const uint8_t* const* vis, const int64_t* last,
                        const KT* v, int64_t ldk, int64_t d, int64_t c0, float* const* o) {
  V acc[G][CW];
  ES_UNROLL for (int g = 0; g < G; ++g)
    ES_UNROLL for (int c = 0; c < CW; ++c) acc[g][c] = vzero();
  const int64_t width = d - c0 < 16 * CW ? d - c0 : 16 * CW;
  int64_t L = -1, common = INT64_MAX;  // keys up to `common`: every query sees them
  bool masked = false;
  for (int g = 0; g < G; ++g) {
    L = last[g] > L ? last[g] : L;
    common = last[g] < common ? last[g] : common;
    masked = masked || vis[g];
  }
  int64_t j = 0;
  if (!masked && width == 16 * CW)  // no query skips a key below `common`: no test per query
    for (; j <= common; ++j) {
      const KT* vj = v + j * ldk + c0;
      if (c0 == 0 && j + ES_ATT_VPF <= common)  // the values ES_ATT_VPF keys ahead, whole rows
        prefetch_row<3>(vj + ES_ATT_VPF * ldk, d);
      V vv[CW];
      ES_UNROLL for (int c = 0; c < CW; ++c) vv[c] = kv_load(vj + 16 * c);
      ES_UNROLL for (int g = 0; g < G; ++g) {
        const V p = vset1(e[g][j]);
        ES_UNROLL for (int c = 0; c < CW; ++c) acc[g][c] = vfma(p, vv[c], acc[g][c]);
      }
    }
  for (; j <= L; ++j) {
    const KT* vj = v + j * ldk + c0;
    V vv[CW];
    ES_UNROLL for (int c = 0; c < CW; ++c) {
      const int64_t r = width - 16 * c;
      vv[c] = r >= 16 ? kv_load(vj + 16 * c) : r > 0 ? kv_tail(vj + 16 * c, r) : vzero();
    }
    ES_UNROLL for (int g = 0; g < G; ++g) {
      if (j > last[g] || (vis[g] && !vis[g][j])) continue;
      const V p = vset1(e[g][j]);
      ES_UNROLL for (int c = 0; c < CW; ++c) acc[g][c] = vfma(p, vv[c], acc[g][c]);
    }
  }
  ES_UNROLL for (int g = 0; g < G; ++g) {
    ES_UNROLL for (int c = 0; c < CW; ++c) {
      const int64_t r = width - 16 * c;
      if (r <= 0) break;
      float out[16];
      vstore(out, acc[g][c]);
      for (int64_t t = 0; t < (r < 16 ? r : 16); ++t) o[g][c0 + 16 * c + t] = out[t];
    }
  }
}

template <class KT>
using ValuesFn = void (*)(const float* const*, const uint8_t* const*, const int64_t*, const KT*,
                          int64_t, int64_t, int64_t, float* const*);
template <class KT, int... G>
static constexpr auto values_table(std::integer_sequence<int, G...>) {
  return std::array<ValuesFn<KT>, sizeof...(G)>{values_tile<G + 1, ES_ATT_CW, KT>...};
}

// sum[g] = e[g][0] + e[g][1] + ... over the keys j <= last[g] that query g sees, one add
// after another in key order, for n <= 8 queries side by side in registers. A key not seen adds
// +0, which leaves every sum of exponentials (never -0) as it is.
static void sums8(int64_t n, float* const* e, const uint8_t* const* mask, const int64_t* last,
                  float* sum) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const float* p[8];
  const uint8_t* m[8];
  int64_t lst[8], L = -1, common = INT64_MAX;  // keys up to `common`: every query sees them
  ES_UNROLL for (int g = 0; g < 8; ++g) {
    p[g] = g < n ? e[g] : e[0];
    m[g] = g < n ? mask[g] : nullptr;
    lst[g] = g < n ? last[g] : -1;
    L = lst[g] > L ? lst[g] : L;
    if (g < n) common = m[g] ? -1 : lst[g] < common ? lst[g] : common;
  }
  int64_t j = 0;
  for (; j <= common; ++j)  // the same adds, without a test per query
    ES_UNROLL for (int g = 0; g < 8; ++g) acc[g] += p[g][j];
  for (; j <= L; ++j)
    ES_UNROLL for (int g = 0; g < 8; ++g) {
      const bool seen = j <= lst[g] && (!m[g] || m[g][j]);
      acc[g] += seen ? p[g][j] : 0.0f;
    }
  for (int64_t g = 0; g < n; ++g) sum[g] = acc[g];
}

// One run of keys for nq <= 64 queries: keys k_j = k + j * ldk (values alike), query i reading
// j <= last[i] (none when last[i] < 0) and seeing key j where mask[i] is null or mask[i][j] !=
// 0: top[i] = its largest visible score (-inf when none), sum[i] = the sum of e_j = exp(s_j -
// top[i]) over its visible keys in key order, acc[i][:d] = the sum of e_j v_j in key order (one
// fused multiply-add chain per lane). scratch: nq * ld floats, ld >= max last + 17.
template <class KT>
static void attend_run(int64_t nq, const float* const* qs, const uint8_t* const* mask,
                       const int64_t* last, const KT* k, const KT* v, int64_t ldk, int64_t d,
                       float scale, float* scratch, int64_t ld, float* top, float* sum,
                       float* const* acc) {
  constexpr int64_t kMaxQ = 64;
  float* e[kMaxQ];
  int64_t L = -1;
  for (int64_t i = 0; i < nq; ++i) {
    L = last[i] > L ? last[i] : L;
    e[i] = scratch + i * ld;
    top[i] = -__builtin_inff();
  }  // (sum and acc: written whole below, zeros for a query without a key)
  // the scores, a block of 16 keys against every query while the block is in L1 (0 for the
  // keys a query does not see), and each query's largest visible score
  const V ninf = vset1(-__builtin_inff());
  V mx[kMaxQ];
  for (int64_t i = 0; i < nq; ++i) mx[i] = ninf;
  for (int64_t j0 = 0; j0 <= L; j0 += 16) {
    if (ES_ATT_PF > 0) {  // the keys ES_ATT_PF blocks ahead
      const int64_t ja = j0 + 16 * ES_ATT_PF, na = L + 1 - ja < 16 ? L + 1 - ja : 16;
      for (int64_t t = 0; t < na; ++t) prefetch_row<2>(k + (ja + t) * ldk, d);
    }
    for (int64_t i = 0; i < nq; ++i) {
      if (j0 > last[i]) continue;
      // queries that all see the whole block: their scores at once, 4 or 2 of them
      int64_t run = 0;
      if (d % 16 == 0)
        while (run < 4 && i + run < nq && !mask[i + run] && j0 + 15 <= last[i + run]) ++run;
      if (run >= 2) {
        const int qn = run == 4 ? 4 : 2;
        V sq[4];
        if (qn == 4) scores16xq<4>(qs + i, k, ldk, j0, d, scale, sq);
        else scores16xq<2>(qs + i, k, ldk, j0, d, scale, sq);
        for (int u = 0; u < qn; ++u) {
          vstore(e[i + u] + j0, sq[u]);
          mx[i + u] = vmax(sq[u], mx[i + u]);
        }
        i += qn - 1;
        continue;
      }
      const int64_t n = last[i] + 1 - j0 < 16 ? last[i] + 1 - j0 : 16;
      const V sv = scores16(qs[i], k, ldk, j0, n, d, scale);
      float* s = e[i] + j0;
      if (n == 16 && !mask[i]) {
        vstore(s, sv);
        mx[i] = vmax(sv, mx[i]);  // a NaN score is passed over, as `s > mx ? s : mx`
        continue;
      }
      float out[16];
      vstore(out, sv);
      for (int64_t t = 0; t < n; ++t) {
        const bool seen = !mask[i] || mask[i][j0 + t];
        s[t] = seen ? out[t] : 0.0f;
        if (seen) top[i] = out[t] > top[i] ? out[t] : top[i];
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    if (last[i] < 0) continue;
    float m[16];
    vstore(m, mx[i]);
    for (int t = 0; t < 16; ++t) top[i] = m[t] > top[i] ? m[t] : top[i];
    // exp in chunks of 16 fixed by key index: each value depends on its own score only
    const V vtop = vset1(top[i]);
    float* s = e[i];
    for (int64_t j = 0; j <= last[i]; j += 16) {
      const int64_t r = last[i] + 1 - j < 16 ? last[i] + 1 - j : 16;
      if (r == 16) {
        vstore(s + j, vexp(vsub(vload(s + j), vtop)));
        continue;
      }
      float out[16];
      vstore(out, vexp(vsub(loadx_tail(s + j, r), vtop)));
      for (int64_t t = 0; t < r; ++t) s[j + t] = out[t];
    }
  }
  // the sums, one add after another in key order per query (8 queries' chains side by side)
  for (int64_t i = 0; i < nq; i += 8)
    sums8(nq - i < 8 ? nq - i : 8, e + i, mask + i, last + i, sum + i);
  // the values: up to ES_ATT_G queries at a time (balanced: 3 queries as one group of 3, not
  // 3 groups of 1 that each read every value again) against ES_ATT_CW chunks of 16 of d
  // the first values (values_tile's prefetch then runs ES_ATT_VPF keys ahead)
  for (int64_t t = 0; t < ES_ATT_VPF && t <= L; ++t) prefetch_row<3>(v + t * ldk, d);
  static constexpr auto tiles = values_table<KT>(std::make_integer_sequence<int, ES_ATT_G>());
  const int64_t groups = (nq + ES_ATT_G - 1) / ES_ATT_G;
  for (int64_t g = 0, i = 0; g < groups; ++g) {
    const int64_t i1 = nq * (g + 1) / groups;
    for (int64_t c0 = 0; c0 < d; c0 += 16 * ES_ATT_CW)
      tiles[i1 - i - 1](e + i, mask + i, last + i, v, ldk, d, c0, acc + i);
    i = i1;
  }
}

// A query's output from its runs' partials (attend_run), runs in key order: no visible key,
// zeros; one run, acc / sum; several, weighted by w_r = exp(top_r - top) for the largest top:
// (sum over r of w_r acc_r) / (sum over r of w_r sum_r), both in run order (the first a fused
// multiply-add chain per lane, the second a product then an add per run).
static void attend_finish(int64_t runs, const float* top, const float* sum,
                          const float* const* acc, int64_t d, float* o) {
  // a run with a visible key has sum >= 1 (its largest score's exp(0)), or NaN: kept
  float t = -__builtin_inff();
  int64_t seen = 0;
  for (int64_t r = 0; r < runs; ++r)
    if (!(sum[r] == 0.0f)) {
      t = top[r] > t ? top[r] : t;
      ++seen;
    }
  if (!seen) {
    for (int64_t c = 0; c < d; ++c) o[c] = 0.0f;
    return;
  }
  if (runs == 1) {
    const V den = vset1(sum[0]);
    for (int64_t c = 0; c < d; c += 16) {
      const int64_t n = d - c < 16 ? d - c : 16;
      float out[16];
      vstore(out, vdiv(n == 16 ? vload(acc[0] + c) : loadx_tail(acc[0] + c, n), den));
      for (int64_t q = 0; q < n; ++q) o[c + q] = out[q];
    }
    return;
  }
  float w[kAttnMaxRuns + 16];
  for (int64_t r = 0; r < runs; r += 16) {  // exp in chunks of 16 runs, elementwise
    const int64_t n = runs - r < 16 ? runs - r : 16;
    float x[16];
    for (int64_t q = 0; q < 16; ++q) x[q] = q < n ? top[r + q] - t : 0.0f;
    vstore(w + r, vexp(vload(x)));
  }
  float den = 0.0f;
  for (int64_t r = 0; r < runs; ++r)
    if (!(sum[r] == 0.0f)) den = den + w[r] * sum[r];  // an empty run adds nothing
  const V vden = vset1(den);
  for (int64_t c = 0; c < d; c += 16) {
    const int64_t n = d - c < 16 ? d - c : 16;
    V a = vzero();
    for (int64_t r = 0; r < runs; ++r)
      if (!(sum[r] == 0.0f))
        a = vfma(vset1(w[r]), n == 16 ? vload(acc[r] + c) : loadx_tail(acc[r] + c, n), a);
    float out[16];
    vstore(out, vdiv(a, vden));
    for (int64_t q = 0; q < n; ++q) o[c + q] = out[q];
  }
}
