// What the bfloat16 experts kernels (experts_bf16.cpp, experts_amx.cpp) share around their
// products, for moe_routing.h: SiLU(gate) * up and a token's weighted sum, rounded as
// transformers' bfloat16 experts round: each product's output (the kernels' part), SiLU(gate)
// and its product with up, the output times a bfloat16 weight (a float32 weight gives a float32
// product), and the sum of a token's k rows, summed in float32 in k order.
#pragma once

#include <cstdint>

#include "moe_routing.h"
#include "simd_bf16.h"

namespace conveyor {

struct Bf16Elementwise {
  using Element = uint16_t;
  using Weight = uint16_t;
  static constexpr int64_t kColumns = 32;  // a strip of the weights' layout

  void silu_mul(uint16_t* h, int64_t rows, int64_t inter, int64_t c0, int64_t c1) {
    for (int64_t m = 0; m < rows; ++m) {
      uint16_t* g = h + m * 2 * inter;
      for (int64_t c = c0; c < c1; c += 16)
        store16(g + c, _mm512_mul_ps(silu16(load16(g + c)), load16(g + inter + c)));
    }
  }

  static void combine(const uint16_t* outs, const int64_t* place, const void* weights,
                      bool weights_f32, int64_t first, int64_t k, int64_t hidden,
                      uint16_t* out) {
    const auto* w16 = static_cast<const uint16_t*>(weights);
    const auto* w32 = static_cast<const float*>(weights);
    for (int64_t c = 0; c < hidden; c += 16) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < k; ++j) {
        const int64_t p = first + j;
        const __m512 w = _mm512_set1_ps(weights_f32 ? w32[p] : bf16_to_float(w16[p]));
        const __m512 v = _mm512_mul_ps(load16(outs + place[p] * hidden + c), w);
        sum = _mm512_add_ps(sum, weights_f32 ? v : round_bf16(v));
      }
      store16(out + c, sum);
    }
  }
};

}  // namespace conveyor
