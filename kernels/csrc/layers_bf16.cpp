// The decoder layer's elementwise steps in bfloat16 on x86 CPUs with AVX512-BF16: RMSNorm (with
// the residual add before it), rope, and SiLU(gate) * up; and a greedy step's pick, each row's
// first maximum. Each is one pass over its rows, called once per layer (or step) where eager
// torch makes several passes and inductor's compiled functions cost tens of microseconds a
// call to enter.
//
// Results are rounded to bfloat16 where the reference implementation (transformers' eager
// modules, and this engine's eager path) rounds them: the residual sum; the normalised row
// before the weight, and the product; x * cos and rotate(x) * sin, and their sum; SiLU(gate),
// and its product with up. Everything between is float32.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "simd_bf16.h"

namespace {

using conveyor::load16;
using conveyor::round_bf16;
using conveyor::silu16;
using conveyor::store16;

// Rows are split over threads only when there is enough work for each to pay for waking it.
constexpr int64_t kMinParallelElements = 1 << 15;

inline int threads_for(int64_t elements, int threads) {
  return elements >= kMinParallelElements ? threads : 1;
}

inline float value(const uint16_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

// The index of a row's first maximum; a NaN wins (the first one), and a row of -inf gives 0,
// as in torch.
int64_t first_max(const uint16_t* row, int64_t n) {
  const int64_t full = n / 16 * 16;
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i best_at = _mm512_set1_epi32(-1);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < full; i += 16) {
    const __m512 x = load16(row + i);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __mmask16 greater = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);  // strictly: first wins
    best = _mm512_mask_mov_ps(best, greater, x);
    best_at = _mm512_mask_mov_epi32(best_at, greater, at);
    at = _mm512_add_epi32(at, step);
  }
  alignas(64) float values[16];
  alignas(64) int32_t where[16];
  _mm512_store_ps(values, best);
  _mm512_store_si512(where, best_at);
  int64_t result = -1;
  float top = -std::numeric_limits<float>::infinity();
  for (int lane = 0; lane < 16; ++lane) {  // the largest value; among equals, the first index
    if (where[lane] < 0) continue;
    if (result < 0 || values[lane] > top || (values[lane] == top && where[lane] < result)) {
      top = values[lane];
      result = where[lane];
    }
  }
  for (int64_t i = full; i < n; ++i) {
    const float x = value(row + i);
    nan |= static_cast<__mmask16>(x != x);
    if (x > top) {
      top = x;
      result = i;
    }
  }
  if (nan) {
    for (int64_t i = 0; i < n; ++i) {
      const float x = value(row + i);
      if (x != x) return i;
    }
  }
  return result < 0 ? 0 : result;  // every value -inf: the first, as torch
}

// Rope's 16 lanes from c of one head: x[c..], x[half + c..] into o likewise, by `load` and
// `store` (whole vectors, or masked to half a vector).
template <typename Load, typename Store>
inline void rope16(const uint16_t* x, const uint16_t* cr, const uint16_t* sr, uint16_t* o,
                   int64_t half, int64_t c, Load load, Store store) {
  const __m512 lo = load(x + c), hi = load(x + half + c);
  const __m512 neg_hi = _mm512_sub_ps(_mm512_setzero_ps(), hi);
  const __m512 lo_cos = round_bf16(_mm512_mul_ps(lo, load(cr + c)));
  const __m512 hi_cos = round_bf16(_mm512_mul_ps(hi, load(cr + half + c)));
  const __m512 lo_sin = round_bf16(_mm512_mul_ps(neg_hi, load(sr + c)));
  const __m512 hi_sin = round_bf16(_mm512_mul_ps(lo, load(sr + half + c)));
  store(o + c, _mm512_add_ps(lo_cos, lo_sin));
  store(o + half + c, _mm512_add_ps(hi_cos, hi_sin));
}

}  // namespace

