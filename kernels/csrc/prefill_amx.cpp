// Prefill attention for bfloat16 on x86 CPUs with AMX: paged_attention_bf16.cpp's prefill (the
// same tasks: a chunk's tile of up to 16 query vectors, the rows times the query heads of one KV
// head, over its sequence's K/V blocks, with the same online softmax in float32) with both
// products on the tile unit.
//
// Scores: S^T = K Q^T, a block's 16 keys by the tile's 16 queries. K's rows are the A operand
// as the cache holds them; Q^T in pairs of dimensions, the B operand, is made once a task. Row j
// of S^T is key j's scores, lane t query t's: the layout the softmax takes, with no transpose.
// Exact products summed in float32, as the dot-product kernel's.
//
// P.V: the weights, transposed to a query a row, are split into a bfloat16 part and the
// bfloat16 rounding of the rest (w = hi + lo, within ~2^-17 of w), and one product takes both
// against V's rows twice over: 32 k of [hi | lo] x [V; V] (V's rows in pairs of keys, the B
// operand). The weights thus keep ~16 bits, against the 8 of a bfloat16 weight (torch's CPU
// flash attention rounds them to bfloat16). V's rows past the context (stale or never written)
// are zeroed first: a weight of 0 times NaN or infinity would be NaN.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "amx.h"
#include "prefill_tile.h"
#include "simd_bf16.h"

