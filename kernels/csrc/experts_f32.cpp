// A mixture-of-experts layer's experts in float32 on x86 CPUs with AVX2 and FMA, for steps of
// few rows per expert (decode): each expert's rows times its gate/up weight, SiLU(gate) * up,
// times its down weight, one expert a task, the experts spread over the threads.
//
// A grouped product splits each expert's small product over every thread, which then meet at a
// barrier per expert (64 experts: 128 a layer); here a thread runs whole experts alone, and the
// activation happens while the expert's rows are still in its cache.
//
// Weights are stored transposed (k-major: [K, N]) so that a tile of 4 rows x 16 columns is 8
// accumulators fed by two loads of B and four broadcasts of A per k. Sums are float32, in k
// order; SiLU's e^x is `exp8` (within ~1e-7 of torch's).
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "simd_avx2.h"

namespace {

using conveyor::exp8;

// c[m, n] = sum_k a[m, k] * b[k, n] for m < rows; a rows `lda` apart, b [k_dim, n_dim], c rows
// `ldc` apart; n_dim a multiple of 16.
void product(const float* a, int64_t lda, const float* b, float* c, int64_t ldc, int64_t rows,
             int64_t k_dim, int64_t n_dim) {
  for (int64_t n = 0; n < n_dim; n += 16) {  // a column tile of b stays in cache for every row
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4) {
      __m256 acc[4][2];
      for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int64_t k = 0; k < k_dim; ++k) {
        const __m256 b0 = _mm256_loadu_ps(b + k * n_dim + n);
        const __m256 b1 = _mm256_loadu_ps(b + k * n_dim + n + 8);
        for (int r = 0; r < 4; ++r) {
          const __m256 x = _mm256_broadcast_ss(a + (m + r) * lda + k);
          acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
        }
      }
      for (int r = 0; r < 4; ++r) {
        _mm256_storeu_ps(c + (m + r) * ldc + n, acc[r][0]);
        _mm256_storeu_ps(c + (m + r) * ldc + n + 8, acc[r][1]);
      }
    }
    for (; m < rows; ++m) {
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
      for (int64_t k = 0; k < k_dim; ++k) {
        const __m256 x = _mm256_broadcast_ss(a + m * lda + k);
        acc0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + k * n_dim + n), acc0);
        acc1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + k * n_dim + n + 8), acc1);
      }
      _mm256_storeu_ps(c + m * ldc + n, acc0);
      _mm256_storeu_ps(c + m * ldc + n + 8, acc1);
    }
  }
}

// in place over each row's first `inter` columns: silu(gate) * up, up the next `inter`
void silu_mul(float* h, int64_t rows, int64_t inter) {
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t m = 0; m < rows; ++m) {
    float* g = h + m * 2 * inter;
    for (int64_t c = 0; c < inter; c += 8) {
      const __m256 x = _mm256_loadu_ps(g + c);
      const __m256 e = exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.f)));
      const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
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