extern "C" {

// out[r] = weight * round(s * rsqrt(mean(s^2) + eps)), s = x[r] (+ residual[r], rounded; then
// written back to residual[r]). x rows are `x_stride` elements apart; residual and out are
// [rows, dim]; dim a multiple of 16. residual may be null.
void conveyor_rms_norm_bf16(const uint16_t* x, int64_t x_stride, uint16_t* residual,
                            const uint16_t* weight, uint16_t* out, int64_t rows, int64_t dim,
                            float eps, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * dim, threads))
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * x_stride;
    uint16_t* res = residual == nullptr ? nullptr : residual + r * dim;
    const uint16_t* src = res == nullptr ? xr : res;  // the row that is normalised
    __m512 squares = _mm512_setzero_ps();
    for (int64_t c = 0; c < dim; c += 16) {
      __m512 s = load16(xr + c);
      if (res != nullptr) {
        s = round_bf16(_mm512_add_ps(s, load16(res + c)));
        store16(res + c, s);
      }
      squares = _mm512_fmadd_ps(s, s, squares);
    }
    const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(dim);
    const __m512 scale = _mm512_set1_ps(1.f / std::sqrt(mean + eps));
    uint16_t* o = out + r * dim;
    for (int64_t c = 0; c < dim; c += 16) {
      const __m512 normed = round_bf16(_mm512_mul_ps(load16(src + c), scale));
      store16(o + c, _mm512_mul_ps(load16(weight + c), normed));
    }
  }
}

// out[r, i] = round(round(silu(gate[r, i])) * up[r, i]) with gate the first `inter` columns of
// each input row and up the next `inter`; input rows `in_stride` apart, out [rows, inter];
// inter a multiple of 16.
void conveyor_silu_mul_bf16(const uint16_t* gate_up, int64_t in_stride, uint16_t* out,
                            int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * inter, threads))
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* g = gate_up + r * in_stride;
    const uint16_t* u = g + inter;
    uint16_t* o = out + r * inter;
    for (int64_t c = 0; c < inter; c += 16) {
      store16(o + c, _mm512_mul_ps(silu16(load16(g + c)), load16(u + c)));
    }
  }
}

// Rope in the half-rotation layout: out = round(round(x * cos) + round(rotate(x) * sin)) with
// rotate(x) = (-x[half:], x[:half]), for every head of q ([rows, q_heads, dim] at row stride
// `q_stride`) into q_out ([rows, q_heads, dim]) and of k into k_out likewise. cos and sin are
// [rows, dim]; dim a multiple of 16.
void conveyor_rope_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride,
                        const uint16_t* cos, const uint16_t* sin, uint16_t* q_out,
                        uint16_t* k_out, int64_t rows, int64_t q_heads, int64_t k_heads,
                        int64_t dim, int threads) {
  const int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads_for(rows * (q_heads + k_heads) * dim, threads))
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* cr = cos + r * dim;
    const uint16_t* sr = sin + r * dim;
    for (int64_t h = 0; h < q_heads + k_heads; ++h) {
      const bool is_q = h < q_heads;
      const int64_t head = is_q ? h : h - q_heads;
      const uint16_t* x = (is_q ? q + r * q_stride : k + r * k_stride) + head * dim;
      uint16_t* o = (is_q ? q_out + r * q_heads * dim : k_out + r * k_heads * dim) + head * dim;
      int64_t c = 0;
      for (; c + 16 <= half; c += 16)
        rope16(x, cr, sr, o, half, c, [](const uint16_t* p) { return load16(p); },
               [](uint16_t* p, __m512 v) { store16(p, v); });
      if (c < half) {  // a half of 8 more (heads of 16, 48, 80, ...): half a vector
        const __mmask16 m = static_cast<__mmask16>((1u << (half - c)) - 1);
        rope16(x, cr, sr, o, half, c, [m](const uint16_t* p) { return load16(p, m); },
               [m](uint16_t* p, __m512 v) { store16(p, v, m); });
      }
    }
  }
}

// out[r] = the index of row r's first maximum; rows `stride` elements apart.
void conveyor_argmax_bf16(const uint16_t* x, int64_t rows, int64_t n, int64_t stride,
                          int64_t* out, int threads) {
#pragma omp parallel for num_threads(rows >= 8 ? threads : 1)
  for (int64_t r = 0; r < rows; ++r) out[r] = first_max(x + r * stride, n);
}
}
