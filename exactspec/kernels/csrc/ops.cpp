// torch operators over the ISA units (namespace `exactspec`, see exactspec/kernels/ops.py for
// their Python side and fake implementations). Threads split over output columns, rows or
// queries, never over a reduction, so a result does not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "isa.h"
#include "ops.h"

namespace exactspec {
namespace {

// AMX tiles with bf16, AVX512-BF16, and the kernel's leave to use the tile data (Linux asks
// each process to request it: arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
bool amx_usable() {
  static const bool ok = [] {
    if (!amx::built) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    const bool avx512bf16 = (a >> 5) & 1;
    if (!tile || !bf16 || !avx512bf16) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// AVX512-BF16 (CPUID leaf 7, subleaf 1, EAX bit 5) and a unit compiled with it
bool avx512bf16_usable() {
  static const bool ok = [] {
    if (!avx512bf16::built) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    return static_cast<bool>((a >> 5) & 1);
  }();
  return ok;
}

bool cpu_has(const std::string& name) {
  __builtin_cpu_init();
  if (name == "amx") return cpu_has("avx512vnni") && amx_usable();
  if (name == "avx512bf16") return cpu_has("avx512vnni") && avx512bf16_usable();
  if (name == "avx512vnni") return cpu_has("avx512") && __builtin_cpu_supports("avx512vnni");
  if (name == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (name == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return name == "portable";
}

const Isa* by_name(const std::string& name) {
  if (name == "amx") return &amx::isa;
  if (name == "avx512bf16") return &avx512bf16::isa;
  if (name == "avx512vnni") return &avx512vnni::isa;
  if (name == "avx512") return &avx512::isa;
  if (name == "avx2") return &avx2::isa;
  if (name == "portable") return &portable::isa;
  return nullptr;
}

// every unit, the first choice first (portable runs anywhere)
constexpr const char* kUnits[] = {"amx", "avx512bf16", "avx512vnni", "avx512", "avx2", "portable"};

const Isa* best() {
  for (const char* n : kUnits)
    if (cpu_has(n)) return by_name(n);
  return &portable::isa;
}

std::atomic<const Isa*> g_isa{nullptr};

const Isa& isa() {
  const Isa* p = g_isa.load();
  if (!p) {
    const char* env = std::getenv("EXACTSPEC_KERNEL_ISA");
    p = (env && *env && by_name(env) && cpu_has(env)) ? by_name(env) : best();
    g_isa.store(p);
  }
  return *p;
}

std::string set_isa(const std::string& name) {
  if (name.empty() || name == "auto") {
    g_isa.store(best());
  } else {
    TORCH_CHECK(by_name(name), "unknown ISA '", name,
                "': use amx, avx512bf16, avx512vnni, avx512, avx2, portable or auto");
    TORCH_CHECK(cpu_has(name), "this CPU cannot run the ", name, " kernels");
    g_isa.store(by_name(name));
  }
  return isa().name;
}

std::string current_isa() { return isa().name; }

std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  for (const char* n : kUnits)
    if (cpu_has(n)) out.push_back(n);
  return out;
}

// enough work (multiply-adds) to be worth waking a second thread
constexpr int64_t kParallelWork = 1 << 16;

void check_f32_rows(const at::Tensor& t, const char* what, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, what,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() == dim, what, " must have ", dim, " dims, got ", t.sizes());
}

// the optional residual of a product [M, N], checked and contiguous (undefined when absent)
at::Tensor residual_of(const c10::optional<at::Tensor>& r, int64_t M, int64_t N) {
  if (!r.has_value()) return at::Tensor();
  at::Tensor residual = r->contiguous();
  check_f32_rows(residual, "residual", 2);
  TORCH_CHECK(residual.size(0) == M && residual.size(1) == N, "residual must be [", M, ", ", N,
              "], got ", residual.sizes());
  return residual;
}

struct Part {
  const void* w;       // the weight part
  int wt;              // its WeightType
  const float* scale;  // its per-row scales or null
  int64_t col;         // its first output column
  int64_t rows;        // its output columns
};

// Output columns [0, units * unit) split into one contiguous chunk per thread, boundaries on
// whole units: every thread streams the same share of the weights (64-row tasks left one
// thread 20% idle on 576 rows). No effect on any result: an output's value does not depend
// on who computes it.
struct Chunks {
  int64_t n, units, unit;  // chunks, units to split, columns per unit
  Chunks(int64_t work, int64_t units_, int64_t unit_) : units(units_), unit(unit_) {
    const int64_t threads = work >= kParallelWork ? at::get_num_threads() : 1;
    n = std::max<int64_t>(1, std::min<int64_t>(threads, units));
  }
  int64_t bound(int64_t c) const { return units * c / n * unit; }  // first column of chunk c
  template <class F>
  void run(F f) const {  // f(first column, end column) per chunk
    auto body = [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) f(bound(c), std::min(bound(c + 1), units * unit));
    };
    if (n > 1) at::parallel_for(0, n, 1, body);
    else body(0, 1);
  }
};

}  // namespace

// residual + product on columns [c0, c1) of every row: the bits of torch's x + linear(...)
void add_residual(float* y, const float* r, int64_t M, int64_t N, int64_t c0, int64_t c1) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = c0; c < c1; ++c) y[m * N + c] += r[m * N + c];
}

