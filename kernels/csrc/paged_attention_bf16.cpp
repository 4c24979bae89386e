// Paged attention for bfloat16 on x86 CPUs with AVX512-BF16, K/V blocks read in place through
// the block table: the decode (one query token per sequence) and the prefill (`prefill` below).
//
// Both honour a sliding window (a query sees the last `window` positions; 0: all of them) and a
// soft cap on the scores (cap * tanh(score / cap); 0: none), as transformers computes them.
//
// Decode: work is split over (sequence, KV head) pairs, and the query heads that share a KV head are
// computed together, so each K/V row is read once per step. Q.K uses the bfloat16 dot-product
// instruction (exact products, float32 sums); the softmax is online, per block, in float32;
// P.V accumulates in float32. Output is rounded to bfloat16 once, at the end.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "kv_slots.h"
#include "prefill_tile.h"
#include "simd_bf16.h"

namespace {

using conveyor::exp16;
using conveyor::load16;
using conveyor::softcap16;
using conveyor::transpose16;

constexpr int64_t kBlock = 16;  // tokens per KV block
constexpr int64_t kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kPrefetchBlocks = 2;  // how far ahead a decode asks for its next blocks

// Lane j of sum_quads(u) is the sum of the 16 lanes of key j's vector, where u[i] =
// sum_each4(the vectors of keys 4i .. 4i+3): a transposing tree of adds, ~3 instructions a key
// where a horizontal sum of each takes ~9, folded four keys at a time so that few vectors stay
// live. sum_each4: per 128-bit lane, lane i the sum of the 4 lanes of a, b, c or d there.
inline __m512 sum_each4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d x = _mm512_castps_pd(t0), y = _mm512_castps_pd(t1);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

inline __m512 sum_quads(const __m512 u[4]) {
  const __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                 _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                 _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v, w, 0x88), _mm512_shuffle_f32x4(v, w, 0xDD));
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch does
  if (std::isnan(f)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// 32 elements of a row of D from p: a head of 16 fills the lower half (the upper zero)
template <int64_t D>
inline __m512bh load_chunk(const uint16_t* p) {
  if constexpr (D % 32 != 0) return (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, p);
  return (__m512bh)_mm512_loadu_si512(p);
}

// 16 pairs of elements of a row of D from p, likewise
template <int64_t D>
inline __m512i load_pairs(const uint16_t* p) {
  if constexpr (D % 32 != 0) return _mm512_maskz_loadu_epi32(0xFF, p);
  return _mm512_loadu_si512(p);
}

// G: the query heads per KV head when it is a compile-time constant (the loops over them
// unrolled, their sums kept in registers: ~20% faster at G = 2), or 0 for any count.
template <int64_t D, int64_t G>
void decode(const uint16_t* query, const uint16_t* k_cache, const uint16_t* v_cache,
            const int32_t* tables, const int32_t* context_lens, uint16_t* out, float* lse,
            int64_t batch, int64_t heads, int64_t kv_heads, int64_t table_width, float scale,
            int threads, int64_t window, float softcap) {
  // 32 bf16 per dot-product chunk (a head of 16: one chunk, its upper half zero), 16 floats
  // per row chunk
  constexpr int64_t C = (D + 31) / 32, V = D / 16;
  const int64_t group = G > 0 ? G : heads / kv_heads;
  const int64_t block_stride = kv_heads * kBlock * D;
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t tasks = batch * kv_heads;
  // the first key a sequence of `context` tokens sees: its window's
  const auto first_key = [window](int64_t context) {
    return window > 0 ? std::max<int64_t>(context - window, 0) : int64_t{0};
  };
  // Tasks dealt round-robin in runs of `run`: a thread knows its next task, and asks for that
  // task's first blocks while it finishes this one, so no task starts on a trip to memory. With
  // enough sequences to share out, a run is a whole sequence's KV heads: one thread then reads
  // the K/V heads of a block (side by side in memory) one after another, and the CPU's own
  // prefetcher fetches the neighbours of what it reads (on an Intel Xeon with AMX, 1.2-1.3x a step
  // at 96 sequences to a run of one task).
  const int64_t run = batch >= 8 * threads ? kv_heads : 1;
#pragma omp parallel for schedule(static, run) num_threads(threads)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t b = task / kv_heads, kvh = task % kv_heads;
    const int64_t next_task =
        (task + 1) % run ? task + 1 : task + 1 + (omp_get_num_threads() - 1) * run;
    const int64_t context = context_lens[b];
    __m512bh q[kMaxGroup][C];
    __m512 acc[kMaxGroup][V];
    float top[kMaxGroup], total[kMaxGroup];
    alignas(64) float probs[kMaxGroup][kBlock];
    for (int64_t g = 0; g < group; ++g) {
      const uint16_t* qh = query + (b * heads + kvh * group + g) * D;
      for (int64_t c = 0; c < C; ++c) q[g][c] = load_chunk<D>(qh + c * 32);
      for (int64_t c = 0; c < V; ++c) acc[g][c] = _mm512_setzero_ps();
      top[g] = -std::numeric_limits<float>::infinity();
      total[g] = 0.f;
    }
    const int64_t blocks = (context + kBlock - 1) / kBlock;
    const int64_t seen_from = first_key(context), start = seen_from / kBlock;
    for (int64_t i = start; i < blocks; ++i) {
      const int64_t n = (i + 1 < blocks) ? kBlock : context - i * kBlock;
      const int64_t skip = i == start ? seen_from - i * kBlock : 0;  // keys before the window
      const int64_t base = tables[b * table_width + i] * block_stride + kvh * kBlock * D;
      const uint16_t* k = k_cache + base;
      const uint16_t* v = v_cache + base;
      const __mmask16 valid = static_cast<__mmask16>(((1u << n) - 1) & ~((1u << skip) - 1));
      // later blocks sit elsewhere in the pool: ask for them early enough to cover the
      // memory's latency (a block's compute is shorter than one trip to memory), into L2,
      // whose queue holds a block's 64 lines where L1's does not (on an AMD EPYC a decode
      // step read K/V 1.2-1.5x as fast as when asking into L1)
      for (int64_t ahead = (i == start ? 1 : kPrefetchBlocks); ahead <= kPrefetchBlocks; ++ahead) {
        int64_t next = -1;  // the block `ahead` blocks on, in this task or the next one's
        if (i + ahead < blocks) {
          next = tables[b * table_width + i + ahead] * block_stride + kvh * kBlock * D;
        } else if (next_task < tasks) {
          const int64_t nb = next_task / kv_heads;
          const int64_t j = first_key(context_lens[nb]) / kBlock + i + ahead - blocks;
          if (j * kBlock < context_lens[nb])
            next = tables[nb * table_width + j] * block_stride + (next_task % kv_heads) * kBlock * D;
        }
        if (next >= 0)
          for (int64_t line = 0; line < kBlock * D * 2; line += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(k_cache + next) + line, _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(v_cache + next) + line, _MM_HINT_T1);
          }
      }
      // Q.K for two query heads at a time, four keys at a time: their rows loaded once for
      // both heads, each four keys' sums folded at once (sum_each4). Every row of the block is
      // read, past the context too (stale or unwritten rows: whatever they hold lands in its
      // own key's lane, which the mask drops).
      for (int64_t g0 = 0; g0 < group; g0 += 2) {
        const int64_t g1 = std::min<int64_t>(g0 + 2, group);
        __m512 quads[2][4];
        for (int64_t quad = 0; quad < 4; ++quad) {
          __m512bh rows[4][C];
          for (int64_t r = 0; r < 4; ++r)
            for (int64_t c = 0; c < C; ++c)
              rows[r][c] = load_chunk<D>(k + (4 * quad + r) * D + c * 32);
          for (int64_t g = g0; g < g1; ++g) {
            __m512 d[4];
            for (int64_t r = 0; r < 4; ++r) {
              d[r] = _mm512_setzero_ps();
              for (int64_t c = 0; c < C; ++c) d[r] = _mm512_dpbf16_ps(d[r], rows[r][c], q[g][c]);
            }
            quads[g - g0][quad] = sum_each4(d[0], d[1], d[2], d[3]);
          }
        }
        for (int64_t g = g0; g < g1; ++g) {
          __m512 scaled = _mm512_mul_ps(sum_quads(quads[g - g0]), vscale);
          if (softcap > 0.f) scaled = softcap16(scaled, softcap);
          const __m512 scores = _mm512_mask_mov_ps(ninf, valid, scaled);
          const float m = std::max(top[g], _mm512_reduce_max_ps(scores));
          const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(m))));
          const float rescale = std::exp(top[g] - m);  // 0 on the first block (top is -inf)
          total[g] = total[g] * rescale + _mm512_reduce_add_ps(p);
          const __m512 r = _mm512_set1_ps(rescale);
          for (int64_t c = 0; c < V; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], r);
          _mm512_store_ps(probs[g], p);
          top[g] = m;
        }
      }
      for (int64_t j = skip; j < n; ++j) {
        __m512 row[V];
        for (int64_t c = 0; c < V; ++c) row[c] = load16(v + j * D + c * 16);
        for (int64_t g = 0; g < group; ++g) {
          const __m512 pj = _mm512_set1_ps(probs[g][j]);
          for (int64_t c = 0; c < V; ++c) acc[g][c] = _mm512_fmadd_ps(pj, row[c], acc[g][c]);
        }
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kvh * group + g;
      alignas(64) float o[D];
      const __m512 inv = _mm512_set1_ps(1.f / total[g]);
      for (int64_t c = 0; c < V; ++c) _mm512_store_ps(o + c * 16, _mm512_mul_ps(acc[g][c], inv));
      for (int64_t d = 0; d < D; ++d) out[(b * heads + h) * D + d] = to_bf16(o[d]);
      if (lse != nullptr) lse[b * heads + h] = top[g] + std::log(total[g]);
    }
  }
}


