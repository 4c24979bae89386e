// Paged attention in float32 for x86 CPUs with AVX2 and FMA (the CPUs where the engine computes
// in float32: no fast bfloat16 products), K/V blocks read in place through the block table: the
// decode (one query token per sequence) and the prefill (`prefill` below), and the write of a
// step's keys and values into their slots. Built with CONVEYOR_AVX512 defined, the prefill runs
// on AVX-512's 16 lanes (simd_f32.h) with the same results bit for bit; the decode is AVX2's in
// both builds.
//
// Both honour a sliding window (a query sees the last `window` positions; 0: all of them) and a
// soft cap on the scores (cap * tanh(score / cap); 0: none), as transformers computes them.
//
// Decode: work is split over (sequence, KV head) pairs, and the query heads that share a KV head
// are computed together, so each K/V row is read once per step. The softmax is online, per block
// of 16 keys; sums are float32 throughout, in another order than torch's.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "kv_slots.h"
#include "simd_avx2.h"

namespace {

using conveyor::exp8;

constexpr int64_t kBlock = 16;  // tokens per KV block
constexpr int64_t kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kPrefetchBlocks = 2;  // how far ahead a task asks for its next blocks

// Lane j of the result is the sum of the 8 lanes of a[j].
inline __m256 sum_each8(const __m256 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The largest of a's 8 lanes.
inline float max_of(__m256 a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// s[h][j] = scale * q[h] . k[j] for HP query heads (1 or 2) and a block's 16 keys, each K row
// loaded once for the HP heads: 8 / HP keys at a time, 8 dot products in flight, reduced
// together (each sum in the same order whatever its head or key).
template <int64_t D, int HP>
inline void block_scores(const float (*q)[D], const float* k, float scale, float (*s)[kBlock]) {
  constexpr int64_t V = D / 8, kKeys = 8 / HP;
  for (int64_t j0 = 0; j0 < kBlock; j0 += kKeys) {
    __m256 dots[8];
    for (int i = 0; i < 8; ++i) dots[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < V; ++c) {
      __m256 qv[HP];
      for (int h = 0; h < HP; ++h) qv[h] = _mm256_load_ps(q[h] + c * 8);
      for (int64_t j = 0; j < kKeys; ++j) {
        const __m256 kv = _mm256_loadu_ps(k + (j0 + j) * D + c * 8);
        for (int h = 0; h < HP; ++h)
          dots[h * kKeys + j] = _mm256_fmadd_ps(qv[h], kv, dots[h * kKeys + j]);
      }
    }
    const __m256 sums = _mm256_mul_ps(sum_each8(dots), _mm256_set1_ps(scale));
    if constexpr (HP == 1) {
      _mm256_store_ps(s[0] + j0, sums);
    } else {
      _mm_storeu_ps(s[0] + j0, _mm256_castps256_ps128(sums));
      _mm_storeu_ps(s[1] + j0, _mm256_extractf128_ps(sums, 1));
    }
  }
}

// acc = acc * rescale + sum over keys j in [skip, n) of probs[j] * v[j] for one query head: a
// whole row (up to 8 vectors) at a time with its sums in registers, each element summed in key
// order as a key at a time would sum it.
template <int64_t D>
inline void add_values(const float* v, const float* probs, float rescale, int64_t skip, int64_t n,
                       float* acc) {
  constexpr int64_t V = D / 8, kChunk = V % 8 == 0 ? 8 : V % 4 == 0 ? 4 : V;
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    __m256 sum[kChunk];
    for (int64_t c = 0; c < kChunk; ++c)
      sum[c] = _mm256_mul_ps(_mm256_load_ps(acc + (c0 + c) * 8), _mm256_set1_ps(rescale));
    for (int64_t j = skip; j < n; ++j) {
      const __m256 p = _mm256_set1_ps(probs[j]);
      for (int64_t c = 0; c < kChunk; ++c)
        sum[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + j * D + (c0 + c) * 8), sum[c]);
    }
    for (int64_t c = 0; c < kChunk; ++c) _mm256_store_ps(acc + (c0 + c) * 8, sum[c]);
  }
}

// G: the query heads per KV head when it is a compile-time constant (the loops over them
// unrolled), or 0 for any count.
template <int64_t D, int64_t G>
void decode(const float* query, const float* k_cache, const float* v_cache, const int32_t* tables,
            const int32_t* context_lens, float* out, float* lse, int64_t batch, int64_t heads,
            int64_t kv_heads, int64_t table_width, float scale, int threads, int64_t window,
            float softcap) {
  const int64_t group = G > 0 ? G : heads / kv_heads;
  const int64_t block_stride = kv_heads * kBlock * D;
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t tasks = batch * kv_heads;
  const __m256 lanes = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  const auto first_key = [window](int64_t context) {
    return window > 0 ? std::max<int64_t>(context - window, 0) : int64_t{0};
  };
  // Tasks dealt round-robin in runs of `run` (a sequence's KV heads where there are enough
  // sequences to share out), as in the bfloat16 decode: a thread knows its next task, and asks
  // for that task's first blocks while it finishes this one
  const int64_t run = batch >= 8 * threads ? kv_heads : 1;
#pragma omp parallel for schedule(static, run) num_threads(threads)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t b = task / kv_heads, kvh = task % kv_heads;
    const int64_t next_task =
        (task + 1) % run ? task + 1 : task + 1 + (omp_get_num_threads() - 1) * run;
    const int64_t context = context_lens[b];
    alignas(32) float q[kMaxGroup][D];
    alignas(32) float acc[kMaxGroup][D];
    float top[kMaxGroup], total[kMaxGroup];
    alignas(32) float probs[kMaxGroup][kBlock];
    for (int64_t g = 0; g < group; ++g) {
      const float* qh = query + (b * heads + kvh * group + g) * D;
      for (int64_t d = 0; d < D; ++d) q[g][d] = qh[d];
      for (int64_t d = 0; d < D; ++d) acc[g][d] = 0.f;
      top[g] = ninf;
      total[g] = 0.f;
    }
    const int64_t blocks = (context + kBlock - 1) / kBlock;
    const int64_t seen_from = first_key(context), start = seen_from / kBlock;
    for (int64_t i = start; i < blocks; ++i) {
      const int64_t n = (i + 1 < blocks) ? kBlock : context - i * kBlock;
      const int64_t skip = i == start ? seen_from - i * kBlock : 0;  // keys before the window
      const int64_t base = tables[b * table_width + i] * block_stride + kvh * kBlock * D;
      const float* k = k_cache + base;
      const float* v = v_cache + base;
      // asked for into L2, whose queue holds a block's lines where L1's does not (on an AMD
      // EPYC K/V came from memory 1.1-1.8x as fast as when asked for into L1)
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
          for (int64_t line = 0; line < kBlock * D * 4; line += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(k_cache + next) + line, _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(v_cache + next) + line, _MM_HINT_T1);
          }
      }
      alignas(32) float scores[kMaxGroup][kBlock];
      for (int64_t g = 0; g < group; g += 2) {  // query heads in pairs, K read once a pair
        if (g + 1 < group) {
          block_scores<D, 2>(q + g, k, scale, scores + g);
        } else {
          block_scores<D, 1>(q + g, k, scale, scores + g);
        }
      }
      // the keys this query sees: [skip, n) of the block (rows past n may hold anything)
      const __m256 lo_seen = _mm256_and_ps(_mm256_cmp_ps(lanes, _mm256_set1_ps(skip), _CMP_GE_OQ),
                                           _mm256_cmp_ps(lanes, _mm256_set1_ps(n), _CMP_LT_OQ));
      const __m256 hi_lanes = _mm256_add_ps(lanes, _mm256_set1_ps(8.f));
      const __m256 hi_seen = _mm256_and_ps(
          _mm256_cmp_ps(hi_lanes, _mm256_set1_ps(skip), _CMP_GE_OQ),
          _mm256_cmp_ps(hi_lanes, _mm256_set1_ps(n), _CMP_LT_OQ));
      alignas(32) float rescale[kMaxGroup];
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores[g];
        if (softcap > 0.f)
          for (int64_t j = skip; j < n; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
        const __m256 lo = _mm256_blendv_ps(_mm256_set1_ps(ninf), _mm256_load_ps(s), lo_seen);
        const __m256 hi = _mm256_blendv_ps(_mm256_set1_ps(ninf), _mm256_load_ps(s + 8), hi_seen);
        const float m = std::max(top[g], max_of(_mm256_max_ps(lo, hi)));
        const __m256 mv = _mm256_set1_ps(m);
        _mm256_store_ps(probs[g], _mm256_and_ps(exp8(_mm256_sub_ps(lo, mv)), lo_seen));
        _mm256_store_ps(probs[g] + 8, _mm256_and_ps(exp8(_mm256_sub_ps(hi, mv)), hi_seen));
        float sum = 0.f;
        for (int64_t j = 0; j < kBlock; ++j) sum += probs[g][j];
        rescale[g] = std::exp(top[g] - m);  // 0 on the first block (top is -inf)
        total[g] = total[g] * rescale[g] + sum;
        top[g] = m;
      }
      for (int64_t g = 0; g < group; ++g) add_values<D>(v, probs[g], rescale[g], skip, n, acc[g]);
    }
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kvh * group + g;
      const float inv = 1.f / total[g];
      for (int64_t d = 0; d < D; ++d) out[(b * heads + h) * D + d] = acc[g][d] * inv;
      if (lse != nullptr) lse[b * heads + h] = top[g] + std::log(total[g]);
    }
  }
}