at::Tensor linear(const at::Tensor& x_, at::TensorList weights,
                  const c10::optional<at::Tensor>& scales,
                  const c10::optional<at::Tensor>& residual_) {
  check_f32_rows(x_, "x", 2);
  TORCH_CHECK(!weights.empty(), "linear needs at least one weight");
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  int64_t N = 0;
  std::vector<Part> parts;
  for (const at::Tensor& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.is_contiguous() && w.device().is_cpu(),
                "each weight must be a contiguous CPU [out, ", K, "] matrix, got ", w.sizes());
    int wt;
    switch (w.scalar_type()) {
      case at::kFloat: wt = W_F32; break;
      case at::kBFloat16: wt = W_BF16; break;
      case at::kChar: wt = W_I8; break;
      default: TORCH_CHECK(false, "weight dtype ", w.scalar_type(), " is not supported");
    }
    parts.push_back({w.data_ptr(), wt, nullptr, N, w.size(0)});
    N += w.size(0);
  }
  if (scales.has_value()) {
    const at::Tensor& s = *scales;
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 1 && s.size(0) == N &&
                    s.is_contiguous(), "scales must be a contiguous float32 [", N, "] tensor");
    for (Part& p : parts) p.scale = s.data_ptr<float>() + p.col;
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const at::Tensor residual = residual_of(residual_, M, N);
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.defined() ? residual.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const Isa& k = isa();
  // chunks on multiples of 16 columns (whole register tiles), the last one ragged
  Chunks(M * N * K, (N + 15) / 16, 16).run([&](int64_t lo, int64_t hi) {
    for (const Part& p : parts) {
      const int64_t r0 = std::max(lo, p.col) - p.col;
      const int64_t r1 = std::min(std::min(hi, N), p.col + p.rows) - p.col;
      if (r0 >= r1) continue;
      k.linear(xp, M, K, p.w, p.wt, p.scale, yp + p.col, N, r0, r1);
      if (rp) add_residual(yp, rp, M, N, p.col + r0, p.col + r1);
    }
  });
  return y;
}

namespace {
// The frame of a packed integer product (linear_w8a16, linear_w4a8): x [M, K] float32 rows (K
// padded to Kp, a multiple of 32), scales [N] float32, the residual checked
struct Packed {
  at::Tensor x, residual;
  int64_t M, K, Kp, N;
};
Packed packed_args(const at::Tensor& x_, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& residual_) {
  check_f32_rows(x_, "x", 2);
  Packed a;
  a.x = x_.contiguous();
  a.M = a.x.size(0);
  a.K = a.x.size(1);
  a.Kp = (a.K + 31) / 32 * 32;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.is_contiguous(),
              "scales must be a contiguous float32 [N] tensor");
  a.N = scales.size(0);
  a.residual = residual_of(residual_, a.M, a.N);
  return a;
}
// y [M, N] in chunks of whole panels of np outputs: panel(y, p0, p1) writes the panels [p0,
// p1), then their columns get the residual
template <class F>
at::Tensor packed_run(const Packed& a, int64_t np, F panel) {
  at::Tensor y = at::empty({a.M, a.N}, a.x.options());
  const float* rp = a.residual.defined() ? a.residual.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  Chunks(a.M * a.N * a.K, (a.N + np - 1) / np, 1).run([&](int64_t p0, int64_t p1) {
    panel(yp, p0, p1);
    if (rp) add_residual(yp, rp, a.M, a.N, np * p0, std::min(np * p1, a.N));
  });
  return y;
}
}  // namespace

