// What the bfloat16 prefill kernels (paged_attention_bf16.cpp, prefill_amx.cpp) share: their
// tasks (a chunk's tile of up to 16 query vectors, the rows times the query heads of one KV head,
// over its sequence's K/V blocks), the online softmax's step over one block of 16 keys for the
// tile's queries at once, in float32, the writing of their results, and a 16x16 transpose.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd_bf16.h"

namespace conveyor {

// A 16x16 transpose of 32-bit lanes: row j of `in` becomes lane j of every output vector.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// One block of the online softmax for 16 queries, lane t for query t. keys[j] holds each
// query's raw score for key j of the block (keys block_start + j); a query sees a key at or
// before its position (`position`, lane t) and, with a window, at or after `from`. On return
// keys[j] holds the keys' weights under the new running max (0 where unseen, whatever the
// score: NaN or infinity from a stale row included), `top` and `total` the running max and sum,
// and the result is the factor that rescales what the queries had summed before this block.
// `whole`: every query of the tile sees every key of the block (a block before the tile's
// diagonal and inside every window), so nothing is masked: the same results for those queries,
// and whatever for a tile's unused lanes, which nothing reads.
inline __m512 softmax_block(__m512i keys[16], __m512i position, __m512i from, int64_t block_start,
                            bool windowed, bool whole, float softcap, __m512 scale, __m512& top,
                            __m512& total) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i start = _mm512_set1_epi32(static_cast<int32_t>(block_start));
  const __m512i seen = _mm512_sub_epi32(position, start);
  const __m512i seen_from = _mm512_sub_epi32(from, start);
  __mmask16 visible[16];
  __m512 block_top = ninf;
  for (int64_t j = 0; j < 16; ++j) {
    const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(j));
    visible[j] = whole ? __mmask16{0xFFFF} : _mm512_cmp_epi32_mask(key, seen, _MM_CMPINT_LE);
    if (windowed && !whole) visible[j] &= _mm512_cmp_epi32_mask(key, seen_from, _MM_CMPINT_NLT);
    __m512 scaled = _mm512_mul_ps(_mm512_castsi512_ps(keys[j]), scale);
    if (softcap > 0.f) scaled = softcap16(scaled, softcap);
    keys[j] = _mm512_castps_si512(_mm512_mask_mov_ps(ninf, visible[j], scaled));
    block_top = _mm512_max_ps(block_top, _mm512_castsi512_ps(keys[j]));
  }
  const __m512 new_top = _mm512_max_ps(top, block_top);
  // a query that has seen no key yet (top still -inf) keeps a factor of 1
  const __mmask16 started = _mm512_cmp_ps_mask(new_top, ninf, _CMP_NEQ_UQ);
  const __m512 factor =
      _mm512_mask_mov_ps(_mm512_set1_ps(1.f), started, exp16(_mm512_sub_ps(top, new_top)));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < 16; ++j) {
    const __m512 pj = _mm512_maskz_mov_ps(
        visible[j], exp16(_mm512_sub_ps(_mm512_castsi512_ps(keys[j]), new_top)));
    keys[j] = _mm512_castps_si512(pj);
    sum = _mm512_add_ps(sum, pj);
  }
  total = _mm512_add_ps(_mm512_mul_ps(total, factor), sum);
  top = new_top;
  return factor;
}

constexpr int64_t kPrefillTile = 16;  // query vectors computed together
constexpr int64_t kPrefillBlock = 16;  // tokens per KV block

// One task's tile: query vector t is row r0 + t / group of sequence s's chunk, head
// kvh * group + t % group; `count` of the 16 are real, the rest unused (position -1).
struct PrefillTile {
  int64_t s, r0, kvh, group, rows, count;
  int64_t first;  // cache position of the chunk's first query
  int64_t last;  // the tile's last position
  int64_t start, blocks;  // the blocks the tile reads: [start, blocks)
  int64_t whole_from, whole_before;  // blocks [whole_from, whole_before) are seen whole by all
  alignas(64) int32_t positions[kPrefillTile];
  __m512i position;  // lane t: query t's position
  __m512i from;  // lane t: the first position it sees (its window's)

