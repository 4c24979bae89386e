// A mixture-of-experts layer's experts in float32 on x86 CPUs with AVX2 and FMA: each expert's
// rows times its gate/up weight, SiLU(gate) * up, times its down weight, one expert a task, the
// experts spread over the threads, inside moe_routing.h's routing and combining of the layer.
//
// A grouped product splits each expert's small product over every thread, which then meet at a
// barrier per expert (64 experts: 128 a layer); here a thread runs whole experts alone, and the
// activation happens while the expert's rows are still in its cache.
//
// Weights are stored in strips of 16 columns, k-major within a strip ([N / 16, K, 16] an
// expert): a tile of rows x 16 columns is accumulated from two loads of B and a
// broadcast of A per row and k, and walks its strip front to back, 64 bytes a k, as the
// hardware prefetcher likes (k-major rows of the whole width put a k's 64 bytes a row apart:
// 2.1-2.3x the time at 16-128 tokens, 1.1x at 4,096). Sums are float32, in k order whatever the
// row's tile, so a row's result never depends on the step's other rows; SiLU's e^x is `exp8`
// (within ~1e-7 of torch's).
#include <immintrin.h>

#include <cstdint>

#include "moe_routing.h"
#include "simd_avx2.h"

namespace {

using conveyor::silu8;

constexpr int64_t kBlockRows = 48;  // rows whose a a core keeps in cache (96 KB at k 512)
constexpr int64_t kAhead = 2048;  // floats of b a first pass over a strip asks for ahead (8 KB)

// c[r, n:n+16] = sum_k a[r, k] * strip[k, 0:16] for R rows r: 2R accumulators fed by two
// vectors of the strip and a broadcast of a per row and k (unrolled, so the accumulators stay in
// registers). kFetch: asks for the strip 8 KB ahead; `next` (if any): asks for its k-th line.
template <int R, bool kFetch>
__attribute__((always_inline)) inline void tile(const float* a, int64_t lda, const float* strip,
                                                float* c, int64_t ldc, int64_t k_dim, int64_t n,
                                                const float* next) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    if (kFetch) _mm_prefetch(reinterpret_cast<const char*>(strip + k * 16 + kAhead), _MM_HINT_T1);
    if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + k * 16), _MM_HINT_T1);
    const __m256 b0 = _mm256_loadu_ps(strip + k * 16);
    const __m256 b1 = _mm256_loadu_ps(strip + k * 16 + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * ldc + n, acc[r][0]);
    _mm256_storeu_ps(c + r * ldc + n + 8, acc[r][1]);
  }
}

// rows [m, end) of the strip's 16 columns, in tiles of 6, 4, 2 and 1. With kFetch the first
// tile, which reads the strip from memory, asks for it ahead, and the second, which reads it
// from cache, asks for `next` (the next strip, or none), a line a k, into L2.
template <bool kFetch>
void strip_rows(const float* a, int64_t lda, const float* strip, float* c, int64_t ldc, int64_t m,
                int64_t end, int64_t k_dim, int64_t n, const float* next) {
  if (m >= end) return;
  const float* ask = kFetch ? nullptr : next;
  const float* am = a + m * lda;
  float* cm = c + m * ldc;
  const int64_t r = end - m >= 6 ? 6 : end - m >= 4 ? 4 : end - m >= 2 ? 2 : 1;
  if (r == 6) {
    tile<6, kFetch>(am, lda, strip, cm, ldc, k_dim, n, ask);
  } else if (r == 4) {
    tile<4, kFetch>(am, lda, strip, cm, ldc, k_dim, n, ask);
  } else if (r == 2) {
    tile<2, kFetch>(am, lda, strip, cm, ldc, k_dim, n, ask);
  } else {
    tile<1, kFetch>(am, lda, strip, cm, ldc, k_dim, n, ask);
  }
  strip_rows<false>(a, lda, strip, c, ldc, m + r, end, k_dim, n, kFetch ? next : nullptr);
}

// c[m, n] = sum_k a[m, k] * b[k, n] for m < rows and n in [n0, n1); a rows `lda` apart, b in
// strips of 16 columns ([N / 16, k_dim, 16]), c rows `ldc` apart; n0 and n1 multiples of 16.
// In blocks of rows whose a stays in the core's cache while every strip of b passes over it;
// rows in tiles of 6 (12 accumulators: the most that leave registers for b and a broadcast),
// the rest in tiles of 4, 2 and 1. With rows for one block only (decode steps), the first pass
// over each strip asks for the weights 8 KB ahead into L2, and the second for the next strip.
void product(const float* a, int64_t lda, const float* b, float* c, int64_t ldc, int64_t rows,
             int64_t k_dim, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < rows; m0 += kBlockRows) {
    const int64_t end = rows - m0 < kBlockRows ? rows : m0 + kBlockRows;
    for (int64_t n = n0; n < n1; n += 16) {
      const float* strip = b + n * k_dim;  // strip n / 16
      if (rows <= kBlockRows) {  // few rows: the strips' reads from memory are what is slow
        const float* next = n + 16 < n1 ? strip + 16 * k_dim : nullptr;
        strip_rows<true>(a, lda, strip, c, ldc, m0, end, k_dim, n, next);
      } else {
        strip_rows<false>(a, lda, strip, c, ldc, m0, end, k_dim, n, nullptr);
      }
    }
  }
}

// moe_routing.h's Kernel: the rows past `rows` are not computed; weights in strips of 16 columns
struct Avx2 {
  using Element = float;
  static constexpr int64_t kColumns = 16;

  void begin() {}
  void end() {}
  void product(const float* a, int64_t lda, const float* b, int64_t /*n_dim*/, float* c,
               int64_t ldc, int64_t rows, int64_t /*padded*/, int64_t k_dim, int64_t n0,
               int64_t n1) {
    ::product(a, lda, b, c, ldc, rows, k_dim, n0, n1);
  }
  void silu_mul(float* h, int64_t rows, int64_t inter, int64_t c0, int64_t c1) {
    for (int64_t m = 0; m < rows; ++m) {
      float* g = h + m * 2 * inter;
      for (int64_t c = c0; c < c1; c += 8)
        _mm256_storeu_ps(g + c, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + c)),
                                              _mm256_loadu_ps(g + inter + c)));
    }
  }
  // each pair's output times its weight, summed in k order, as torch's float32 sum over k
  static void combine(const float* outs, const int64_t* place, const void* weights,
                      bool /*weights_f32: always*/, int64_t first, int64_t k, int64_t hidden,
                      float* out) {
    const auto* w = static_cast<const float*>(weights);
    for (int64_t c = 0; c < hidden; c += 8) {
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < k; ++j) {
        const __m256 v = _mm256_loadu_ps(outs + place[first + j] * hidden + c);
        sum = _mm256_add_ps(sum, _mm256_mul_ps(v, _mm256_set1_ps(w[first + j])));
      }
      _mm256_storeu_ps(out + c, sum);
    }
  }
};

}  // namespace

extern "C" {

// moe_routing.h's routed_experts on this file's kernel (weights float32); gate_up
// [E, 2 * inter / 16, hidden, 16] and down [E, hidden / 16, inter, 16] (strips); hidden and inter
// multiples of 16.
void conveyor_moe_f32(const float* x, const int64_t* top_index, const float* weights,
                      const float* gate_up, const float* down, float* outs, float* result,
                      int64_t tokens, int64_t k, int64_t experts, int64_t hidden, int64_t inter,
                      int threads) {
  conveyor::routed_experts<Avx2>(x, top_index, weights, true, gate_up, down, outs, result,
                                 tokens, k, experts, hidden, inter, threads);
}
}
