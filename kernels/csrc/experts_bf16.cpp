// A mixture-of-experts layer's experts in bfloat16 on x86 CPUs with AVX512-BF16: each expert's
// rows times its gate/up weight, SiLU(gate) * up, times its down weight, one expert a task, the
// experts spread over the threads (as csrc/experts_f32.cpp, whose notes hold here too), inside
// moe_routing.h's routing and combining of the layer.
//
// Weights are stored in strips of 32 columns, each in k pairs ([N / 32, K / 2, 32, 2]: for each
// pair of k, each column's two weights side by side), the operand of the bfloat16 dot-product
// instruction: a tile of rows x 32 columns takes, per pair of k, two loads of B and a
// broadcast of the row's two values of A, and reads its strip of B front to back.
// Sums are float32, pair after pair in k order, so a row's result does not depend on the other
// rows of its step. Results are rounded to bfloat16 where transformers' grouped products and
// eager activation round them: each product's output, SiLU(gate), and its product with up.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "moe_bf16.h"
#include "simd_bf16.h"

namespace {

using conveyor::store16;

constexpr int64_t kAhead = 4096;  // elements of b a first pass over a strip asks for ahead (8 KB)
constexpr int64_t kBlockRows = 36;  // rows whose a a core keeps in cache (36 KB at k 512)

// c[r, n:n+32] = round(sum_k a[r, k] * b[k, n:n+32]) for R rows r: 2R accumulators fed by two
// vectors of b and a broadcast of a's pair per row and pair of k (unrolled, so the
// accumulators stay in registers).
template <int R, bool kFetch>
__attribute__((always_inline)) inline void tile(const uint16_t* a, int64_t lda,
                                                const uint16_t* b, uint16_t* c, int64_t ldc,
                                                int64_t k_dim, int64_t n) {
  __m512 acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; k += 2) {
    const uint16_t* bk = b + n * k_dim + k * 32;  // columns n.., pair k / 2
    if (kFetch) {
      _mm_prefetch(reinterpret_cast<const char*>(bk + kAhead), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(bk + kAhead + 32), _MM_HINT_T1);
    }
    const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bk));
    const __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bk + 32));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + k, sizeof pair);
      const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    store16(c + r * ldc + n, acc[r][0]);
    store16(c + r * ldc + n + 16, acc[r][1]);
  }
}

// rows [m, end) of the 32 columns at n, in tiles of 12, 8, 4, 2 and 1
template <bool kFetch>
void strip_rows(const uint16_t* a, int64_t lda, const uint16_t* b, uint16_t* c, int64_t ldc,
                int64_t m, int64_t end, int64_t k_dim, int64_t n) {
  if (m + 12 <= end) {  // the first tile reads the strip from memory, the rest from cache
    tile<12, kFetch>(a + m * lda, lda, b, c + m * ldc, ldc, k_dim, n);
    for (m += 12; m + 12 <= end; m += 12)
      tile<12, false>(a + m * lda, lda, b, c + m * ldc, ldc, k_dim, n);
    strip_rows<false>(a, lda, b, c, ldc, m, end, k_dim, n);
  } else if (m + 8 <= end) {
    tile<8, kFetch>(a + m * lda, lda, b, c + m * ldc, ldc, k_dim, n);
    strip_rows<false>(a, lda, b, c, ldc, m + 8, end, k_dim, n);
  } else if (m + 4 <= end) {
    tile<4, kFetch>(a + m * lda, lda, b, c + m * ldc, ldc, k_dim, n);
    strip_rows<false>(a, lda, b, c, ldc, m + 4, end, k_dim, n);
  } else if (m + 2 <= end) {
    tile<2, kFetch>(a + m * lda, lda, b, c + m * ldc, ldc, k_dim, n);
    strip_rows<false>(a, lda, b, c, ldc, m + 2, end, k_dim, n);
  } else if (m < end) {
    tile<1, kFetch>(a + m * lda, lda, b, c + m * ldc, ldc, k_dim, n);
  }
}

// c[m, n] = round(sum_k a[m, k] * b[k, n]) for m < rows and n in [n0, n1); a rows `lda` apart,
// b in strips of k pairs [n / 32, k_dim / 2, 32, 2], c rows `ldc` apart; n0, n1 multiples of
// 32, k_dim even. In blocks of rows whose a stays in the core's cache while every column tile
// of b passes over it; rows in tiles of 12 (24 accumulators of the 32 registers), the rest in
// tiles of 8, 4, 2 and 1. With rows for one block only (decode steps: at 128 tokens ~16 rows an
// expert), the first pass over each strip asks for the weights 8 KB ahead into L2: a layer
// took 1.2-1.35x the time without. With more, the products keep the core busy while the
// CPU's own prefetcher follows the strips.
void product(const uint16_t* a, int64_t lda, const uint16_t* b, uint16_t* c, int64_t ldc,
             int64_t rows, int64_t k_dim, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < rows; m0 += kBlockRows) {
    const int64_t end = rows - m0 < kBlockRows ? rows : m0 + kBlockRows;
    for (int64_t n = n0; n < n1; n += 32) {
      if (rows <= kBlockRows) {  // few rows: the strips' reads from memory are what is slow
        strip_rows<true>(a, lda, b, c, ldc, m0, end, k_dim, n);
      } else {
        strip_rows<false>(a, lda, b, c, ldc, m0, end, k_dim, n);
      }
    }
  }
}

// moe_routing.h's Kernel: the rows past `rows` are not computed
struct DotProducts : conveyor::Bf16Elementwise {
  void begin() {}
  void end() {}
  void product(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t /*n_dim*/, uint16_t* c,
               int64_t ldc, int64_t rows, int64_t /*padded*/, int64_t k_dim, int64_t n0,
               int64_t n1) {
    ::product(a, lda, b, c, ldc, rows, k_dim, n0, n1);
  }
};

}  // namespace

extern "C" {

// moe_routing.h's routed_experts on this file's kernel; hidden and inter multiples of 32.
void conveyor_moe_bf16(const uint16_t* x, const int64_t* top_index, const void* weights,
                       int weights_f32, const uint16_t* gate_up, const uint16_t* down,
                       uint16_t* outs, uint16_t* result, int64_t tokens, int64_t k,
                       int64_t experts, int64_t hidden, int64_t inter, int threads) {
  conveyor::routed_experts<DotProducts>(x, top_index, weights, weights_f32 != 0, gate_up, down,
                                        outs, result, tokens, k, experts, hidden, inter,
                                        threads);
}
}