namespace v = conveyor::f32;
constexpr int64_t kTile = v::kLanes;  // query vectors (rows x heads of one KV head) a task

// Prefill: each chunk's query rows attend causally to their sequence's cache, written already
// for this step. Work is split over (sequence, KV head, tile); a tile holds a vector's lanes of
// the chunk's query vectors for the KV head (row by row, each row's query heads of the KV head
// in order; a row's heads may fall in two tiles), so each K/V block is read once for all of
// them. The tile's queries are transposed once (lane t of qt[d]: query t's element d), so a
// key's scores, one a query, come out of D multiply-adds with the key's elements broadcast:
// lane t of keys[j] is query t's score for key j, and the online softmax runs down the lanes.
// Every sum runs within a lane or along one query's row, so a query's result does not depend
// on the lanes a vector has (AVX2's 8 or AVX-512's 16) nor on the tile it falls in.
template <int64_t D>
void prefill(const float* query, const float* k_cache, const float* v_cache,
             const int32_t* tables, const int32_t* query_start, const int32_t* context_lens,
             float* out, float* lse, int64_t seqs, int64_t heads, int64_t kv_heads,
             int64_t table_width, float scale, int threads, int64_t window, float softcap) {
  constexpr int64_t V = D / v::kLanes;  // vectors a row
  const int64_t group = heads / kv_heads;
  const int64_t block_stride = kv_heads * kBlock * D;
  std::vector<std::pair<int32_t, int32_t>> tiles;  // (sequence, its first query vector)
  for (int64_t s = 0; s < seqs; ++s)
    for (int64_t q0 = 0; q0 < (query_start[s + 1] - query_start[s]) * group; q0 += kTile)
      tiles.emplace_back(static_cast<int32_t>(s), static_cast<int32_t>(q0));
  const int64_t tasks = static_cast<int64_t>(tiles.size()) * kv_heads;
  const float ninf_f = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t task = 0; task < tasks; ++task) {
    // a KV head's tiles one after the other: the threads' next tasks read the same K/V
    const int64_t count_tiles = static_cast<int64_t>(tiles.size());
    const int64_t s = tiles[task % count_tiles].first, q0 = tiles[task % count_tiles].second;
    const int64_t kvh = task / count_tiles;
    const int64_t n = query_start[s + 1] - query_start[s];
    const int64_t first = context_lens[s] - n;  // cache position of the chunk's first query
    const int64_t count = std::min(kTile, n * group - q0);  // query vectors in this tile
    alignas(64) float qt[D][kTile];
    alignas(64) float acc[kTile][D];
    alignas(64) float probs[kBlock][kTile];  // probs[j][t]: key j's weight for query t
    alignas(64) float rescale[kTile];
    alignas(64) float positions[kTile];  // exact: contexts stay far below 2^24
    int64_t pos[kTile];
    for (int64_t t = 0; t < kTile; ++t) {
      const int64_t row = (q0 + t) / group, h = kvh * group + (q0 + t) % group;
      const bool real = t < count;
      const float* q = query + ((query_start[s] + row) * heads + h) * D;
      for (int64_t d = 0; d < D; ++d) qt[d][t] = real ? q[d] : 0.f;
      pos[t] = real ? first + row : -1;
      positions[t] = static_cast<float>(pos[t]);
      for (int64_t d = 0; d < D; ++d) acc[t][d] = 0.f;
    }
    // the softmax's running max and sum, lane t for query t
    const v::Vec ninf = v::set1(ninf_f);
    v::Vec top = ninf, total = v::zero();
    const v::Vec position = v::load(positions);
    const int64_t last = pos[count - 1];  // the tile's last position
    const int64_t blocks = last / kBlock + 1;
    // lane t: the first position query t sees (its window's), and from which block the tile reads
    const v::Vec from = v::sub(position, v::set1(static_cast<float>(window - 1)));
    const int64_t start = window > 0 ? std::max<int64_t>(pos[0] - window + 1, 0) / kBlock : 0;
    const v::Vec vscale = v::set1(scale);
    for (int64_t i = start; i < blocks; ++i) {
      const int64_t base = tables[s * table_width + i] * block_stride + kvh * kBlock * D;
      const float* k = k_cache + base;
      const float* vrows = v_cache + base;
      v::Vec keys[kBlock];
      for (int64_t half = 0; half < kBlock; half += 8) {
        v::Vec dots[8];
        for (int64_t j = 0; j < 8; ++j) dots[j] = v::zero();
        for (int64_t d = 0; d < D; ++d) {
          const v::Vec qd = v::load(qt[d]);
#pragma GCC unroll 8
          for (int64_t j = 0; j < 8; ++j)
            dots[j] = v::fmadd(qd, v::broadcast(k + (half + j) * D + d), dots[j]);
        }
        for (int64_t j = 0; j < 8; ++j) keys[half + j] = dots[j];
      }
      // lane t of keys[j] is visible if key i*16+j lies in query t's causal window
      v::Mask visible[kBlock];
      v::Vec block_top = ninf;
      for (int64_t j = 0; j < kBlock; ++j) {
        const v::Vec key = v::set1(static_cast<float>(i * kBlock + j));
        visible[j] = v::less_equal(key, position);
        if (window > 0) visible[j] = v::both(visible[j], v::less_equal(from, key));
        v::Vec scaled = v::mul(keys[j], vscale);
        if (softcap > 0.f) {
          alignas(64) float lanes[kTile];
          v::store(lanes, scaled);
          for (float& x : lanes) x = softcap * std::tanh(x / softcap);
          scaled = v::load(lanes);
        }
        keys[j] = v::select(visible[j], scaled, ninf);
        block_top = v::max(block_top, keys[j]);
      }
      const v::Vec new_top = v::max(top, block_top);
      // a query that has seen no key yet (top still -inf) keeps a factor of 1
      const v::Vec factor = v::select(v::not_equal(new_top, ninf), v::exp(v::sub(top, new_top)),
                                      v::set1(1.f));
      v::Vec sum = v::zero();
      for (int64_t j = 0; j < kBlock; ++j) {
        const v::Vec pj = v::zero_unless(visible[j], v::exp(v::sub(keys[j], new_top)));
        v::store(probs[j], pj);
        sum = v::add(sum, pj);
      }
      total = v::add(v::mul(total, factor), sum);
      top = new_top;
      v::store(rescale, factor);
      for (int64_t t = 0; t < count; ++t) {
        const int64_t nk = std::min(pos[t] - i * kBlock + 1, kBlock);  // keys it sees
        // the keys of this block before its window (their weights are 0)
        const int64_t j0 = window > 0 ? std::max<int64_t>(pos[t] - window + 1 - i * kBlock, 0) : 0;
        if (nk <= j0) continue;
        const v::Vec rs = v::set1(rescale[t]);
        for (int64_t c0 = 0; c0 < V; c0 += 8) {  // 8 vectors of the row at a time, in registers
          const int64_t cn = std::min<int64_t>(8, V - c0);
          v::Vec o[8];
          for (int64_t c = 0; c < cn; ++c) o[c] = v::mul(v::load(acc[t] + (c0 + c) * v::kLanes), rs);
          for (int64_t j = j0; j < nk; ++j) {
            const v::Vec pj = v::set1(probs[j][t]);
            for (int64_t c = 0; c < cn; ++c)
              o[c] = v::fmadd(pj, v::load(vrows + j * D + (c0 + c) * v::kLanes), o[c]);
          }
          for (int64_t c = 0; c < cn; ++c) v::store(acc[t] + (c0 + c) * v::kLanes, o[c]);
        }
      }
    }
    alignas(64) float tops[kTile], totals[kTile];
    v::store(tops, top);
    v::store(totals, total);
    for (int64_t t = 0; t < count; ++t) {
      const int64_t row = query_start[s] + (q0 + t) / group, h = kvh * group + (q0 + t) % group;
      float* o = out + (row * heads + h) * D;
      const float inv = 1.f / totals[t];
      for (int64_t d = 0; d < D; ++d) o[d] = acc[t][d] * inv;
      if (lse != nullptr) lse[row * heads + h] = tops[t] + std::log(totals[t]);
    }
  }
}

}  // namespace

