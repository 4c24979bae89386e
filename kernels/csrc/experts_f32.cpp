// A mixture-of-experts layer's experts in float32 on x86 CPUs with AVX2 and FMA, or built with
// CONVEYOR_AVX512 defined on AVX-512's 16 lanes (simd_f32.h): each expert's rows times its
// gate/up weight, SiLU(gate) * up, times its down weight, one expert a task, the experts spread
// over the threads, inside moe_routing.h's routing and combining of the layer. Each lane runs
// the same operations in either build, so the two give the same results bit for bit.
//
// A grouped product splits each expert's small product over every thread, which then meet at a
// barrier per expert (64 experts: 128 a layer); here a thread runs whole experts alone, and the
// activation happens while the expert's rows are still in its cache.
//
// Weights are stored in strips of 16 columns, k-major within a strip ([N / 16, K, 16] an
// expert): a tile of rows x 16 columns is accumulated from the strip's 16 floats (two AVX2
// vectors, one AVX-512 vector) and a broadcast of A per row and k, and walks its strip front to back, 64 bytes a k, as the
// hardware prefetcher likes (k-major rows of the whole width put a k's 64 bytes a row apart:
// 2.1-2.3x the time at 16-128 tokens, 1.1x at 4,096). Sums are float32, in k order whatever the
// row's tile, so a row's result never depends on the step's other rows; SiLU's e^x is `exp8`
// (within ~1e-7 of torch's).
//
// The weights may also be stored as bfloat16 where every value is a bfloat16 one (a checkpoint
// saved in bfloat16, as they ship, run in float32 on a CPU without bfloat16 products): each is
// widened to its float32 value as it is read, so the sums are the same bit for bit, and a step
// of few tokens, which is the weights' reads from memory, reads half the bytes.
#include <immintrin.h>

#include <cstdint>

#include "moe_routing.h"
#include "simd_f32.h"

namespace {

namespace v = conveyor::f32;
constexpr int64_t kVectors = 16 / v::kLanes;  // vectors to a strip's row
// rows of the largest tile: 12 accumulators, the most that leave registers for the strip and a
// broadcast with AVX2's 16 registers; AVX-512's 32 take 12 rows of one vector each
constexpr int kTopRows = 12 / kVectors;

constexpr int64_t kBlockRows = 48;  // rows whose a a core keeps in cache (96 KB at k 512)
constexpr int64_t kAhead = 8192;  // bytes of b a first pass over a strip asks for ahead

// c[r, n:n+16S] = sum_k a[r, k] * strips[k, 0:16S] for R rows r over S strips side by side (each
// k_dim * 16 weights after the last): R x S x kVectors accumulators fed by the strips' rows and
// a broadcast of a per row and k (unrolled, so the accumulators stay in registers). kFetch: asks
// for each strip 8 KB ahead; `next` (if any): asks for its k-th row. Stored, the weights' storage:
// float, or uint16_t for bfloat16 values, widened to the same float32 values as they are read.
template <int R, int S, bool kFetch, class Stored>
__attribute__((always_inline)) inline void tile(const float* a, int64_t lda, const Stored* strip,
                                                float* c, int64_t ldc, int64_t k_dim, int64_t n,
                                                const Stored* next) {
  constexpr int64_t W = S * kVectors;  // vectors to a row of the tile
  v::Vec acc[R][W];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < W; ++i) acc[r][i] = v::zero();
  for (int64_t k = 0; k < k_dim; ++k) {
    for (int s = 0; s < S; ++s) {
      const Stored* row = strip + s * k_dim * 16 + k * 16;
      if (kFetch) _mm_prefetch(reinterpret_cast<const char*>(row) + kAhead, _MM_HINT_T1);
      if (next != nullptr)
        _mm_prefetch(reinterpret_cast<const char*>(next + s * k_dim * 16 + k * 16), _MM_HINT_T1);
    }
    v::Vec b[W];
    for (int s = 0; s < S; ++s)
      for (int64_t i = 0; i < kVectors; ++i)
        b[s * kVectors + i] = v::load(strip + s * k_dim * 16 + k * 16 + i * v::kLanes);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const v::Vec x = v::broadcast(a + r * lda + k);
      for (int64_t i = 0; i < W; ++i) acc[r][i] = v::fmadd(x, b[i], acc[r][i]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s)
      for (int64_t i = 0; i < kVectors; ++i)
        v::store(c + r * ldc + n + s * 16 + i * v::kLanes, acc[r][s * kVectors + i]);
}

// rows [m, end) of S strips' 16 S columns, in tiles of kTopRows, 4, 2 and 1. With kFetch the
// first tile, which reads the strips from memory, asks for them ahead, and the second, which
// reads them from cache, asks for `next` (the strips after them, or none), a line a k, into L2.
template <int S, bool kFetch, class Stored>
void strip_rows(const float* a, int64_t lda, const Stored* strip, float* c, int64_t ldc, int64_t m,
                int64_t end, int64_t k_dim, int64_t n, const Stored* next) {
  if (m >= end) return;
  const Stored* ask = kFetch ? nullptr : next;
  const float* am = a + m * lda;
  float* cm = c + m * ldc;
  const int64_t r = end - m >= kTopRows ? kTopRows : end - m >= 4 ? 4 : end - m >= 2 ? 2 : 1;
  if (r == kTopRows) {
    tile<kTopRows, S, kFetch, Stored>(am, lda, strip, cm, ldc, k_dim, n, ask);
  } else if (r == 4) {
    tile<4, S, kFetch, Stored>(am, lda, strip, cm, ldc, k_dim, n, ask);
  } else if (r == 2) {
    tile<2, S, kFetch, Stored>(am, lda, strip, cm, ldc, k_dim, n, ask);
  } else {
    tile<1, S, kFetch, Stored>(am, lda, strip, cm, ldc, k_dim, n, ask);
  }
  const Stored* after = kFetch ? next : nullptr;
  strip_rows<S, false, Stored>(a, lda, strip, c, ldc, m + r, end, k_dim, n, after);
}

// S strips at n: with few rows (`fetch`), asking for them ahead and for the next ones
template <int S, class Stored>
void strips(const float* a, int64_t lda, const Stored* b, float* c, int64_t ldc, int64_t m0,
            int64_t end, int64_t k_dim, int64_t n, int64_t n1, bool fetch) {
  const Stored* strip = b + n * k_dim;  // strip n / 16
  if (fetch) {  // few rows: the strips' reads from memory are what is slow
    const Stored* next = n + 16 * S < n1 ? strip + 16 * S * k_dim : nullptr;
    strip_rows<S, true, Stored>(a, lda, strip, c, ldc, m0, end, k_dim, n, next);
  } else {
    strip_rows<S, false, Stored>(a, lda, strip, c, ldc, m0, end, k_dim, n, nullptr);
  }
}

// c[m, n] = sum_k a[m, k] * b[k, n] for m < rows and n in [n0, n1); a rows `lda` apart, b in
// strips of 16 columns ([N / 16, k_dim, 16]), c rows `ldc` apart; n0 and n1 multiples of 16.
// In blocks of rows whose a stays in the core's cache while every strip of b passes over it;
// rows in tiles of kTopRows, the rest in tiles of 4, 2 and 1, over one strip at a time with
// AVX2, two with AVX-512 (its registers hold 12 rows of 32 columns). With rows for one block
// only (decode steps), the first pass over each strip asks for the weights 8 KB ahead into L2,
// and the second for the next strip.
template <class Stored>
void product(const float* a, int64_t lda, const Stored* b, float* c, int64_t ldc, int64_t rows,
             int64_t k_dim, int64_t n0, int64_t n1) {
  constexpr int S = kVectors == 1 ? 2 : 1;
  for (int64_t m0 = 0; m0 < rows; m0 += kBlockRows) {
    const int64_t end = rows - m0 < kBlockRows ? rows : m0 + kBlockRows;
    const bool fetch = rows <= kBlockRows;
    int64_t n = n0;
    for (; n + 16 * S <= n1; n += 16 * S)
      strips<S, Stored>(a, lda, b, c, ldc, m0, end, k_dim, n, n1, fetch);
    if (n < n1) strips<1, Stored>(a, lda, b, c, ldc, m0, end, k_dim, n, n1, fetch);
  }
}

// moe_routing.h's Kernel: the rows past `rows` are not computed; weights in strips of 16
// columns, stored as Stored (float, or uint16_t: bfloat16 values, widened exactly)
template <class Stored>
struct Float32 {
  using Element = float;
  using Weight = Stored;
  static constexpr int64_t kColumns = 16;