// x [M, K] float32, w int8 packed by kernels.pack_int8 ([ceil(N / 32), Kp / 2, 32, 2], Kp = K
// rounded up to 32), scales [N] float32: each row of x quantized to int16 (x_q = round(x *
// (32767 / amax)), clamped, sx = amax / 32767, per row), then y = (float(sum_k x_q w) * sx) *
// scales[n] with the sum exact (impl_w8a16.h), (+ residual)
at::Tensor linear_w8a16(const at::Tensor& x_, const at::Tensor& w, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& residual_) {
  const Packed a = packed_args(x_, scales, residual_);
  const int64_t M = a.M, K = a.K, Kp = a.Kp, N = a.N, panels = (N + 31) / 32;
  // (the kernel converts an exact sum, |sum| <= K * 32767 * 128, to float through a double,
  // exact below 2^51: impl_w8a16.h)
  TORCH_CHECK(K < (int64_t{1} << 28), "linear_w8a16 takes rows of fewer than 2^28 inputs, got ", K);
  TORCH_CHECK(w.dim() == 4 && w.size(0) == panels && w.size(1) * 2 == Kp && w.size(2) == 32 &&
                  w.size(3) == 2 && w.is_contiguous() && w.device().is_cpu() &&
                  w.scalar_type() == at::kChar,
              "w must be int8 packed by kernels.pack_int8: [", panels, ", ", Kp / 2,
              ", 32, 2], got ", w.scalar_type(), " ", w.sizes());
  at::Tensor xq = at::empty({M, Kp}, a.x.options().dtype(at::kShort));
  at::Tensor sx = at::empty({M}, a.x.options());
  const float* xp = a.x.data_ptr<float>();
  int16_t* qp = xq.data_ptr<int16_t>();
  float* sp = sx.data_ptr<float>();
  const Isa& k = isa();
  for (int64_t m = 0; m < M; ++m) k.quantize_i16(xp + m * K, K, Kp, qp + m * Kp, sp + m);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* scp = scales.data_ptr<float>();
  return packed_run(a, 32, [&](float* yp, int64_t g0, int64_t g1) {
    k.linear_w8a16(qp, Kp, M, Kp, wp, sp, scp, yp, N, N, g0, g1);
  });
}

// x [M, K] float32, w int4 packed by kernels.pack_int4 ([ceil(N / 16), G, 320] uint8, G = Kp /
// 32 groups, Kp = K rounded up to 32), scales [N] float32: each group of 32 inputs of a row of x
// rounded to int8 (quantize_i8g), then y = scales[n] * (the groups' sx (d S + m X) in group
// order, S exact) (impl_w4.h), (+ residual)
at::Tensor linear_w4a8(const at::Tensor& x_, const at::Tensor& w, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& residual_) {
  const Packed a = packed_args(x_, scales, residual_);
  const int64_t M = a.M, K = a.K, Kp = a.Kp, G = Kp / 32, N = a.N, panels = (N + 15) / 16;
  TORCH_CHECK(w.dim() == 3 && w.size(0) == panels && w.size(1) == G && w.size(2) == 320 &&
                  w.is_contiguous() && w.device().is_cpu() && w.scalar_type() == at::kByte,
              "w must be int4 packed by kernels.pack_int4: [", panels, ", ", G,
              ", 320] uint8, got ", w.scalar_type(), " ", w.sizes());
  at::Tensor xq = at::empty({M, Kp}, a.x.options().dtype(at::kChar));
  at::Tensor gs = at::empty({2, M, G}, a.x.options());  // each group's sx, then its sum X
  const float* xp = a.x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sxp = gs.data_ptr<float>();
  float* xsp = sxp + M * G;
  const Isa& k = isa();
  for (int64_t m = 0; m < M; ++m)
    k.quantize_i8g(xp + m * K, K, Kp, qp + m * Kp, sxp + m * G, xsp + m * G);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* scp = scales.data_ptr<float>();
  return packed_run(a, 16, [&](float* yp, int64_t p0, int64_t p1) {
    k.linear_w4a8(qp, Kp, sxp, xsp, M, G, wp, scp, yp, N, N, p0, p1);
  });
}

