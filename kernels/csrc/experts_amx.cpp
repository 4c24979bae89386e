// A mixture-of-experts layer's experts in bfloat16 on x86 CPUs with AMX: csrc/experts_bf16.cpp's
// work (each expert's rows times its gate/up weight, SiLU(gate) * up, times its down weight, one
// expert a task, inside moe_routing.h's routing and combining) with the products on the tile
// unit, which takes 16 rows x 32 k x 16 columns in one instruction: on a 2-core CPU, ~4x the
// AVX512-BF16 dot products' rate at 4,096 tokens.
//
// The weights are in the same strips of k pairs ([N / 32, K / 2, 32, 2]), which hold the tile
// unit's B operand as it is: a B tile is 16 pairs of k x 16 columns, rows 128 bytes apart, and
// a block's k steps read its strip front to back (a decode step reads every expert's weights
// once; with B tiles' rows N * 4 bytes apart it took 15% longer). An expert's rows come in a
// buffer of whole tiles (16 rows, the rest zero), so every tile is full. Each block of 32 rows x
// 32 columns sums its k in steps of 32 into four float32 tiles; the rows' results do not depend
// on the other rows of the step. Results are rounded to bfloat16 where transformers' grouped
// products and eager activation round them, as in experts_bf16.cpp.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "amx.h"
#include "moe_bf16.h"
#include "simd_bf16.h"

namespace {

using conveyor::kTileRows;
using conveyor::store16;

// A tile load that misses the cache holds up the products after it; a decode step reads every
// expert's weights once from memory, so each k step asks for the strip's bytes two k steps on
// (4 KB) to be fetched meanwhile: a layer at 16 tokens in 1.46 ms instead of 1.70.
inline void prefetch_ahead(const uint16_t* b) {
  const char* ahead = reinterpret_cast<const char*>(b) + 4096;
  for (int i = 0; i < 2048; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
}

// tiles 0-3: the float32 sums of a 32 x 32 block; 4, 5: two tiles of 16 rows of a; 6, 7: two of
// b, 16 columns each (amx.h's configuration)
//
// c[m, n] = round(sum_k a[m, k] * b[k, n]) for m < rows and n in [n0, n1); a [padded, k_dim]
// rows `lda` apart with `padded` a multiple of 16 (rows past `rows` read, their sums dropped);
// b in strips of k pairs [n / 32, k_dim / 2, 32, 2]; c rows `ldc` apart; k_dim, n0 and n1
// multiples of 32.
void product(const uint16_t* a, int64_t lda, const uint16_t* b, uint16_t* c, int64_t ldc,
             int64_t rows, int64_t padded, int64_t k_dim, int64_t n0, int64_t n1) {
  alignas(64) float sums[2 * kTileRows][32];
  for (int64_t m = 0; m < padded; m += 2 * kTileRows) {
    const bool two = m + kTileRows < padded;
    for (int64_t n = n0; n < n1; n += 32) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < k_dim; k += 32) {
        prefetch_ahead(b + n * k_dim + k * 32);
        _tile_loadd(4, a + m * lda + k, lda * 2);
        _tile_loadd(6, b + n * k_dim + k * 32, 128);
        _tile_loadd(7, b + n * k_dim + k * 32 + 32, 128);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, a + (m + kTileRows) * lda + k, lda * 2);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, &sums[0][0], sizeof sums[0]);
      _tile_stored(1, &sums[0][16], sizeof sums[0]);
      if (two) {
        _tile_stored(2, &sums[kTileRows][0], sizeof sums[0]);
        _tile_stored(3, &sums[kTileRows][16], sizeof sums[0]);
      }
      const int64_t end = std::min(rows, m + (two ? 2 : 1) * kTileRows);
      for (int64_t r = m; r < end; ++r) {
        store16(c + r * ldc + n, _mm512_load_ps(&sums[r - m][0]));
        store16(c + r * ldc + n + 16, _mm512_load_ps(&sums[r - m][16]));
      }
    }
  }
}

// moe_routing.h's Kernel
struct Tiles : conveyor::Bf16Elementwise {
  void begin() { conveyor::configure_tiles(); }
  void end() { _tile_release(); }
  void product(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t /*n_dim*/, uint16_t* c,
               int64_t ldc, int64_t rows, int64_t padded, int64_t k_dim, int64_t n0,
               int64_t n1) {
    ::product(a, lda, b, c, ldc, rows, padded, k_dim, n0, n1);
  }
};

}  // namespace

extern "C" {

// Whether this process may use the tile registers (it asks Linux for them once: 1 if granted).
int conveyor_amx_ready() { return conveyor::amx_permitted() ? 1 : 0; }

// moe_routing.h's routed_experts on the tile unit; hidden and inter multiples of 32.
void conveyor_moe_amx(const uint16_t* x, const int64_t* top_index, const void* weights,
                      int weights_f32, const uint16_t* gate_up, const uint16_t* down,
                      uint16_t* outs, uint16_t* result, int64_t tokens, int64_t k,
                      int64_t experts, int64_t hidden, int64_t inter, int threads) {
  conveyor::routed_experts<Tiles>(x, top_index, weights, weights_f32 != 0, gate_up, down,
                                  outs, result, tokens, k, experts, hidden, inter, threads);
}
}
