// The kernels one instruction set provides: plain C++ over raw pointers, no torch headers, so
// each ISA's translation unit can be compiled with its own -m flags without leaking those
// instructions into inline code shared with other units (every name lives in its own namespace).
//
// The batch-invariance rule every kernel keeps: an output element is reduced in one fixed
// order that depends only on its own inputs (16 lanes, accumulation along the reduced axis in
// index order per lane, one fixed horizontal-sum tree, fused multiply-add everywhere), never on
// how many rows share the call, on tiling, or on which thread computes it. The AVX-512, AVX2
// and portable units implement the same arithmetic, so they agree bit for bit.
#pragma once
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

namespace exactspec {

// attention over a long context: a query's keys in runs of kAttnRun fixed by key index (its
// runs computed apart, then combined in key order: impl_attn.h), at most kAttnMaxRuns of them
constexpr int64_t kAttnRun = 512;
constexpr int64_t kAttnMaxRuns = 64;
// the runs a query whose last visible key is `last` (-1: none) reads: one at least
constexpr int64_t attn_runs(int64_t last) { return last < 0 ? 1 : last / kAttnRun + 1; }

// The kernels' tiles picked by shape at run time: shape_table<Fns, COLS>(make_integer_sequence
// <int, ROWS>()) is t[r - 1][c - 1] = Fns::template of<r, c> for r <= ROWS, c <= COLS, and
// shape_row<Fns, R>(make_integer_sequence<int, COLS>()) one such row; Fns names the pointer
// type (`using Fn`) and `template <int R, int C> static constexpr Fn of` (one tile per shape)
template <class Fns, int R, int... C>
constexpr std::array<typename Fns::Fn, sizeof...(C)> shape_row(std::integer_sequence<int, C...>) {
  return {Fns::template of<R, C + 1>...};
}
template <class Fns, int COLS, int... R>
constexpr std::array<std::array<typename Fns::Fn, COLS>, sizeof...(R)> shape_table(
    std::integer_sequence<int, R...>) {
  return {shape_row<Fns, R + 1>(std::make_integer_sequence<int, COLS>())...};
}

// dtype codes of a weight matrix
enum WeightType : int { W_F32 = 0, W_BF16 = 1, W_I8 = 2 };

struct Isa {
  const char* name;
  // y[m, n] (row stride ldy) = scale[n] * sum_k x[m, k] w[n, k] for n in [n0, n1), m in [0, M);
  // w: [N, K] row-major of `wtype`; scale: [N] float or null (then 1)
  void (*linear)(const float* x, int64_t M, int64_t K, const void* w, int wtype,
                 const float* scale, float* y, int64_t ldy, int64_t n0, int64_t n1);
  // y[m, :] = x[m, :] / sqrt(mean(x[m, :]^2) + eps) * w for m in [m0, m1)
  void (*rms_norm)(const float* x, const float* w, float eps, int64_t H, float* y,
                   int64_t m0, int64_t m1);
  // y[m, i] = silu(g[m, i]) * g[m, I + i], g: [M, 2I], for m in [m0, m1)
  void (*silu_mul)(const float* g, int64_t I, float* y, int64_t m0, int64_t m1);
  // in place on `heads` heads of d values at x + m * ldx, with cos/sin [M, d], for m in [m0, m1)
  void (*rope)(float* x, int64_t ldx, int64_t heads, int64_t d, const float* cos,
               const float* sin, int64_t m0, int64_t m1);
  // one run of keys for nq <= 64 queries (impl_attn.h): keys k + j * ldk (values alike) for
  // j <= last[i] (none when < 0), seen where mask[i] is null or mask[i][j] != 0: top[i] the
  // largest visible score * scale, sum[i] the sum of exp(score - top) in key order, acc[i][:d]
  // the sum of exp(score - top) v_j in key order; scratch: nq * ld floats, ld >= max last + 17
  void (*attend_run)(int64_t nq, const float* const* qs, const uint8_t* const* mask,
                     const int64_t* last, const float* k, const float* v, int64_t ldk,
                     int64_t d, float scale, float* scratch, int64_t ld, float* top,
                     float* sum, float* const* acc);
  // a query's output o[:d] from its runs' (top, sum, acc) in key order (impl_attn.h)
  void (*attend_finish)(int64_t runs, const float* top, const float* sum,
                        const float* const* acc, int64_t d, float* o);
  // y[m, i] = gelu_tanh(g[m, i]) * g[m, I + i], g: [M, 2I], for m in [m0, m1) (impl_act.h)
  void (*gelu_tanh_mul)(const float* g, int64_t I, float* y, int64_t m0, int64_t m1);
  // y[m, n] = (float(sum_k xq[m, k] w[n, k]) * sx[m]) * scale[n] (the sum exact, in integers)
  // for the outputs n < N of the panels of 32 in [g0, g1), m in [0, M): xq int16 rows of
  // stride ldx (>= Kp, zero-padded), w int8 packed in panels (impl_w8a16.h), K padded to Kp
  void (*linear_w8a16)(const int16_t* xq, int64_t ldx, int64_t M, int64_t Kp, const int8_t* w,
                       const float* sx, const float* scale, float* y, int64_t ldy, int64_t N,
                       int64_t g0, int64_t g1);
  // one row of x [K] rounded to int16 for linear_w8a16: q[k] = round(x[k] * 32767 / amax),
  // clamped to +-32767, zeros from K to Kp, *sx = amax / 32767 (impl_w8a16.h)
  void (*quantize_i16)(const float* x, int64_t K, int64_t Kp, int16_t* q, float* sx);
  // y[m, n] = scale[n] * sum over the groups g in order of sx[m, g] (d[n, g] S + m[n, g]
  // xs[m, g]), S = sum_k xq[m, k] q[n, k] exact, for the outputs n < N of the panels of 16 in
  // [p0, p1), m in [0, M): int4 weights packed by kernels.pack_int4 (impl_w4.h), G groups of 32
  void (*linear_w4a8)(const int8_t* xq, int64_t ldx, const float* sx, const float* xs,
                      int64_t M, int64_t G, const uint8_t* w, const float* scale, float* y,
                      int64_t ldy, int64_t N, int64_t p0, int64_t p1);
  // one row of x [K] rounded to int8 per group of 32 for linear_w4a8 (impl_w4.h)
  void (*quantize_i8g)(const float* x, int64_t K, int64_t Kp, int8_t* xq, float* sx, float* xs);
  // attend_run over a bf16 cache: k and v bf16 (uint16_t), each widened exactly to float32, so
  // attend_run's bits on a float32 cache holding the same values (impl_attn.h)
  void (*attend_run_bf16)(int64_t nq, const float* const* qs, const uint8_t* const* mask,
                          const int64_t* last, const uint16_t* k, const uint16_t* v,
                          int64_t ldk, int64_t d, float scale, float* scratch, int64_t ld,
                          float* top, float* sum, float* const* acc);
};

// unit.attend_run, or attend_run_bf16 where the cache is bf16, on the keys and values `off`
// elements into the cache's buffers kc and vc (float, or uint16_t where bf16)
inline void attend_cache(const Isa& unit, bool bf16, int64_t nq, const float* const* qs,
                         const uint8_t* const* mask, const int64_t* last, const void* kc,
                         const void* vc, int64_t off, int64_t ldk, int64_t d, float scale,
                         float* scratch, int64_t ld, float* top, float* sum, float* const* acc) {
  if (bf16)
    unit.attend_run_bf16(nq, qs, mask, last, static_cast<const uint16_t*>(kc) + off,
                         static_cast<const uint16_t*>(vc) + off, ldk, d, scale, scratch, ld,
                         top, sum, acc);
  else
    unit.attend_run(nq, qs, mask, last, static_cast<const float*>(kc) + off,
                    static_cast<const float*>(vc) + off, ldk, d, scale, scratch, ld, top, sum,
                    acc);
}

namespace amx {
extern const Isa isa;
extern const bool built;  // compiled with AMX (the compiler took its flags)
}
namespace avx512bf16 {
extern const Isa isa;
extern const bool built;  // compiled with AVX512-BF16 (the compiler took its flag)
}
namespace avx512vnni { extern const Isa isa; }
namespace avx512 { extern const Isa isa; }
namespace avx2 { extern const Isa isa; }
namespace portable { extern const Isa isa; }

// the unit in use (ops.cpp: EXACTSPEC_KERNEL_ISA / set_isa, else the best this CPU runs)
const Isa& current_unit();

}  // namespace exactspec
