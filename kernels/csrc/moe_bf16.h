// A mixture-of-experts layer's routed experts in bfloat16, around a kernel that runs one expert's
// rows (experts_bf16.cpp's dot products, experts_amx.cpp's tiles): the (token, expert) pairs
// sorted by expert (stably, as torch.sort(stable=True) sorts them), each expert's tokens copied
// into a buffer of whole tiles of 16 rows, its SwiGLU (the gate/up product and activation, then
// the down product, each in tasks of whole experts or of parts of their columns), and each
// token's k output rows times their routing weights, summed. One pass where torch's version is a sort, a gather, two
// products, the activation, a product by the weights, a scatter and a sum, each a pass over
// memory (at 4,096 tokens the scatter and sum alone took longer than the experts' products).
//
// Rounded as transformers' bfloat16 experts round: each product's output, SiLU(gate) and its
// product with up (the kernel's part), the output times a bfloat16 weight (a float32 weight
// gives a float32 product), and the sum of a token's k rows, summed in float32 in k order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "simd_bf16.h"

namespace conveyor {

constexpr int64_t kTileRows = 16;

inline int64_t whole_tiles(int64_t rows) { return (rows + kTileRows - 1) / kTileRows * kTileRows; }

// in place over each row's columns [c0, c1) of its first `inter`: round(round(silu(gate)) * up),
// up `inter` columns further
inline void silu_mul(uint16_t* h, int64_t rows, int64_t inter, int64_t c0, int64_t c1) {
  for (int64_t m = 0; m < rows; ++m) {
    uint16_t* g = h + m * 2 * inter;
    for (int64_t c = c0; c < c1; c += 16)
      store16(g + c, _mm512_mul_ps(silu16(load16(g + c)), load16(g + inter + c)));
  }
}

// How many tasks to cut each expert's `strips` of 32 columns into: whole experts where there
// are several for each thread (each thread then reads an expert's weights alone, front to
// back), else parts of them, so that a model of few experts (Mixtral: 8) keeps every core busy.
inline int64_t parts_of(int64_t strips, int64_t experts, int threads) {
  const int64_t wanted = (4 * threads + experts - 1) / experts;
  return std::max<int64_t>(1, std::min(wanted, strips));
}

// Kernel: begin() and end() around a thread's products, and product(a, lda, b, c, ldc, rows,
// padded, k_dim, n0, n1): c[m, n] = round(sum_k a[m, k] * b[k, n]) for m < rows and n in
// [n0, n1) (multiples of 32), a [padded, k_dim] rows `lda` apart (padded: rows in whole
// tiles, those past `rows` read or not, their results dropped), b one expert's weight in
// strips of k pairs [n / 32, k_dim / 2, 32, 2].
//
// x [tokens, hidden]; top_index [tokens, k]; weights [tokens, k], float32 where weights_f32,
// else bfloat16; gate_up [E, 2 * inter / 32, hidden / 2, 32, 2] and down [E, hidden / 32,
// inter / 2, 32, 2]; outs [tokens * k, hidden] scratch (each pair's expert output, in expert
// order); result [tokens, hidden]. hidden and inter multiples of 32.
template <class Kernel>
void routed_experts(const uint16_t* x, const int64_t* top_index, const void* weights,
                    bool weights_f32, const uint16_t* gate_up, const uint16_t* down,
                    uint16_t* outs, uint16_t* result, int64_t tokens, int64_t k,
                    int64_t experts, int64_t hidden, int64_t inter, int threads) {
  const int64_t pairs = tokens * k;
  // a counting sort of the pairs by expert: order[i] the pair at place i, place[pair] its place
  std::vector<int64_t> starts(experts + 1, 0), order(pairs), place(pairs);
  for (int64_t p = 0; p < pairs; ++p) ++starts[top_index[p] + 1];
  for (int64_t e = 0; e < experts; ++e) starts[e + 1] += starts[e];
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    place[p] = next[top_index[p]]++;
    order[place[p]] = p;
  }
  // the experts that have rows, and where each one's rows start in whole tiles
  std::vector<int64_t> active, padded_start(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = starts[e + 1] - starts[e];
    if (n > 0) active.push_back(e);
    padded_start[e + 1] = padded_start[e] + whole_tiles(n);
  }
  const int64_t count = static_cast<int64_t>(active.size());
  const int64_t up_parts = parts_of(inter / 32, count, threads);
  const int64_t down_parts = parts_of(hidden / 32, count, threads);
  const bool whole = up_parts == 1 && down_parts == 1;
  const auto* w16 = static_cast<const uint16_t*>(weights);
  const auto* w32 = static_cast<const float*>(weights);
  // each expert's tokens into `rows`, the rest of its tiles zero
  auto gather = [&](int64_t e, uint16_t* rows) {
    const int64_t n = starts[e + 1] - starts[e];
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(rows + r * hidden, x + order[starts[e] + r] / k * hidden,
                  hidden * sizeof(uint16_t));
    std::memset(rows + n * hidden, 0, (whole_tiles(n) - n) * hidden * sizeof(uint16_t));
  };
  // gate and up of expert e's columns [c0, c1) of its `inter` into h, and SiLU(gate) * up
  auto up = [&](Kernel& kernel, int64_t e, const uint16_t* rows, uint16_t* h, int64_t c0,
                int64_t c1) {
    const int64_t n = starts[e + 1] - starts[e], padded = whole_tiles(n);
    const uint16_t* w = gate_up + e * hidden * 2 * inter;
    kernel.product(rows, hidden, w, h, 2 * inter, n, padded, hidden, c0, c1);
    kernel.product(rows, hidden, w, h, 2 * inter, n, padded, hidden, inter + c0, inter + c1);
    silu_mul(h, n, inter, c0, c1);
  };
  // the down product of expert e's output columns [c0, c1)
  auto down_part = [&](Kernel& kernel, int64_t e, const uint16_t* h, int64_t c0, int64_t c1) {
    const int64_t n = starts[e + 1] - starts[e];
    kernel.product(h, 2 * inter, down + e * inter * hidden, outs + starts[e] * hidden, hidden,
                   n, whole_tiles(n), inter, c0, c1);
  };
  // split: every expert's rows and activations at once, their tasks spread over the threads
  std::unique_ptr<uint16_t[]> a_all, h_all;
  if (!whole) {
    a_all.reset(new uint16_t[padded_start[experts] * hidden]);
    h_all.reset(new uint16_t[padded_start[experts] * 2 * inter]);
  }
#pragma omp parallel num_threads(threads)
  {
    Kernel kernel;
    kernel.begin();
    if (whole) {  // one expert a task, its rows and activations in the thread's cache
      int64_t most = 0;
      for (int64_t e : active) most = std::max(most, whole_tiles(starts[e + 1] - starts[e]));
      std::unique_ptr<uint16_t[]> rows(new uint16_t[most * hidden]);
      std::unique_ptr<uint16_t[]> h(new uint16_t[most * 2 * inter]);
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < count; ++i) {
        gather(active[i], rows.get());
        up(kernel, active[i], rows.get(), h.get(), 0, inter);
        down_part(kernel, active[i], h.get(), 0, hidden);
      }
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < count; ++i)
        gather(active[i], a_all.get() + padded_start[active[i]] * hidden);
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < count * up_parts; ++task) {
        const int64_t e = active[task / up_parts], part = task % up_parts, strips = inter / 32;
        up(kernel, e, a_all.get() + padded_start[e] * hidden,
           h_all.get() + padded_start[e] * 2 * inter, part * strips / up_parts * 32,
           (part + 1) * strips / up_parts * 32);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < count * down_parts; ++task) {
        const int64_t e = active[task / down_parts], part = task % down_parts;
        const int64_t strips = hidden / 32;
        down_part(kernel, e, h_all.get() + padded_start[e] * 2 * inter,
                  part * strips / down_parts * 32, (part + 1) * strips / down_parts * 32);
      }
    }
    kernel.end();
#pragma omp for
    for (int64_t t = 0; t < tokens; ++t) {  // each token's outputs times their weights, summed
      for (int64_t c = 0; c < hidden; c += 16) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; ++j) {
          const int64_t p = t * k + j;
          const __m512 w = _mm512_set1_ps(weights_f32 ? w32[p] : bf16_to_float(w16[p]));
          const __m512 v = _mm512_mul_ps(load16(outs + place[p] * hidden + c), w);
          sum = _mm512_add_ps(sum, weights_f32 ? v : round_bf16(v));
        }
        store16(result + t * hidden + c, sum);
      }
    }
  }
}

}  // namespace conveyor
