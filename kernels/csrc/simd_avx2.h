// What the AVX2 (and FMA) float32 kernels in this folder share: a vector e^x and SiLU.
#pragma once

#include <immintrin.h>

namespace conveyor {

// 2^n for integral n in [-150, 128], as two factors that are each a normal float.
inline __m256 pow2(__m256 n) {
  const __m256i half = _mm256_cvtps_epi32(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)));
  const __m256i rest = _mm256_sub_epi32(_mm256_cvtps_epi32(n), half);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
  return _mm256_mul_ps(a, b);
}

// e^x for 8 floats: 2^n * 2^f with f in [-0.5, 0.5], 2^f by its Taylor series to degree 7
// (relative error ~1e-7, as expf); very negative x gives 0, very large x gives inf.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-103.f)), _mm256_set1_ps(89.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.5252733804059841e-05f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381610e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  return _mm256_mul_ps(p, pow2(n));
}

// silu(x) = x / (1 + e^-x) for 8 floats, as torch computes it but for `exp8`'s rounding.
inline __m256 silu8(__m256 x) {
  const __m256 e = exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.f)));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}

}  // namespace conveyor