  PrefillTile(const std::pair<int32_t, int32_t>& tile, int64_t kv_head, int64_t group_size,
              int64_t rows_per_tile, const int32_t* query_start, const int32_t* context_lens,
              int64_t window)
      : s(tile.first), r0(tile.second), kvh(kv_head), group(group_size) {
    const int64_t n = query_start[s + 1] - query_start[s];
    first = context_lens[s] - n;
    rows = std::min(rows_per_tile, n - r0);
    count = rows * group;
    last = first + r0 + rows - 1;
    blocks = last / kPrefillBlock + 1;
    start = window > 0 ? std::max<int64_t>(first + r0 - window + 1, 0) / kPrefillBlock : 0;
    whole_from = window > 0
                     ? (std::max<int64_t>(last - window + 1, 0) + kPrefillBlock - 1) / kPrefillBlock
                     : 0;
    whole_before = (first + r0 + 1) / kPrefillBlock;
    for (int64_t t = 0; t < kPrefillTile; ++t)
      positions[t] = t < count ? static_cast<int32_t>(first + r0 + t / group) : -1;
    position = _mm512_load_si512(positions);
    from = _mm512_sub_epi32(position, _mm512_set1_epi32(static_cast<int32_t>(window - 1)));
  }

  bool whole(int64_t block) const { return block >= whole_from && block < whole_before; }
  // query vector t's row of the step (of all chunks back to back) and head
  int64_t row(const int32_t* query_start, int64_t t) const {
    return query_start[s] + r0 + t / group;
  }
  int64_t head(int64_t t) const { return kvh * group + t % group; }
};

// A prefill's tasks: each chunk's rows cut into tiles of up to 16 query vectors (rows times the
// query heads of a KV head), a tile's KV heads one task each.
struct PrefillTasks {
  int64_t kv_heads, group, rows_per_tile;
  std::vector<std::pair<int32_t, int32_t>> tiles;  // (sequence, first row of its chunk)

  PrefillTasks(const int32_t* query_start, int64_t seqs, int64_t heads, int64_t kv_heads_)
      : kv_heads(kv_heads_),
        group(heads / kv_heads_),
        rows_per_tile(std::max<int64_t>(1, kPrefillTile / group)) {
    for (int64_t s = 0; s < seqs; ++s)
      for (int64_t r = 0; r < query_start[s + 1] - query_start[s]; r += rows_per_tile)
        tiles.emplace_back(static_cast<int32_t>(s), static_cast<int32_t>(r));
  }

  int64_t count() const { return static_cast<int64_t>(tiles.size()) * kv_heads; }
  PrefillTile tile(int64_t task, const int32_t* query_start, const int32_t* context_lens,
                   int64_t window) const {
    return PrefillTile(tiles[task / kv_heads], task % kv_heads, group, rows_per_tile,
                       query_start, context_lens, window);
  }
};

// Each real query's result, its sums `acc` (rows D floats apart) over its softmax's total,
// rounded to bfloat16, and its log-sum-exp where `lse` is not null.
template <int64_t D>
void write_prefill_rows(const PrefillTile& tile, const int32_t* query_start, int64_t heads,
                        const float (*acc)[D], __m512 top, __m512 total, uint16_t* out,
                        float* lse) {
  alignas(64) float tops[kPrefillTile], totals[kPrefillTile];
  _mm512_store_ps(tops, top);
  _mm512_store_ps(totals, total);
  for (int64_t t = 0; t < tile.count; ++t) {
    const int64_t row = tile.row(query_start, t), h = tile.head(t);
    uint16_t* o = out + (row * heads + h) * D;
    const __m512 inv = _mm512_set1_ps(1.f / totals[t]);
    for (int64_t c = 0; c < D; c += 16)
      store16(o + c, _mm512_mul_ps(_mm512_load_ps(acc[t] + c), inv));
    if (lse != nullptr) lse[row * heads + h] = tops[t] + std::log(totals[t]);
  }
}

// The head sizes the bfloat16 attention kernels are built for (HEAD_DIMS in native_paged.py):
// run(std::integral_constant<int64_t, D>{}) for head_dim, and 0; -1 for any other size.
template <typename Run>
int for_head_dim(int64_t head_dim, Run run) {
  switch (head_dim) {
    case 16: run(std::integral_constant<int64_t, 16>{}); return 0;
    case 32: run(std::integral_constant<int64_t, 32>{}); return 0;
    case 64: run(std::integral_constant<int64_t, 64>{}); return 0;
    case 96: run(std::integral_constant<int64_t, 96>{}); return 0;
    case 128: run(std::integral_constant<int64_t, 128>{}); return 0;
    case 256: run(std::integral_constant<int64_t, 256>{}); return 0;
    default: return -1;
  }
}

// run(std::integral_constant<int64_t, D>{}) for a head size of for_head_dim's and at most 16
// query heads per KV head: 0, or -1 for a shape the prefill kernels do not take.
template <typename Run>
int for_prefill_shape(int64_t heads, int64_t kv_heads, int64_t head_dim, Run run) {
  if (kv_heads < 1 || heads % kv_heads != 0 || heads / kv_heads > kPrefillTile) return -1;
  return for_head_dim(head_dim, run);
}

}  // namespace conveyor