namespace {
template <class F>
void over_rows(int64_t M, int64_t work_per_row, F f) {
  if (M > 1 && M * work_per_row >= kParallelWork) at::parallel_for(0, M, 1, f);
  else f(0, M);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w_, double eps) {
  check_f32_rows(x_, "x", 2);
  const at::Tensor x = x_.contiguous(), w = w_.contiguous().to(at::kFloat);
  const int64_t M = x.size(0), H = x.size(1);
  TORCH_CHECK(w.numel() == H, "norm weight has ", w.numel(), " values for rows of ", H);
  at::Tensor y = at::empty_like(x);
  const Isa& k = isa();
  over_rows(M, H, [&](int64_t b, int64_t e) {
    k.rms_norm(x.data_ptr<float>(), w.data_ptr<float>(), static_cast<float>(eps), H,
               y.data_ptr<float>(), b, e);
  });
  return y;
}

at::Tensor silu_mul(const at::Tensor& g_) {
  check_f32_rows(g_, "gate_up", 2);
  const at::Tensor g = g_.contiguous();
  TORCH_CHECK(g.size(1) % 2 == 0, "gate_up must have an even number of columns");
  const int64_t M = g.size(0), I = g.size(1) / 2;
  at::Tensor y = at::empty({M, I}, g.options());
  const Isa& k = isa();
  over_rows(M, 16 * I, [&](int64_t b, int64_t e) {
    k.silu_mul(g.data_ptr<float>(), I, y.data_ptr<float>(), b, e);
  });
  return y;
}

void rope_(const at::Tensor& x, const at::Tensor& cos_, const at::Tensor& sin_, int64_t heads) {
  check_f32_rows(x, "x", 2);
  TORCH_CHECK(x.stride(1) == 1, "x must be row-major");
  const at::Tensor c = cos_.contiguous(), s = sin_.contiguous();
  check_f32_rows(c, "cos", 2);
  check_f32_rows(s, "sin", 2);
  const int64_t M = x.size(0), d = c.size(1);
  TORCH_CHECK(c.size(0) == M && s.sizes() == c.sizes() && d % 2 == 0 && heads * d <= x.size(1),
              "rope: cos / sin must be [", M, ", d] with heads * d <= ", x.size(1));
  const Isa& k = isa();
  over_rows(M, heads * d, [&](int64_t b, int64_t e) {
    k.rope(x.data_ptr<float>(), x.stride(0), heads, d, c.data_ptr<float>(),
           s.data_ptr<float>(), b, e);
  });
}

// the last key a query sees (-1: none), and whether it sees every key up to it; the mask read
// 8 bytes at a time (bool bytes: 0 or 1)
int64_t last_visible(const uint8_t* visible, int64_t S, bool* dense) {
  *dense = true;
  if (!visible) return S - 1;
  int64_t j = S;
  for (; j >= 8; j -= 8) {
    uint64_t w;
    std::memcpy(&w, visible + j - 8, 8);
    if (w) break;
  }
  while (j > 0 && !visible[j - 1]) --j;
  const int64_t last = j - 1;
  int64_t i = 0;
  for (; i + 8 <= last + 1; i += 8) {
    uint64_t w;
    std::memcpy(&w, visible + i, 8);
    if ((w - 0x0101010101010101ULL) & ~w & 0x8080808080808080ULL) break;  // a zero byte
  }
  for (; i <= last; ++i)
    if (!visible[i]) {
      *dense = false;
      break;
    }
  return last;
}

// q [B, T, h, d], k / v [B, kv, S, d] (strided over B and kv; rows of d contiguous, one key
// every ldk floats), mask [B, 1, T, S] or [B, T, S] bool or none -> [B, T, h, d]
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask_, double scale) {
  check_f32_rows(q, "q", 4);
  // the cache: float32, or bf16 (widened exactly as it is read: attend_run_bf16)
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && k.dim() == 4 && v.dim() == 4 &&
                  (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16) &&
                  v.scalar_type() == k.scalar_type(),
              "attention: k and v must be CPU [B, kv, S, d] tensors, both float32 or both "
              "bfloat16, got ", k.scalar_type(), " and ", v.scalar_type());
  const bool bf16 = k.scalar_type() == at::kBFloat16;
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), d = q.size(3);
  const int64_t KV = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == d && v.sizes() == k.sizes() && H % KV == 0,
              "attention: q ", q.sizes(), " k ", k.sizes(), " v ", v.sizes());
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 &&
                  k.stride(2) == v.stride(2) && k.stride(0) == v.stride(0) &&
                  k.stride(1) == v.stride(1), "attention: rows of d must be contiguous and k, v "
              "laid out alike");
  at::Tensor mask;
  int64_t mb = 0, mt = 0;
  if (mask_.has_value()) {
    mask = *mask_;
    if (mask.dim() == 4) mask = mask.select(1, 0);
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 3 && mask.size(0) == B &&
                    mask.size(1) == T && mask.size(2) == S, "attention: mask must be bool [B, T, S]");
    if (mask.stride(2) != 1) mask = mask.contiguous();
    mb = mask.stride(0);
    mt = mask.stride(1);
  }
  at::Tensor o = at::empty({B, T, H, d}, q.options());
  const Isa& kern = isa();
  const float* qp = q.data_ptr<float>();
  const void* kp = k.data_ptr();
  const void* vp = v.data_ptr();
  const uint8_t* mp = mask.defined() ? reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>())
                                     : nullptr;
  float* op = o.data_ptr<float>();
  const int64_t rep = H / KV;
  // Each query's visible keys: its last one and whether it sees all before it; its keys in
  // runs of kAttnRun fixed by key index (one run up to 512 keys), combined in key order, so a
  // query's bits depend on its own keys only, whatever the call's width, the tasks or threads.
  std::vector<int64_t> last(B * T);
  std::vector<const uint8_t*> mrow(B * T);
  int64_t max_last = -1;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const uint8_t* row = mp ? mp + b * mb + t * mt : nullptr;
      bool dense;
      last[b * T + t] = last_visible(row, S, &dense);
      mrow[b * T + t] = dense ? nullptr : row;
      max_last = std::max(max_last, last[b * T + t]);
    }
  const int64_t runs_max = attn_runs(max_last);
  TORCH_CHECK(runs_max <= kAttnMaxRuns, "attention: at most ", kAttnMaxRuns * kAttnRun,
              " keys, got ", S);
  // Tasks: the query heads of one key/value head at up to 24 / rep consecutive positions,
  // which share each block of keys while it is in L1; when that gives the threads too few
  // tasks (a one-token step) and a head's keys and values fit in L2, or when a group has more
  // than 24 heads (a task holds at most 24 queries), one head each. With few
  // tasks each (task, run) is a work item of its own, so the runs of a long context spread
  // over the threads, each key read once (a one-token step at 2k keys: docs/performance.md);
  // with many (prefill), a task does its runs in turn. Work items come from a shared counter,
  // the latest positions first, so a thread that falls behind (a busy core) takes fewer.
  const int threads = at::get_num_threads();
  // threads only from ~1k keys of a decode step's 9 heads: below that a second thread saved
  // nothing (docs/performance.md, "The int4 kernel")
  const bool parallel = threads > 1 && B * T * H * S * d >= 8 * kParallelWork;
  const int64_t tb = std::max<int64_t>(1, std::min<int64_t>(T, 24 / rep));
  const int64_t tblocks = (T + tb - 1) / tb;
  const bool in_l2 = 2 * S * d * static_cast<int64_t>(sizeof(float)) <= (int64_t{256} << 10);
  const int64_t hsplit =
      ((parallel && B * KV * tblocks < 2 * threads && in_l2) || rep > 24) ? rep : 1;
  const int64_t hper = rep / hsplit, nqmax = tb * hper;
  const int64_t tasks = B * KV * hsplit * tblocks;
  const bool by_run = runs_max > 1 && tasks < 4 * threads;
  const int64_t stride = d + 2;  // a query's partial in a run: top, sum, acc[d]
  std::vector<float> partials(by_run ? tasks * runs_max * nqmax * stride : 0);
  // task i's queries: (b, t, h) for its positions and heads
  auto queries = [&](int64_t i, int64_t* bt, int64_t* hs) {
    const int64_t blk = tblocks - 1 - i / (B * KV * hsplit);  // the latest positions first
    const int64_t rest = i % (B * KV * hsplit);
    const int64_t b = rest / (KV * hsplit), g = (rest / hsplit) % KV, part = rest % hsplit;
    int64_t nq = 0;
    for (int64_t t = blk * tb; t < std::min(T, (blk + 1) * tb); ++t)
      for (int64_t h = g * rep + part * hper; h < g * rep + (part + 1) * hper; ++h) {
        bt[nq] = b * T + t;
        hs[nq] = h;
        ++nq;
      }
    return nq;
  };
  // run r of task i's queries into part (nqmax slots of `stride` floats)
  auto run_one = [&](int64_t i, int64_t r, float* part, float* scratch) {
    int64_t bt[64], hs[64], rel[64];
    const float* qs[64];
    const uint8_t* ms[64];
    float *acc[64], top[64], sum[64];
    const int64_t nq = queries(i, bt, hs);
    const int64_t b = bt[0] / T, g = hs[0] / rep, j0 = r * kAttnRun;
    for (int64_t u = 0; u < nq; ++u) {
      qs[u] = qp + b * q.stride(0) + (bt[u] % T) * q.stride(1) + hs[u] * q.stride(2);
      ms[u] = mrow[bt[u]] ? mrow[bt[u]] + j0 : nullptr;
      rel[u] = std::min(last[bt[u]], j0 + kAttnRun - 1) - j0;  // < 0: no key in this run
      acc[u] = part + u * stride + 2;
    }
    const int64_t off = b * k.stride(0) + g * k.stride(1) + j0 * k.stride(2);
    attend_cache(kern, bf16, nq, qs, ms, rel, kp, vp, off, k.stride(2), d,
                 static_cast<float>(scale), scratch, kAttnRun + 32, top, sum, acc);
    for (int64_t u = 0; u < nq; ++u) {
      part[u * stride] = top[u];
      part[u * stride + 1] = sum[u];
    }
  };
  // task i's outputs from its runs' partials (part(r) gives run r's slots)
  auto finish = [&](int64_t i, auto part) {
    int64_t bt[64], hs[64];
    const int64_t nq = queries(i, bt, hs);
    for (int64_t q = 0; q < nq; ++q) {
      const int64_t runs = attn_runs(last[bt[q]]);
      float top[kAttnMaxRuns], sum[kAttnMaxRuns];
      const float* acc[kAttnMaxRuns];
      for (int64_t r = 0; r < runs; ++r) {
        const float* p = part(r) + q * stride;
        top[r] = p[0];
        sum[r] = p[1];
        acc[r] = p + 2;
      }
      kern.attend_finish(runs, top, sum, acc, d, op + (bt[q] * H + hs[q]) * d);
    }
  };
  auto workers = [&](auto body) {
    if (parallel) at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(); });
    else body();
  };
  if (by_run) {  // (task, run) items, then each task's outputs
    std::atomic<int64_t> next{0};
    workers([&] {
      std::vector<float> scratch(nqmax * (kAttnRun + 32));
      for (int64_t w = next++; w < tasks * runs_max; w = next++) {
        const int64_t i = w % tasks, r = w / tasks;
        run_one(i, r, partials.data() + (i * runs_max + r) * nqmax * stride, scratch.data());
      }
    });
    std::atomic<int64_t> fin{0};
    workers([&] {
      for (int64_t i = fin++; i < tasks; i = fin++)
        finish(i, [&](int64_t r) {
          return partials.data() + (i * runs_max + r) * nqmax * stride;
        });
    });
  } else {  // each task's runs in turn, then its outputs
    std::atomic<int64_t> next{0};
    workers([&] {
      std::vector<float> scratch(nqmax * (kAttnRun + 32));
      std::vector<float> local(runs_max * nqmax * stride);
      for (int64_t i = next++; i < tasks; i = next++) {
        int64_t bt[64], hs[64];
        const int64_t nq = queries(i, bt, hs);
        int64_t runs = 1;
        for (int64_t q = 0; q < nq; ++q) runs = std::max(runs, attn_runs(last[bt[q]]));
        for (int64_t r = 0; r < runs; ++r)
          run_one(i, r, local.data() + r * nqmax * stride, scratch.data());
        finish(i, [&](int64_t r) { return local.data() + r * nqmax * stride; });
      }
    });
  }
  return o;
}

const Isa& current_unit() { return isa(); }

TORCH_LIBRARY(exactspec, m) {
  m.def("linear(Tensor x, Tensor[] weights, Tensor? scales=None, Tensor? residual=None) -> Tensor");
  m.def("linear_w8a16(Tensor x, Tensor w, Tensor scales, Tensor? residual=None) -> Tensor");
  m.def("linear_w4a8(Tensor x, Tensor w, Tensor scales, Tensor? residual=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, int heads) -> ()");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.def("set_isa(str name) -> str", set_isa);
  m.def("current_isa() -> str", current_isa);
  m.def("available_isas() -> str[]", available_isas);
}

TORCH_LIBRARY_IMPL(exactspec, CPU, m) {
  m.impl("linear", linear);
  m.impl("linear_w8a16", linear_w8a16);
  m.impl("linear_w4a8", linear_w4a8);
  m.impl("rms_norm", rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("rope_", rope_);
  m.impl("attention", attention);
}

}  // namespace exactspec
