// A mixture-of-experts layer's routed experts in bfloat16, around a kernel that runs one expert's
// rows (experts_bf16.cpp's dot products, experts_amx.cpp's tiles): the (token, expert) pairs
// sorted by expert (stably, as torch.sort(stable=True) sorts them), each expert's tokens copied
// into a buffer of whole tiles of 16 rows, its SwiGLU, and each token's k output rows times
// their routing weights, summed. One pass where torch's version is a sort, a gather, two
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
#include <vector>

#include "simd_bf16.h"

namespace conveyor {

constexpr int64_t kTileRows = 16;

inline int64_t whole_tiles(int64_t rows) { return (rows + kTileRows - 1) / kTileRows * kTileRows; }

// in place over each row's first `inter` columns: round(round(silu(gate)) * up), up the next
// `inter`
inline void silu_mul(uint16_t* h, int64_t rows, int64_t inter) {
  for (int64_t m = 0; m < rows; ++m) {
    uint16_t* g = h + m * 2 * inter;
    for (int64_t c = 0; c < inter; c += 16)
      store16(g + c, _mm512_mul_ps(silu16(load16(g + c)), load16(g + inter + c)));
  }
}

// Expert: begin() and end() around a thread's experts, and run(a, rows, padded, gate_up, down,
// h, o, hidden, inter): o [rows, hidden] = down(silu(gate) * up) of a [padded, hidden] (rows
// past `rows` zero), with h [padded, 2 * inter] its scratch; hidden a multiple of 32, inter of
// 16.
//
// x [tokens, hidden]; top_index [tokens, k]; weights [tokens, k], float32 where weights_f32,
// else bfloat16; gate_up [E, 2 * inter / 32, hidden / 2, 32, 2] and down [E, hidden / 32,
// inter / 2, 32, 2] in strips of k pairs; outs [tokens * k, hidden] scratch (each pair's expert output, in expert order);
// result [tokens, hidden].
template <class Expert>
void routed_experts(const uint16_t* x, const int64_t* top_index, const void* weights,
                    bool weights_f32, const uint16_t* gate_up, const uint16_t* down,
                    uint16_t* outs, uint16_t* result, int64_t tokens, int64_t k,
                    int64_t experts, int64_t hidden, int64_t inter, int threads) {
  const int64_t pairs = tokens * k;
  // a counting sort of the pairs by expert: order[i] the pair at place i, place[pair] its place
  std::vector<int64_t> starts(experts + 1, 0), order(pairs), place(pairs);
  for (int64_t p = 0; p < pairs; ++p) ++starts[top_index[p] + 1];
  int64_t most = 0;
  for (int64_t e = 0; e < experts; ++e) {
    most = std::max(most, starts[e + 1]);
    starts[e + 1] += starts[e];
  }
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    place[p] = next[top_index[p]]++;
    order[place[p]] = p;
  }
  const auto* w16 = static_cast<const uint16_t*>(weights);
  const auto* w32 = static_cast<const float*>(weights);
#pragma omp parallel num_threads(threads)
  {
    const int64_t padded_most = whole_tiles(most);
    std::vector<uint16_t> a(padded_most * hidden), h(padded_most * 2 * inter);
    Expert expert;
    expert.begin();
#pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t first = starts[e], n = starts[e + 1] - first;
      if (n == 0) continue;
      const int64_t padded = whole_tiles(n);
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(&a[i * hidden], x + order[first + i] / k * hidden, hidden * sizeof(uint16_t));
      std::memset(&a[n * hidden], 0, (padded - n) * hidden * sizeof(uint16_t));
      expert.run(a.data(), n, padded, gate_up + e * hidden * 2 * inter,
                 down + e * inter * hidden, h.data(), outs + first * hidden, hidden, inter);
    }
    expert.end();
#pragma omp for
    for (int64_t t = 0; t < tokens; ++t) {
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