extern "C" {

// Returns 0, or -1 for a shape this kernel does not cover (the caller checks first).
// query/out [batch, heads, head_dim]; caches [blocks, kv_heads, 16, head_dim]; tables
// [batch, table_width] int32; context_lens [batch] int32, each >= 1; lse [batch, heads] or null;
// threads: the caller's thread count (torch's), not OpenMP's default for this thread; window: the
// positions a query sees (0: all); softcap: the cap on its scores (0: none).
int conveyor_paged_decode_f32(const float* query, const float* k_cache, const float* v_cache,
                              const int32_t* tables, const int32_t* context_lens, float* out,
                              float* lse, int64_t batch, int64_t heads, int64_t kv_heads,
                              int64_t head_dim, int64_t table_width, float scale, int threads,
                              int64_t window, float softcap) {
  if (kv_heads < 1 || heads % kv_heads != 0 || heads / kv_heads > kMaxGroup) return -1;
  const auto run = [&](auto d, auto g) {
    decode<decltype(d)::value, decltype(g)::value>(query, k_cache, v_cache, tables, context_lens,
                                                   out, lse, batch, heads, kv_heads, table_width,
                                                   scale, threads, window, softcap);
  };
  const auto for_group = [&](auto d) {
    switch (heads / kv_heads) {
      case 1: return run(d, std::integral_constant<int64_t, 1>{});
      case 2: return run(d, std::integral_constant<int64_t, 2>{});
      case 4: return run(d, std::integral_constant<int64_t, 4>{});
      case 8: return run(d, std::integral_constant<int64_t, 8>{});
      default: return run(d, std::integral_constant<int64_t, 0>{});
    }
  };
  switch (head_dim) {  // as native_paged_f32.HEAD_DIMS
    case 16: for_group(std::integral_constant<int64_t, 16>{}); break;
    case 32: for_group(std::integral_constant<int64_t, 32>{}); break;
    case 64: for_group(std::integral_constant<int64_t, 64>{}); break;
    case 96: for_group(std::integral_constant<int64_t, 96>{}); break;
    case 128: for_group(std::integral_constant<int64_t, 128>{}); break;
    case 256: for_group(std::integral_constant<int64_t, 256>{}); break;
    default: return -1;
  }
  return 0;
}


// Returns 0, or -1 for a shape this kernel does not cover. query/out [T, heads, head_dim], the
// chunks back to back; query_start [seqs + 1] int32; context_lens [seqs] int32: tokens in the
// cache after this step's chunk; tables [seqs, table_width]; lse [T, heads] or null; window and
// softcap as for the decode.
int conveyor_paged_prefill_f32(const float* query, const float* k_cache, const float* v_cache,
                               const int32_t* tables, const int32_t* query_start,
                               const int32_t* context_lens, float* out, float* lse, int64_t seqs,
                               int64_t heads, int64_t kv_heads, int64_t head_dim,
                               int64_t table_width, float scale, int threads, int64_t window,
                               float softcap) {
  if (kv_heads < 1 || heads % kv_heads != 0 || heads / kv_heads > kMaxGroup) return -1;
  const auto run = [&](auto d) {
    prefill<decltype(d)::value>(query, k_cache, v_cache, tables, query_start, context_lens, out,
                                lse, seqs, heads, kv_heads, table_width, scale, threads, window,
                                softcap);
  };
  switch (head_dim) {  // as native_paged_f32.HEAD_DIMS
    case 16: run(std::integral_constant<int64_t, 16>{}); break;
    case 32: run(std::integral_constant<int64_t, 32>{}); break;
    case 64: run(std::integral_constant<int64_t, 64>{}); break;
    case 96: run(std::integral_constant<int64_t, 96>{}); break;
    case 128: run(std::integral_constant<int64_t, 128>{}); break;
    case 256: run(std::integral_constant<int64_t, 256>{}); break;
    default: return -1;
  }
  return 0;
}

// Writes this step's keys and values into their cache slots (kv_slots.h).
void conveyor_write_kv_f32(const float* key, int64_t key_stride, const float* value,
                           int64_t value_stride, const int64_t* slots, float* k_cache,
                           float* v_cache, int64_t tokens, int64_t kv_heads, int64_t head_dim,
                           int threads) {
  conveyor::write_kv(key, key_stride, value, value_stride, slots, k_cache, v_cache, tokens,
                     kv_heads, head_dim, threads);
}

}  // extern "C"
