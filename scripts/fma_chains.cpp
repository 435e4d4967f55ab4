// How fast this CPU's AVX2 multiply-adds run, three ways (docs/performance.md, seventh pass):
//  1. C independent chains in registers (latency x ports: how many accumulators a tile needs);
//  2. 12 chains fed by 7 loads an iteration from a fixed 2 KB ring in L1;
//  3. the loop of a 4 x 3 half tile (impl.h's tile_half shape): 4 rows of x and 3 of w, K
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
  const __m256 m = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(0.0001f);
  const long n = 100000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < C; ++j) b[j] = _mm256_fmadd_ps(b[j], m, c);
    __asm__ volatile("" ::"x"(b[0]));
  }
  const double s = seconds_since(t0);
  sink(b[C - 1]);
  return n * C * 16.0 / s / 1e9;
}

alignas(64) static float ring[4096];
double ring_loads() {  // 12 chains, 7 loads an iteration
  constexpr int C = 12, L = 7;
  __m256 b[C];
  for (int i = 0; i < C; ++i) b[i] = _mm256_set1_ps(i * 0.001f);
  const __m256 m = _mm256_set1_ps(0.9999f);
  const long n = 50000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) {
    __m256 ld[L];
#pragma GCC unroll 16
    for (int l = 0; l < L; ++l) ld[l] = _mm256_load_ps(ring + 8 * l + (i & 63) * 8);
#pragma GCC unroll 16
    for (int j = 0; j < C; ++j) b[j] = _mm256_fmadd_ps(ld[j % L], m, b[j]);
  }
  const double s = seconds_since(t0);
  sink(b[C - 1]);
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
  for (float& f : ring) f = 1e-6f;
  std::printf("12 chains, 7 loads an iteration from a 2 KB ring: %.0f GFLOP/s\n", ring_loads());
  std::printf("a 4 x 3 half tile's loop, K = 576: %.0f GFLOP/s\n", tile_loop(576));
}
