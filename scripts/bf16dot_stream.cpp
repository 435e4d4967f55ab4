// The avx512bf16 unit's tiles (csrc/impl_bf16dot.h) on weights that stream from memory, outside
// the library: what 8 rows of x cost against 1 at a given K, and which of the tile's reads
// costs it (docs/performance.md, "The Zen 4 machine, fifth pass").
//
// ~2.4 GB of bf16 matrices N x K (more than any cache), each multiplied in turn by two threads
// (each half of N), medians of 7 passes, the variants taking turns:
//   1 row : 1 x 4 tiles prefetching 16 weight rows ahead into L2 (the library's one-row tiles)
//   8 rows: 8 x 3 tiles prefetching 6 weight rows ahead into L2 (the library's 8-row tiles)
//   8 rows, x n rows: the same tiles, the same weight bytes and instructions, but rows 0-7
//           of x read from rows r % n (n lines of x a k-step instead of 8)
//   8 rows, x padded: x's rows 64 bytes apart from a multiple of 4 KB (no L1 set aliasing)
//   8 rows, chunks of KC inputs: blocks of 12 weight rows meet x in chunks of KC inputs, the
//           accumulators kept in memory between chunks (x's chunk stays in L1), the next block
//           prefetched
//   8 rows, 2 groups of 4: 4 x 6 tiles, blocks of ~96 KB of weight rows that both groups meet
//           (the second from L2), the next block prefetched evenly over both (3 lines a
//           k-step): the library's scheme where 8 rows of x pass 32 KB (impl_bf16dot.h)
// The products' results are not used; only their time is.
// Build and run (AVX512-BF16 CPUs):
//   g++ -O3 -mavx512f -mavx512bw -mavx512bf16 -pthread -o /tmp/bf16dot_stream scripts/bf16dot_stream.cpp
//   /tmp/bf16dot_stream 504 8192; /tmp/bf16dot_stream 2064 2048; /tmp/bf16dot_stream 8208 512
// (N a multiple of 24, K of 32; HOT=1 reads one matrix again and again instead)
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

struct X {  // where a tile reads row r of x: row r % rows, rows `stride` elements apart
  const uint16_t* p;
  int64_t stride;
  int rows;
};

template <int R, int C>
__attribute__((noinline)) void tile(X x, const uint16_t* w, int64_t K, int64_t kb0, int64_t kb1,
                                    __m512* acc_mem, bool first, int64_t ahead, float* sink,
                                    const char** cur = nullptr, const char* cap = nullptr) {
  __m512 acc[R * C];
#pragma GCC unroll 64
  for (int i = 0; i < R * C; ++i) acc[i] = first ? _mm512_setzero_ps() : acc_mem[i];
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    __m512i wv[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + c * K + 32 * kb);
    if (ahead)
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(w + (c + ahead) * K + 32 * kb), _MM_HINT_T1);
    if (cur)  // a cursor: C / 2 lines a k-step (two groups share a block's lines)
      for (int p = 0; p < C / 2 && *cur < cap; ++p, *cur += 64) _mm_prefetch(*cur, _MM_HINT_T1);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_load_si512(x.p + (r % x.rows) * x.stride + 32 * kb);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], xv, (__m512bh)wv[c]);
    }
  }
  if (acc_mem)
#pragma GCC unroll 64
    for (int i = 0; i < R * C; ++i) acc_mem[i] = acc[i];
  else
#pragma GCC unroll 64
    for (int i = 0; i < R * C; ++i) sink[i % 8] += _mm512_reduce_add_ps(acc[i]);
}

// rows [n0, n1) of w: whole rows per tile, or blocks of NB rows in chunks of kc inputs
template <int R, int C>
void part(X x, const uint16_t* w, int64_t n0, int64_t n1, int64_t K, int64_t ahead, int64_t kc) {
  float sink[8] = {0};
  const int64_t KF = K / 32;
  if (kc == 0) {
    for (int64_t n = n0; n + C <= n1; n += C)
      tile<R, C>(x, w + n * K, K, 0, KF, nullptr, true, n + ahead + C <= n1 ? ahead : 0, sink);
  } else {
    constexpr int64_t NB = 12;
    alignas(64) __m512 acc[NB / C * R * C];
    for (int64_t nb = n0; nb + NB <= n1; nb += NB) {
      for (int64_t kb0 = 0; kb0 < KF; kb0 += kc / 32)
        for (int64_t t = 0; t < NB / C; ++t)
          tile<R, C>(x, w + (nb + t * C) * K, K, kb0, std::min(KF, kb0 + kc / 32),
                     acc + t * R * C, kb0 == 0, nb + 2 * NB <= n1 ? NB : 0, sink);
      for (int i = 0; i < NB / C * R * C; ++i) sink[i % 8] += _mm512_reduce_add_ps(acc[i]);
    }
  }
  if (sink[0] == 42.0f) std::puts("");
}

