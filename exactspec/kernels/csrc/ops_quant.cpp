// The int4 draft's quantization as one operator (`exactspec::int4_quantize`): per group of n
// weights, the (d, m) of least squared error among candidate ranges, each candidate's q
// refitted by least squares, then q against d and m rounded to bf16 (models/quantize.py's
// `quantize_int4_kernel` with `int4_search_reference` states the same arithmetic in torch
// operators, which run where the kernels are off; tests/kernels/test_int4_quantize.py compares
// them bit for bit).
//
// Every value is float32 arithmetic in one defined order: sums run over a group's weights in
// index order, each operation rounded on its own (the ops unit is compiled with
// -ffp-contract=off, so no multiply-add is fused), rounding to the nearest integer with ties to
// even (as torch.round). Lanes hold 16 groups side by side, so the compiler may vectorize
// across groups without reordering any group's own sums: the same bits on every CPU.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "ops.h"

namespace exactspec {
namespace {

constexpr int kL = 16;  // groups per lane block

// the candidates: (fraction of the min-max span, where it sits inside it), the same list as
// models/quantize.py's INT4_CANDIDATES, in the same order (a later candidate replaces the best
// only when strictly better)
constexpr float kCandidates[][2] = {{1.0f, 0.0f},  {0.95f, 0.5f}, {0.9f, 0.5f},  {0.85f, 0.5f},
                                    {0.8f, 0.5f},  {0.7f, 0.5f},  {0.95f, 0.0f}, {0.95f, 1.0f},
                                    {0.9f, 0.0f},  {0.9f, 1.0f},  {0.85f, 0.0f}, {0.85f, 1.0f}};

// round to nearest, ties to even, of x clamped to [-1, 16] first (the callers clamp the result
// to [0, 15], which the clamp before rounding does not change): there 1.5 * 2^23 added and
// subtracted leaves the integer nearest x, ties to even (the binade's spacing is 1)
__attribute__((always_inline)) inline float round_clamped(float x) {
  constexpr float kMagic = 12582912.0f;
  x = x < -1.0f ? -1.0f : x;
  x = x > 16.0f ? 16.0f : x;
  const float r = (x + kMagic) - kMagic;
  return r < 0.0f ? 0.0f : (r > 15.0f ? 15.0f : r);
}

// blocks of kL groups: g[e][l] is weight e of group l (n weights a group)
struct Block {
  int n;
  std::vector<float> g, q;  // [n][kL]: the weights, a candidate's q
  float lo[kL], hi[kL], sw[kL];

  explicit Block(int n_) : n(n_), g(static_cast<size_t>(n_) * kL), q(g.size()) {}

  // sum over e of (g - (d q + m))^2 for the q each lane's (d, m) gives: d > 0 ? round((g -
  // m) / d) : 0, clamped to [0, 15]
  __attribute__((always_inline)) void error(const float* d, const float* m, float* err) const {
    float div[kL];
    for (int l = 0; l < kL; ++l) {
      err[l] = 0.0f;
      div[l] = d[l] > 0.0f ? d[l] : 1.0f;
    }
    for (int e = 0; e < n; ++e) {
      const float* ge = &g[static_cast<size_t>(e) * kL];
      for (int l = 0; l < kL; ++l) {
        const float qr = round_clamped((ge[l] - m[l]) / div[l]);
        const float q = d[l] > 0.0f ? qr : 0.0f;
        const float r = ge[l] - (d[l] * q + m[l]);
        err[l] = err[l] + r * r;
      }
    }
  }

