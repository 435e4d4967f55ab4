// How fast this CPU's AVX2 multiply-adds run, two ways (docs/performance.md, seventh pass):
//  1. C independent chains in registers (latency x ports: how many accumulators a tile needs,
//     and the units' peak);
//  2. the loop of a 4 x 3 half tile (impl.h's tile_half shape): 4 rows of x and 3 of w, K
//     floats each, k += 16, in L1, the chains restarted each pass over K (no horizontal sums).
// Build and run (one core; run two at once for both cores busy):
//   g++ -O2 -mavx2 -mfma -o /tmp/fma_chains scripts/fma_chains.cpp && /tmp/fma_chains
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

static double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
static void sink(__m256 v) {
  float q[8];
  _mm256_storeu_ps(q, v);
  if (q[0] == 42.0f) std::puts("");
}

template <int C> double chains() {
  __m256 b[C];
  for (int i = 0; i < C; ++i) b[i] = _mm256_set1_ps(i * 0.001f);
  __m256 m = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(0.0001f);
  const long n = 100000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) {
    __asm__ volatile("" : "+x"(m), "+x"(c));  // nothing hoisted or folded across iterations
#pragma GCC unroll 16
    for (int j = 0; j < C; ++j) b[j] = _mm256_fmadd_ps(b[j], m, c);
  }
  const double s = seconds_since(t0);
  __m256 all = b[0];
  for (int j = 1; j < C; ++j) all = _mm256_add_ps(all, b[j]);  // every chain's result used
  sink(all);
  return n * C * 16.0 / s / 1e9;
}

double tile_loop(int64_t K) {
  float* x = static_cast<float*>(std::aligned_alloc(64, 4 * K * 4));
  float* w = static_cast<float*>(std::aligned_alloc(64, 3 * K * 4));
  for (int64_t i = 0; i < 4 * K; ++i) x[i] = 1e-3f;
  for (int64_t i = 0; i < 3 * K; ++i) w[i] = 1e-3f;
  const long reps = 2000000 * 576 / K;
  __m256 keep = _mm256_setzero_ps(), acc[4][3];
  for (auto& r : acc)
    for (auto& a : r) a = _mm256_setzero_ps();
  const auto t0 = std::chrono::steady_clock::now();
  for (long r = 0; r < reps; ++r) {
    for (auto& row : acc)
      for (auto& a : row) keep = _mm256_add_ps(keep, a), a = _mm256_setzero_ps();
    for (int64_t k = 0; k + 16 <= K; k += 16) {
      __m256 wv[3];
#pragma GCC unroll 4
      for (int j = 0; j < 3; ++j) wv[j] = _mm256_load_ps(w + j * K + k);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256 xv = _mm256_load_ps(x + i * K + k);
#pragma GCC unroll 4
        for (int j = 0; j < 3; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
  }
  const double s = seconds_since(t0);
  sink(keep);
  std::free(x);
  std::free(w);
  return reps * (K / 16) * 12 * 16.0 / s / 1e9;
}

int main() {
  std::printf("chains in registers, GFLOP/s: 4: %.0f, 8: %.0f, 12: %.0f, 14: %.0f\n", chains<4>(),
              chains<8>(), chains<12>(), chains<14>());
  std::printf("a 4 x 3 half tile's loop, K = 576: %.0f GFLOP/s\n", tile_loop(576));
}