// blocks of about 96 KB of weight rows [n0, n1) met by rows 0-3 and 4-7 of x in turn
void part_groups(X x, const uint16_t* w, int64_t n0, int64_t n1, int64_t K) {
  float sink[8] = {0};
  int64_t nb = (96 << 10) / (K * 2) / 6 * 6;
  if (nb < 6) nb = 6;
  while ((n1 - n0) % nb) nb -= 6;
  const char* cur = reinterpret_cast<const char*>(w + (n0 + nb) * K);
  const char* end = reinterpret_cast<const char*>(w + n1 * K);
  for (int64_t b = n0; b < n1; b += nb)
    for (int g = 0; g < 2; ++g) {
      const X xg{x.p + 4 * g * x.stride, x.stride, x.rows};
      for (int64_t n = b; n < b + nb; n += 6)
        tile<4, 6>(xg, w + n * K, K, 0, K / 32, nullptr, true, 0, sink, &cur, end);
    }
  if (sink[0] == 42.0f) std::puts("");
}

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s N K\n", argv[0]);
    return 2;
  }
  const int64_t N = std::atol(argv[1]), K = std::atol(argv[2]);
  if (N % 24 || K % 32) {
    std::fprintf(stderr, "N must be a multiple of 24 and K of 32\n");
    return 2;
  }
  // HOT=1: one matrix, read again and again (the weights from the caches where they fit)
  const bool hot = std::getenv("HOT") != nullptr;
  const int64_t count = hot ? 1 : 2400000000LL / (N * K * 2);
  const int reps = hot ? static_cast<int>(2400000000LL / (N * K * 2)) : 1;
  std::vector<uint16_t*> mats;
  for (int64_t i = 0; i < count; ++i) {
    auto* p = static_cast<uint16_t*>(std::aligned_alloc(64, N * K * 2));
    for (int64_t j = 0; j < N * K; ++j) p[j] = 0x3c00 + (j & 0x7f);
    mats.push_back(p);
  }
  const int64_t padded = K + 32;
  auto* xbuf = static_cast<uint16_t*>(std::aligned_alloc(64, 8 * padded * 2));
  for (int64_t i = 0; i < 8 * padded; ++i) xbuf[i] = 0x3c00 + (i & 0x3f);
  std::printf("%ld matrices of %ld x %ld bf16 (%.0f MB) x %d, 2 threads\n", count, N, K,
              count * N * K * 2 / 1e6, reps);
  struct Variant {
    const char* name;
    int rows;
    X x;
    int64_t kc;
    bool groups = false;  // part_groups
  };
  const std::vector<Variant> variants = {
      {"1 row", 1, {xbuf, K, 1}, 0},
      {"8 rows", 8, {xbuf, K, 8}, 0},
      {"8 rows, x 4 rows", 8, {xbuf, K, 4}, 0},
      {"8 rows, x 1 row", 8, {xbuf, K, 1}, 0},
      {"8 rows, x padded", 8, {xbuf, padded, 8}, 0},
      {"8 rows, x padded, chunks of 512", 8, {xbuf, padded, 8}, 512},
      {"8 rows, x padded, chunks of 1024", 8, {xbuf, padded, 8}, 1024},
      {"8 rows, 2 groups of 4", 8, {xbuf, padded, 8}, 0, true},
  };
  std::vector<std::vector<double>> times(variants.size());
  for (int pass = 0; pass < 7; ++pass)
    for (size_t v = 0; v < variants.size(); ++v) {
      const Variant& var = variants[v];
      const auto t0 = std::chrono::steady_clock::now();
      auto job = [&](int t) {  // each thread its half of every matrix, no barrier between
        const int64_t n0 = N / 2 * t, n1 = t ? N : N / 2;
        for (int rep = 0; rep < reps; ++rep)
          for (const uint16_t* w : mats) {
            if (var.groups) part_groups(var.x, w, n0, n1, K);
            else if (var.rows == 1) part<1, 4>(var.x, w, n0, n1, K, 16, 0);
            else part<8, 3>(var.x, w, n0, n1, K, 6, var.kc);
          }
      };
      std::thread other(job, 1);
      job(0);
      other.join();
      times[v].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  double one = 0;
  for (size_t v = 0; v < variants.size(); ++v) {
    std::sort(times[v].begin(), times[v].end());
    const double t = times[v][3];
    if (v == 0) one = t;
    std::printf("%-34s %7.1f ms  %5.1f GB/s  %.2f x one row\n", variants[v].name, t * 1e3,
                count * reps * N * K * 2 / t / 1e9, t / one);
  }
}