constexpr int64_t kTile = conveyor::kPrefillTile;

// Prefill: each chunk's query rows attend causally to their sequence's cache, written already
// for this step. Work is split over (sequence, KV head, tile of rows); a tile holds up to 16
// query vectors (rows times the query heads of the KV head), so each K/V block is read and
// converted once for all of them. Each K block is transposed so that lane j holds key j: a
// query's 16 scores then come straight out of D/2 dot-product steps, with no sum across lanes.
// The softmax and P.V are float32, as in the decode.
template <int64_t D>
void prefill(const uint16_t* query, const uint16_t* k_cache, const uint16_t* v_cache,
             const int32_t* tables, const int32_t* query_start, const int32_t* context_lens,
             uint16_t* out, float* lse, int64_t seqs, int64_t heads, int64_t kv_heads,
             int64_t table_width, float scale, int threads, int64_t window, float softcap) {
  constexpr int64_t P = D / 2, V = D / 16;  // dword pairs per row, float vectors per row
  const int64_t block_stride = kv_heads * kBlock * D;
  const conveyor::PrefillTasks work(query_start, seqs, heads, kv_heads);
  const int64_t tasks = work.count();
  const __m512 vscale = _mm512_set1_ps(scale);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t task = 0; task < tasks; ++task) {
    const conveyor::PrefillTile tile = work.tile(task, query_start, context_lens, window);
    const int64_t s = tile.s, kvh = tile.kvh, count = tile.count;
    const int32_t* qdw[kTile];
    alignas(64) float acc[kTile][D] = {};
    alignas(64) float probs[kBlock][kTile];  // probs[j][t]: key j's weight for query t
    alignas(64) float rescale[kTile];
    const uint32_t zero[P] = {};
    for (int64_t t = 0; t < kTile; ++t)
      qdw[t] = t < count ? reinterpret_cast<const int32_t*>(
                               query + (tile.row(query_start, t) * heads + tile.head(t)) * D)
                         : reinterpret_cast<const int32_t*>(zero);
    // the softmax's running max and sum, lane t for query t
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 total = _mm512_setzero_ps();
    for (int64_t i = tile.start; i < tile.blocks; ++i) {
      const int64_t base = tables[s * table_width + i] * block_stride + kvh * kBlock * D;
      const uint16_t* k = k_cache + base;
      const uint16_t* v = v_cache + base;
      __m512i kt[P];  // kt[p] lane j: elements 2p and 2p+1 of key j
      for (int64_t c = 0; c < P; c += 16) {
        __m512i block[16];
        for (int64_t j = 0; j < kBlock; ++j)
          block[j] = load_pairs<D>(k + j * D + 2 * c);
        transpose16(block);
        for (int64_t j = 0; j < 16 && c + j < P; ++j) kt[c + j] = block[j];
      }
      __m512 scores[kTile];
#pragma GCC unroll 16
      for (int64_t t = 0; t < kTile; ++t) scores[t] = _mm512_setzero_ps();
      for (int64_t p = 0; p < P; ++p) {
#pragma GCC unroll 16
        for (int64_t t = 0; t < kTile; ++t)
          scores[t] = _mm512_dpbf16_ps(scores[t], (__m512bh)_mm512_set1_epi32(qdw[t][p]),
                                       (__m512bh)kt[p]);
      }
      alignas(64) float vf[kBlock][D];  // this block's V rows in float32
      for (int64_t j = 0; j < kBlock; ++j)
        for (int64_t c = 0; c < V; ++c) _mm512_store_ps(vf[j] + c * 16, load16(v + j * D + c * 16));
      // The softmax for all 16 queries at once: the scores transposed, so that lane t of
      // keys[j] is query t's score for key j (visible if key i*16+j <= the query's position)
      __m512i keys[kBlock];
      for (int64_t t = 0; t < kTile; ++t) keys[t] = _mm512_castps_si512(scores[t]);
      transpose16(keys);
      const __m512 factor = conveyor::softmax_block(keys, tile.position, tile.from, i * kBlock,
                                                    window > 0, tile.whole(i), softcap, vscale,
                                                    top, total);
      for (int64_t j = 0; j < kBlock; ++j)
        _mm512_store_ps(probs[j], _mm512_castsi512_ps(keys[j]));
      _mm512_store_ps(rescale, factor);
      for (int64_t t = 0; t < count; ++t) {
        const int64_t pos = tile.positions[t];
        const int64_t nk = std::min(pos - i * kBlock + 1, kBlock);  // keys it sees
        // the keys of this block before its window (their weights are 0)
        const int64_t j0 = window > 0 ? std::max<int64_t>(pos - window + 1 - i * kBlock, 0) : 0;
        if (nk <= j0) continue;
        __m512 o[V];
        const __m512 rs = _mm512_set1_ps(rescale[t]);
        for (int64_t c = 0; c < V; ++c) o[c] = _mm512_mul_ps(_mm512_load_ps(acc[t] + c * 16), rs);
        for (int64_t j = j0; j < nk; ++j) {
          const __m512 pj = _mm512_set1_ps(probs[j][t]);
          for (int64_t c = 0; c < V; ++c)
            o[c] = _mm512_fmadd_ps(pj, _mm512_load_ps(vf[j] + c * 16), o[c]);
        }
        for (int64_t c = 0; c < V; ++c) _mm512_store_ps(acc[t] + c * 16, o[c]);
      }
    }
    conveyor::write_prefill_rows<D>(tile, query_start, heads, acc, top, total, out, lse);
  }
}

}  // namespace

