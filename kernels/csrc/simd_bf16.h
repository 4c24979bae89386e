// What the AVX512-BF16 kernels in this folder share: bfloat16 loads and stores rounded as torch
// rounds, a vector e^x, SiLU and soft cap.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace conveyor {

inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> float32
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

inline __m512 load16(const uint16_t* p, __mmask16 lanes) {  // the lanes of `lanes`; others 0
  const __m256i half = _mm256_maskz_loadu_epi16(lanes, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline __m256i to_bf16(__m512 x) {  // round to nearest even, as torch does (NaN stays NaN)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
}

inline __m512 round_bf16(__m512 x) {  // x rounded to bfloat16 and back
  const __m256i h = to_bf16(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store16(uint16_t* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x));
}

inline void store16(uint16_t* p, __m512 x, __mmask16 lanes) {  // the lanes of `lanes` only
  _mm256_mask_storeu_epi16(p, lanes, to_bf16(x));
}

// e^x for 16 floats: 2^n * 2^f with f in [-0.5, 0.5], 2^f by its Taylor series to degree 7
// (relative error ~1e-7, as expf); x at or below -103, -inf and NaN give the smallest subnormal
// (1.4e-45), not 0; very large x gives inf.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.f)), _mm512_set1_ps(89.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381610e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// cap * tanh(x / cap) for 16 floats (Gemma 2's soft cap on attention scores), with
// tanh(y) = 1 - 2 / (e^{2y} + 1): exact at both ends, where e^{2y} is 0 or inf, and within ~1e-7
// of cap * tanh near 0, where the subtraction cancels (an absolute error, as the softmax sees it).
inline __m512 softcap16(__m512 x, float cap) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp16(_mm512_mul_ps(x, _mm512_set1_ps(2.f / cap)));
  const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
  return _mm512_mul_ps(t, _mm512_set1_ps(cap));
}

// x / (1 + e^-x) for 16 floats, rounded to bfloat16 as torch's SiLU of a bfloat16 tensor is
inline __m512 silu16(__m512 x) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
  return round_bf16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
}

}  // namespace conveyor