  __attribute__((always_inline)) void search(float* best_d, float* best_m) {
    const float nf = static_cast<float>(n);
    float best_err[kL], base[kL], scale[kL], sq[kL], sqq[kL], sqw[kL], d[kL], m[kL], err[kL];
    for (int l = 0; l < kL; ++l) {
      best_d[l] = (hi[l] - lo[l]) / 15.0f;
      best_m[l] = lo[l];
    }
    error(best_d, best_m, best_err);
    for (const auto& c : kCandidates) {
      for (int l = 0; l < kL; ++l) {
        const float span = (hi[l] - lo[l]) * c[0];
        base[l] = lo[l] + ((hi[l] - lo[l]) - span) * c[1];
        scale[l] = span > 0.0f ? span / 15.0f : 1.0f;
        sq[l] = sqq[l] = sqw[l] = err[l] = 0.0f;
      }
      for (int e = 0; e < n; ++e) {
        const float* ge = &g[static_cast<size_t>(e) * kL];
        float* qe = &q[static_cast<size_t>(e) * kL];
        for (int l = 0; l < kL; ++l) {
          const float v = round_clamped((ge[l] - base[l]) / scale[l]);
          qe[l] = v;
          sq[l] = sq[l] + v;
          sqq[l] = sqq[l] + v * v;
          sqw[l] = sqw[l] + v * ge[l];
        }
      }
      for (int l = 0; l < kL; ++l) {
        const float det = nf * sqq[l] - sq[l] * sq[l];
        const float dd = (nf * sqw[l] - sq[l] * sw[l]) / (det > 0.0f ? det : 1.0f);
        d[l] = det > 0.0f && dd > 0.0f ? dd : 0.0f;
        m[l] = (sw[l] - d[l] * sq[l]) / nf;
      }
      // the candidate's error over its own q (not q refitted to its d and m)
      for (int e = 0; e < n; ++e) {
        const float* ge = &g[static_cast<size_t>(e) * kL];
        const float* qe = &q[static_cast<size_t>(e) * kL];
        for (int l = 0; l < kL; ++l) {
          const float r = ge[l] - (d[l] * qe[l] + m[l]);
          err[l] = err[l] + r * r;
        }
      }
      for (int l = 0; l < kL; ++l) {
        const bool better = err[l] < best_err[l];
        best_d[l] = better ? d[l] : best_d[l];
        best_m[l] = better ? m[l] : best_m[l];
        best_err[l] = better ? err[l] : best_err[l];
      }
    }
  }
};

// blocks [b0, b1) of kL groups of x ([R, n]) searched, then each group's d and m rounded to
// bf16 (to nearest even, as torch's cast) and its q = d > 0 ? round((x - m) / d) clamped to
// [0, 15] : 0 against those; compiled for AVX-512, AVX2 and the baseline, the one for this CPU
// picked at load (the same bits: no operation is fused or reordered, only the vectors' width
// differs)
__attribute__((target_clones("avx512f", "avx2", "default"))) void quantize_blocks(
    const float* px, int64_t R, int n, uint8_t* pq, c10::BFloat16* pd, c10::BFloat16* pm,
    int64_t b0, int64_t b1) {
  Block blk(n);
  float d[kL], m[kL];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t r0 = b * kL, lanes = std::min<int64_t>(kL, R - r0);
    for (int l = 0; l < kL; ++l) {  // a short block repeats its last group in unused lanes
      const float* src = px + (r0 + std::min<int64_t>(l, lanes - 1)) * n;
      float lo = src[0], hi = src[0], s = 0.0f;
      for (int e = 0; e < n; ++e) {
        const float v = src[e];
        blk.g[static_cast<size_t>(e) * kL + l] = v;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        s = s + v;
      }
      blk.lo[l] = lo;
      blk.hi[l] = hi;
      blk.sw[l] = s;
    }
    blk.search(d, m);
    for (int64_t l = 0; l < lanes; ++l) {
      const c10::BFloat16 db(d[l]), mb(m[l]);
      pd[r0 + l] = db;
      pm[r0 + l] = mb;
      const float df = static_cast<float>(db), mf = static_cast<float>(mb);
      const float div = df > 0.0f ? df : 1.0f;
      const float* src = px + (r0 + l) * n;
      uint8_t* q = pq + (r0 + l) * n;
      for (int e = 0; e < n; ++e) {
        const float v = round_clamped((src[e] - mf) / div);
        q[e] = static_cast<uint8_t>(df > 0.0f ? v : 0.0f);
      }
    }
  }
}

// w: [R, n] float32 (R groups of n weights) -> q [R, n] uint8, d [R] and m [R] bfloat16
std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_quantize(const at::Tensor& w) {
  TORCH_CHECK_VALUE(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
                    "int4_quantize takes a [groups, n] float32 CPU tensor, got ", w.sizes(), " ",
                    w.scalar_type());
  const at::Tensor x = w.contiguous();
  const int64_t R = x.size(0);
  const int n = static_cast<int>(x.size(1));
  TORCH_CHECK_VALUE(n > 0, "int4_quantize needs groups of at least one weight");
  at::Tensor q = at::empty({R, n}, x.options().dtype(at::kByte));
  at::Tensor d = at::empty({R}, x.options().dtype(at::kBFloat16));
  at::Tensor m = at::empty({R}, x.options().dtype(at::kBFloat16));
  const float* px = x.data_ptr<float>();
  uint8_t* pq = q.data_ptr<uint8_t>();
  c10::BFloat16* pd = d.data_ptr<c10::BFloat16>();
  c10::BFloat16* pm = m.data_ptr<c10::BFloat16>();
  at::parallel_for(0, (R + kL - 1) / kL, 64, [&](int64_t b0, int64_t b1) {
    quantize_blocks(px, R, n, pq, pd, pm, b0, b1);
  });
  return {q, d, m};
}

TORCH_LIBRARY_FRAGMENT(exactspec, m) {
  m.def("int4_quantize(Tensor w) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(exactspec, CPU, m) { m.impl("int4_quantize", int4_quantize); }

}  // namespace
}  // namespace exactspec