namespace {

using conveyor::transpose16;

constexpr int64_t kBlock = conveyor::kPrefillBlock;
constexpr int64_t kTile = conveyor::kPrefillTile;

// tiles: 0 the scores; 1 a K chunk (A); 2 a Q^T chunk (B); 3 the weights [hi | lo] (A); 4 a
// 16-column chunk of P.V; 5 the same columns of V's key pairs, twice over (B)
template <int64_t D>
void prefill(const uint16_t* query, const uint16_t* k_cache, const uint16_t* v_cache,
             const int32_t* tables, const int32_t* query_start, const int32_t* context_lens,
             uint16_t* out, float* lse, int64_t seqs, int64_t heads, int64_t kv_heads,
             int64_t table_width, float scale, int threads, int64_t window, float softcap) {
  constexpr int64_t P = D / 2, C = D / 32, N = D / 16;  // dim pairs; 32-dim chunks; 16-dim chunks
  const int64_t block_stride = kv_heads * kBlock * D;
  const conveyor::PrefillTasks work(query_start, seqs, heads, kv_heads);
  const int64_t tasks = work.count();
  // lanes 2i and 2i+1 of a key pair's row: dimension i of the first key, then of the second
  alignas(64) int16_t low[32], high[32];
  for (int i = 0; i < 16; ++i) {
    low[2 * i] = static_cast<int16_t>(i), low[2 * i + 1] = static_cast<int16_t>(32 + i);
    high[2 * i] = static_cast<int16_t>(16 + i), high[2 * i + 1] = static_cast<int16_t>(48 + i);
  }
  const __m512i pair_low = _mm512_load_si512(low), pair_high = _mm512_load_si512(high);
  const __m512 vscale = _mm512_set1_ps(scale);
#pragma omp parallel num_threads(threads)
  {
    conveyor::configure_tiles();
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const conveyor::PrefillTile tile = work.tile(task, query_start, context_lens, window);
      const int64_t context = context_lens[tile.s];
      alignas(64) int32_t qt[P][kTile];  // qt[p][t]: dimensions 2p and 2p+1 of query t
      alignas(64) float acc[kTile][D] = {};
      for (int64_t c = 0; c < P; c += 16) {
        __m512i q[16];
        for (int64_t t = 0; t < kTile; ++t) {
          const uint16_t* row = query + (tile.row(query_start, t) * heads + tile.head(t)) * D;
          q[t] = t < tile.count ? _mm512_loadu_si512(row + 2 * c) : _mm512_setzero_si512();
        }
        transpose16(q);
        for (int64_t j = 0; j < 16; ++j) _mm512_store_si512(qt[c + j], q[j]);
      }
      __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __m512 total = _mm512_setzero_ps();
      for (int64_t i = tile.start; i < tile.blocks; ++i) {
        const int64_t base =
            tables[tile.s * table_width + i] * block_stride + tile.kvh * kBlock * D;
        const uint16_t* k = k_cache + base;
        const uint16_t* v = v_cache + base;
        alignas(64) __m512i keys[kBlock];  // S^T, then the weights
        _tile_zero(0);
        for (int64_t c = 0; c < C; ++c) {
          _tile_loadd(1, k + c * 32, D * 2);
          _tile_loadd(2, qt[c * 16], 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, keys, 64);
        const __m512 factor =
            conveyor::softmax_block(keys, tile.position, tile.from, i * kBlock, window > 0,
                                    tile.whole(i), softcap, vscale, top, total);
        // the weights a query a row, [hi | lo] (tile 3)
        transpose16(keys);
        alignas(64) uint16_t weights[kTile][2 * kBlock];
        for (int64_t t = 0; t < kTile; ++t) {
          const __m512 w = _mm512_castsi512_ps(keys[t]);
          const __m256i hi = conveyor::to_bf16(w);
          const __m512 hi_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
          const __m256i lo = conveyor::to_bf16(_mm512_sub_ps(w, hi_f));
          _mm512_store_si512(weights[t], _mm512_inserti64x4(_mm512_castsi256_si512(hi), lo, 1));
        }
        // V's rows in pairs of keys, then the same pairs again (tile 5's rows 8-15)
        alignas(64) uint16_t pairs[kBlock][2 * D];
        const int64_t valid = std::min(kBlock, context - i * kBlock);
        for (int64_t r = 0; r < kBlock / 2; ++r) {
          for (int64_t c = 0; c < C; ++c) {
            const __m512i a = 2 * r < valid ? _mm512_loadu_si512(v + 2 * r * D + c * 32)
                                            : _mm512_setzero_si512();
            const __m512i b = 2 * r + 1 < valid ? _mm512_loadu_si512(v + (2 * r + 1) * D + c * 32)
                                                : _mm512_setzero_si512();
            const __m512i lo = _mm512_permutex2var_epi16(a, pair_low, b);
            const __m512i hi = _mm512_permutex2var_epi16(a, pair_high, b);
            _mm512_store_si512(pairs[r] + c * 64, lo);
            _mm512_store_si512(pairs[r] + c * 64 + 32, hi);
            _mm512_store_si512(pairs[r + 8] + c * 64, lo);
            _mm512_store_si512(pairs[r + 8] + c * 64 + 32, hi);
          }
        }
        // the sums so far, rescaled where a query's running max grew (a factor of 1 elsewhere:
        // most blocks past the first few), then plus this block's P.V on the tile unit
        alignas(64) float rescale[kTile];
        _mm512_store_ps(rescale, factor);
        const __mmask16 grew = _mm512_cmp_ps_mask(factor, _mm512_set1_ps(1.f), _CMP_NEQ_UQ);
        for (int64_t t = 0; t < tile.count; ++t) {
          if (!(grew >> t & 1)) continue;
          const __m512 f = _mm512_set1_ps(rescale[t]);
          for (int64_t c = 0; c < N; ++c)
            _mm512_store_ps(acc[t] + c * 16, _mm512_mul_ps(_mm512_load_ps(acc[t] + c * 16), f));
        }
        _tile_loadd(3, weights, 64);
        for (int64_t c = 0; c < N; ++c) {
          _tile_loadd(4, acc[0] + c * 16, D * 4);
          _tile_loadd(5, pairs[0] + c * 32, 4 * D);
          _tile_dpbf16ps(4, 3, 5);
          _tile_stored(4, acc[0] + c * 16, D * 4);
        }
      }
      conveyor::write_prefill_rows<D>(tile, query_start, heads, acc, top, total, out, lse);
    }
    _tile_release();
  }
}

}  // namespace

extern "C" {

// Whether this process may use the tile registers (it asks Linux for them once: 1 if granted).
int conveyor_amx_ready() { return conveyor::amx_permitted() ? 1 : 0; }

// paged_attention_bf16.cpp's conveyor_paged_prefill_bf16 on the tile unit, the same arguments;
// head sizes of a multiple of 32 (-1 for 16).
int conveyor_paged_prefill_amx(const uint16_t* query, const uint16_t* k_cache,
                               const uint16_t* v_cache, const int32_t* tables,
                               const int32_t* query_start, const int32_t* context_lens,
                               uint16_t* out, float* lse, int64_t seqs, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, int64_t table_width,
                               float scale, int threads, int64_t window, float softcap) {
  if (head_dim % 32 != 0) return -1;  // the tiles take 32 dimensions at a time
  return conveyor::for_prefill_shape(heads, kv_heads, head_dim, [&](auto d) {
    if constexpr (decltype(d)::value % 32 == 0)
      prefill<decltype(d)::value>(query, k_cache, v_cache, tables, query_start, context_lens,
                                  out, lse, seqs, heads, kv_heads, table_width, scale, threads,
                                  window, softcap);
  });
}
}