  void begin() {}
  void end() {}
  void product(const float* a, int64_t lda, const Stored* b, int64_t /*n_dim*/, float* c,
               int64_t ldc, int64_t rows, int64_t /*padded*/, int64_t k_dim, int64_t n0,
               int64_t n1) {
    ::product<Stored>(a, lda, b, c, ldc, rows, k_dim, n0, n1);
  }
  void silu_mul(float* h, int64_t rows, int64_t inter, int64_t c0, int64_t c1) {
    for (int64_t m = 0; m < rows; ++m) {
      float* g = h + m * 2 * inter;
      int64_t c = c0;
      for (; c + v::kLanes <= c1; c += v::kLanes)
        v::store(g + c, v::mul(v::silu(v::load(g + c)), v::load(g + inter + c)));
#ifdef CONVEYOR_AVX512
      if (c < c1) {  // inter a multiple of 8, not 16: its last 8 columns
        const v::Vec x = v::mul(v::silu(v::load_first(g + c, c1 - c)),
                                v::load_first(g + inter + c, c1 - c));
        v::store_first(g + c, x, c1 - c);
      }
#endif
    }
  }
  // each pair's output times its weight, summed in k order, as torch's float32 sum over k
  static void combine(const float* outs, const int64_t* place, const void* weights,
                      bool /*weights_f32: always*/, int64_t first, int64_t k, int64_t hidden,
                      float* out) {
    const auto* w = static_cast<const float*>(weights);
    for (int64_t c = 0; c < hidden; c += v::kLanes) {
      v::Vec sum = v::zero();
      for (int64_t j = 0; j < k; ++j) {
        const v::Vec x = v::load(outs + place[first + j] * hidden + c);
        sum = v::add(sum, v::mul(x, v::set1(w[first + j])));
      }
      v::store(out + c, sum);
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
  conveyor::routed_experts<Float32<float>>(x, top_index, weights, true, gate_up, down, outs,
                                           result, tokens, k, experts, hidden, inter, threads);
}

// the same with the weights' values stored as bfloat16 (each value a bfloat16 one: a checkpoint
// saved in bfloat16 computing in float32), half the bytes to read; the same results bit for bit
void conveyor_moe_f32_bf16_weights(const float* x, const int64_t* top_index, const float* weights,
                                   const uint16_t* gate_up, const uint16_t* down, float* outs,
                                   float* result, int64_t tokens, int64_t k, int64_t experts,
                                   int64_t hidden, int64_t inter, int threads) {
  conveyor::routed_experts<Float32<uint16_t>>(x, top_index, weights, true, gate_up, down, outs,
                                              result, tokens, k, experts, hidden, inter, threads);
}
}
