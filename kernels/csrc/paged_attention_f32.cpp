// Paged decode attention in float32 for x86 CPUs with AVX2 and FMA (the CPUs where the engine
// computes in float32: no fast bfloat16 products), K/V blocks read in place through the block
// table, one query token per sequence.
//
// It honours a sliding window (a query sees the last `window` positions; 0: all of them) and a
// soft cap on the scores (cap * tanh(score / cap); 0: none), as transformers computes them.
//
// Work is split over (sequence, KV head) pairs, and the query heads that share a KV head are
// computed together, so each K/V row is read once per step. The softmax is online, per block of
// 16 keys; sums are float32 throughout, in another order than torch's.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

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

// G: the query heads per KV head when it is a compile-time constant (the loops over them
// unrolled), or 0 for any count.
template <int64_t D, int64_t G>
void decode(const float* query, const float* k_cache, const float* v_cache, const int32_t* tables,
            const int32_t* context_lens, float* out, float* lse, int64_t batch, int64_t heads,
            int64_t kv_heads, int64_t table_width, float scale, int threads, int64_t window,
            float softcap) {
  constexpr int64_t V = D / 8;  // 8 floats per vector
  const int64_t group = G > 0 ? G : heads / kv_heads;
  const int64_t block_stride = kv_heads * kBlock * D;
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t tasks = batch * kv_heads;
  const auto first_key = [window](int64_t context) {
    return window > 0 ? std::max<int64_t>(context - window, 0) : int64_t{0};
  };
  // Tasks dealt round-robin: a thread knows its next task, and asks for that task's first blocks
  // while it finishes this one
#pragma omp parallel for schedule(static, 1) num_threads(threads)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t b = task / kv_heads, kvh = task % kv_heads;
    const int64_t next_task = task + omp_get_num_threads();
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
            _mm_prefetch(reinterpret_cast<const char*>(k_cache + next) + line, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(v_cache + next) + line, _MM_HINT_T0);
          }
      }
      for (int64_t g = 0; g < group; ++g) {
        alignas(32) float scores[kBlock];
        for (int64_t half = 0; half < kBlock; half += 8) {
          __m256 dots[8];
          for (int64_t j = 0; j < 8; ++j) {
            __m256 a = _mm256_setzero_ps();
            if (half + j < n) {
              const float* row = k + (half + j) * D;
              for (int64_t c = 0; c < V; ++c)
                a = _mm256_fmadd_ps(_mm256_load_ps(q[g] + c * 8), _mm256_loadu_ps(row + c * 8), a);
            }
            dots[j] = a;
          }
          _mm256_store_ps(scores + half, _mm256_mul_ps(sum_each8(dots), _mm256_set1_ps(scale)));
        }
        float m = top[g];
        for (int64_t j = 0; j < kBlock; ++j) {
          if (j < skip || j >= n) {
            scores[j] = ninf;
            continue;
          }
          if (softcap > 0.f) scores[j] = softcap * std::tanh(scores[j] / softcap);
          m = std::max(m, scores[j]);
        }
        float sum = 0.f;
        for (int64_t half = 0; half < kBlock; half += 8) {
          const __m256 s = _mm256_sub_ps(_mm256_load_ps(scores + half), _mm256_set1_ps(m));
          _mm256_store_ps(probs[g] + half, exp8(s));
        }
        for (int64_t j = 0; j < kBlock; ++j) {
          if (j < skip || j >= n) probs[g][j] = 0.f;
          sum += probs[g][j];
        }
        const float rescale = std::exp(top[g] - m);  // 0 on the first block (top is -inf)
        total[g] = total[g] * rescale + sum;
        const __m256 r = _mm256_set1_ps(rescale);
        for (int64_t c = 0; c < V; ++c)
          _mm256_store_ps(acc[g] + c * 8, _mm256_mul_ps(_mm256_load_ps(acc[g] + c * 8), r));
        top[g] = m;
      }
      for (int64_t j = skip; j < n; ++j) {
        __m256 row[V];
        for (int64_t c = 0; c < V; ++c) row[c] = _mm256_loadu_ps(v + j * D + c * 8);
        for (int64_t g = 0; g < group; ++g) {
          const __m256 pj = _mm256_set1_ps(probs[g][j]);
          for (int64_t c = 0; c < V; ++c)
            _mm256_store_ps(acc[g] + c * 8,
                            _mm256_fmadd_ps(pj, row[c], _mm256_load_ps(acc[g] + c * 8)));
        }
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kvh * group + g;
      const float inv = 1.f / total[g];
      for (int64_t d = 0; d < D; ++d) out[(b * heads + h) * D + d] = acc[g][d] * inv;
      if (lse != nullptr) lse[b * heads + h] = top[g] + std::log(total[g]);
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

}  // extern "C"
