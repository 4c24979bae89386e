// A mixture-of-experts layer's experts in float32 on x86 CPUs with AVX2 and FMA, for steps of
// up to a few hundred rows per expert: each expert's rows times its gate/up weight, SiLU(gate) * up,
// times its down weight, one expert a task, the experts spread over the threads.
//
// A grouped product splits each expert's small product over every thread, which then meet at a
// barrier per expert (64 experts: 128 a layer); here a thread runs whole experts alone, and the
// activation happens while the expert's rows are still in its cache.
//
// Weights are stored transposed (k-major: [K, N]), so that a tile of rows x 16 columns is
// accumulated from two loads of B and a broadcast of A per row and k. Sums are float32, in k
// order; SiLU's e^x is `exp8` (within ~1e-7 of torch's).
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "simd_avx2.h"

namespace {

using conveyor::silu8;

constexpr int64_t kBlockRows = 48;  // rows whose a a core keeps in cache (96 KB at k 512)

// c[r, n:n+16] = sum_k a[r, k] * b[k, n:n+16] for R rows r: 2R accumulators fed by two vectors
// of b and a broadcast of a per row and k (unrolled, so the accumulators stay in registers).
template <int R>
__attribute__((always_inline)) inline void tile(const float* a, int64_t lda, const float* b,
                                                float* c, int64_t ldc, int64_t k_dim,
                                                int64_t n_dim, int64_t n) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * n_dim + n);
    const __m256 b1 = _mm256_loadu_ps(b + k * n_dim + n + 8);
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

// c[m, n] = sum_k a[m, k] * b[k, n] for m < rows; a rows `lda` apart, b [k_dim, n_dim], c rows
// `ldc` apart; n_dim a multiple of 16. In blocks of rows whose a stays in the core's cache
// while every column tile of b passes over it; rows in tiles of 6 (12 accumulators: the most
// that leave registers for b and a broadcast), the rest in tiles of 4, 2 and 1. A row's sum is
// in k order whatever its tile.
void product(const float* a, int64_t lda, const float* b, float* c, int64_t ldc, int64_t rows,
             int64_t k_dim, int64_t n_dim) {
  for (int64_t m0 = 0; m0 < rows; m0 += kBlockRows) {
    const int64_t end = rows - m0 < kBlockRows ? rows : m0 + kBlockRows;
    for (int64_t n = 0; n < n_dim; n += 16) {
      int64_t m = m0;
      for (; m + 6 <= end; m += 6) tile<6>(a + m * lda, lda, b, c + m * ldc, ldc, k_dim, n_dim, n);
      if (m + 4 <= end) {
        tile<4>(a + m * lda, lda, b, c + m * ldc, ldc, k_dim, n_dim, n);
        m += 4;
      }
      if (m + 2 <= end) {
        tile<2>(a + m * lda, lda, b, c + m * ldc, ldc, k_dim, n_dim, n);
        m += 2;
      }
      if (m < end) tile<1>(a + m * lda, lda, b, c + m * ldc, ldc, k_dim, n_dim, n);
    }
  }
}

// in place over each row's first `inter` columns: silu(gate) * up, up the next `inter`
void silu_mul(float* h, int64_t rows, int64_t inter) {
  for (int64_t m = 0; m < rows; ++m) {
    float* g = h + m * 2 * inter;
    for (int64_t c = 0; c < inter; c += 8) {
      const __m256 silu = silu8(_mm256_loadu_ps(g + c));
      _mm256_storeu_ps(g + c, _mm256_mul_ps(silu, _mm256_loadu_ps(g + inter + c)));
    }
  }
}

}  // namespace

extern "C" {

// rows [R, hidden], grouped by expert (counts[e] rows each, in expert order); gate_up_t
// [E, hidden, 2 * inter] (each expert's gate columns, then its up columns); down_t
// [E, inter, hidden]; scratch [R, 2 * inter]; out [R, hidden]. hidden a multiple of 16, inter
// of 8.
void conveyor_experts_f32(const float* rows, const int64_t* counts, const float* gate_up_t,
                          const float* down_t, float* scratch, float* out, int64_t experts,
                          int64_t hidden, int64_t inter, int threads) {
  std::vector<int64_t> starts(experts);
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    starts[e] = start;
    start += counts[e];
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = counts[e];
    if (n == 0) continue;
    const int64_t first = starts[e];
    float* h = scratch + first * 2 * inter;
    product(rows + first * hidden, hidden, gate_up_t + e * hidden * 2 * inter, h, 2 * inter, n,
            hidden, 2 * inter);
    silu_mul(h, n, inter);
    product(h, 2 * inter, down_t + e * inter * hidden, out + first * hidden, hidden, n, inter,
            hidden);
  }
}
}
