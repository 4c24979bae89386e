// The decoder layer's elementwise steps in float32 on x86 CPUs with AVX2 and FMA: RMSNorm (with
// the residual add before it), rope, and SiLU(gate) * up. Each is one pass over its rows,
// called once per layer where eager torch makes several passes and inductor's compiled
// functions cost tens of microseconds a call to enter.
//
// Built with -ffp-contract=off, so that a product and a sum are never fused into one rounding:
// the residual sum, rope and the product with up are eager torch's bit for bit, the norm is
// but for the order of its sum of squares, and SiLU's e^x is `exp8` (within ~1e-7 of torch's).
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "simd_avx2.h"

namespace {

using conveyor::silu8;

// Rows are split over threads only when there is enough work for each to pay for waking it.
constexpr int64_t kMinParallelElements = 1 << 15;

inline int threads_for(int64_t elements, int threads) {
  return elements >= kMinParallelElements ? threads : 1;
}

inline float sum8(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

}  // namespace

extern "C" {

// out[r] = weight * (s * (1 / sqrt(mean(s^2) + eps))), s = x[r] (+ residual[r], then written back
// to residual[r]). x rows are `x_stride` elements apart; residual and out are [rows, dim]; dim a
// multiple of 8. residual may be null.
void conveyor_rms_norm_f32(const float* x, int64_t x_stride, float* residual, const float* weight,
                           float* out, int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * dim, threads))
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    float* res = residual == nullptr ? nullptr : residual + r * dim;
    const float* src = res == nullptr ? xr : res;  // the row that is normalised
    __m256 squares = _mm256_setzero_ps();
    for (int64_t c = 0; c < dim; c += 8) {
      __m256 s = _mm256_loadu_ps(xr + c);
      if (res != nullptr) {
        s = _mm256_add_ps(s, _mm256_loadu_ps(res + c));
        _mm256_storeu_ps(res + c, s);
      }
      squares = _mm256_fmadd_ps(s, s, squares);
    }
    const float mean = sum8(squares) / static_cast<float>(dim);
    const __m256 scale = _mm256_set1_ps(1.f / std::sqrt(mean + eps));
    float* o = out + r * dim;
    for (int64_t c = 0; c < dim; c += 8) {
      const __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(src + c), scale);
      _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(weight + c), normed));
    }
  }
}

// out[r, i] = silu(gate[r, i]) * up[r, i], silu(x) = x / (1 + e^-x), with gate the first `inter`
// columns of each input row and up the next `inter`; input rows `in_stride` apart, out
// [rows, inter]; inter a multiple of 8.
void conveyor_silu_mul_f32(const float* gate_up, int64_t in_stride, float* out, int64_t rows,
                           int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * inter, threads))
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * in_stride;
    const float* u = g + inter;
    float* o = out + r * inter;
    for (int64_t c = 0; c < inter; c += 8) {
      const __m256 silu = silu8(_mm256_loadu_ps(g + c));
      _mm256_storeu_ps(o + c, _mm256_mul_ps(silu, _mm256_loadu_ps(u + c)));
    }
  }
}

// Rope in the half-rotation layout: out = x * cos + rotate(x) * sin with rotate(x) =
// (-x[half:], x[:half]), for every head of q ([rows, q_heads, dim] at row stride `q_stride`)
// into q_out ([rows, q_heads, dim]) and of k into k_out likewise. cos and sin are [rows, dim];
// dim a multiple of 16.
void conveyor_rope_f32(const float* q, int64_t q_stride, const float* k, int64_t k_stride,
                       const float* cos, const float* sin, float* q_out, float* k_out,
                       int64_t rows, int64_t q_heads, int64_t k_heads, int64_t dim, int threads) {
  const int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads_for(rows * (q_heads + k_heads) * dim, threads))
  for (int64_t r = 0; r < rows; ++r) {
    const float* cr = cos + r * dim;
    const float* sr = sin + r * dim;
    for (int64_t h = 0; h < q_heads + k_heads; ++h) {
      const bool is_q = h < q_heads;
      const int64_t head = is_q ? h : h - q_heads;
      const float* x = (is_q ? q + r * q_stride : k + r * k_stride) + head * dim;
      float* o = (is_q ? q_out + r * q_heads * dim : k_out + r * k_heads * dim) + head * dim;
      for (int64_t c = 0; c < half; c += 8) {
        const __m256 lo = _mm256_loadu_ps(x + c), hi = _mm256_loadu_ps(x + half + c);
        const __m256 neg_hi = _mm256_xor_ps(hi, _mm256_set1_ps(-0.f));
        const __m256 lo_cos = _mm256_mul_ps(lo, _mm256_loadu_ps(cr + c));
        const __m256 hi_cos = _mm256_mul_ps(hi, _mm256_loadu_ps(cr + half + c));
        const __m256 lo_sin = _mm256_mul_ps(neg_hi, _mm256_loadu_ps(sr + c));
        const __m256 hi_sin = _mm256_mul_ps(lo, _mm256_loadu_ps(sr + half + c));
        _mm256_storeu_ps(o + c, _mm256_add_ps(lo_cos, lo_sin));
        _mm256_storeu_ps(o + half + c, _mm256_add_ps(hi_cos, hi_sin));
      }
    }
  }
}
}