extern "C" {

// Returns 0, or -1 for a shape this kernel does not cover (the caller checks first).
// query/out [batch, heads, head_dim]; caches [blocks, kv_heads, 16, head_dim]; tables
// [batch, table_width] int32; context_lens [batch] int32, each >= 1; lse [batch, heads] or null;
// threads: the caller's thread count (torch's), not OpenMP's default for this thread; window: the
// positions a query sees (0: all); softcap: the cap on its scores (0: none).
int conveyor_paged_decode_bf16(const uint16_t* query, const uint16_t* k_cache,
                               const uint16_t* v_cache, const int32_t* tables,
                               const int32_t* context_lens, uint16_t* out, float* lse,
                               int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                               int64_t table_width, float scale, int threads, int64_t window,
                               float softcap) {
  if (kv_heads < 1 || heads % kv_heads != 0 || heads / kv_heads > kMaxGroup) return -1;
  const auto run = [&](auto d, auto g) {
    decode<decltype(d)::value, decltype(g)::value>(query, k_cache, v_cache, tables,
                                                   context_lens, out, lse, batch, heads,
                                                   kv_heads, table_width, scale, threads,
                                                   window, softcap);
  };
  return conveyor::for_head_dim(head_dim, [&](auto d) {
    switch (heads / kv_heads) {
      case 1: return run(d, std::integral_constant<int64_t, 1>{});
      case 2: return run(d, std::integral_constant<int64_t, 2>{});
      case 4: return run(d, std::integral_constant<int64_t, 4>{});
      case 8: return run(d, std::integral_constant<int64_t, 8>{});
      default: return run(d, std::integral_constant<int64_t, 0>{});
    }
  });
}

// Returns 0, or -1 for a shape this kernel does not cover. query/out [T, heads, head_dim], the
// chunks back to back; query_start [seqs + 1] int32; context_lens [seqs] int32: tokens in the
// cache after this step's chunk; tables [seqs, table_width]; lse [T, heads] or null; window and
// softcap as for the decode.
int conveyor_paged_prefill_bf16(const uint16_t* query, const uint16_t* k_cache,
                                const uint16_t* v_cache, const int32_t* tables,
                                const int32_t* query_start, const int32_t* context_lens,
                                uint16_t* out, float* lse, int64_t seqs, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, int64_t table_width,
                                float scale, int threads, int64_t window, float softcap) {
  return conveyor::for_prefill_shape(heads, kv_heads, head_dim, [&](auto d) {
    prefill<decltype(d)::value>(query, k_cache, v_cache, tables, query_start, context_lens, out,
                                lse, seqs, heads, kv_heads, table_width, scale, threads, window,
                                softcap);
  });
}

// Writes this step's keys and values into their cache slots (kv_slots.h).
void conveyor_write_kv_bf16(const uint16_t* key, int64_t key_stride, const uint16_t* value,
                            int64_t value_stride, const int64_t* slots, uint16_t* k_cache,
                            uint16_t* v_cache, int64_t tokens, int64_t kv_heads,
                            int64_t head_dim, int threads) {
  conveyor::write_kv(key, key_stride, value, value_stride, slots, k_cache, v_cache, tokens,
                     kv_heads, head_dim, threads);
}
}
