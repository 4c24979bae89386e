// float32 vectors of the instruction set a kernel is built for: AVX2's 8 lanes, or with
// CONVEYOR_AVX512 defined AVX-512's 16. A kernel written on these runs the same operations on
// each lane whichever it is built for, so both builds give the same results bit for bit. Also
// e^x and SiLU on them.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace conveyor::f32 {

#ifdef CONVEYOR_AVX512
using Vec = __m512;
using Ints = __m512i;
constexpr int64_t kLanes = 16;
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
// the first n lanes (the rest of a load zero; of a store untouched)
inline Vec load_first(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline void store_first(float* p, Vec v, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
}
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec negate(Vec a) { return _mm512_xor_ps(a, _mm512_set1_ps(-0.f)); }
inline Vec round_even(Vec a) {
  return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Ints to_ints(Vec a) { return _mm512_cvtps_epi32(a); }
inline Ints sub_ints(Ints a, Ints b) { return _mm512_sub_epi32(a, b); }
inline Ints add_ints(Ints a, Ints b) { return _mm512_add_epi32(a, b); }
inline Ints set1_ints(int32_t x) { return _mm512_set1_epi32(x); }
inline Vec exponent_bits(Ints biased) { return _mm512_castsi512_ps(_mm512_slli_epi32(biased, 23)); }
#else
using Vec = __m256;
using Ints = __m256i;
constexpr int64_t kLanes = 8;
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec negate(Vec a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.f)); }
inline Vec round_even(Vec a) {
  return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Ints to_ints(Vec a) { return _mm256_cvtps_epi32(a); }
inline Ints sub_ints(Ints a, Ints b) { return _mm256_sub_epi32(a, b); }
inline Ints add_ints(Ints a, Ints b) { return _mm256_add_epi32(a, b); }
inline Ints set1_ints(int32_t x) { return _mm256_set1_epi32(x); }
inline Vec exponent_bits(Ints biased) { return _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)); }
#endif

// 2^n for integral n in [-150, 128], as two factors that are each a normal float.
inline Vec pow2(Vec n) {
  const Ints half = to_ints(mul(n, set1(0.5f)));
  const Ints rest = sub_ints(to_ints(n), half);
  const Ints bias = set1_ints(127);
  return mul(exponent_bits(add_ints(half, bias)), exponent_bits(add_ints(rest, bias)));
}

// e^x: 2^n * 2^f with f in [-0.5, 0.5], 2^f by its Taylor series to degree 7 (relative error
// ~1e-7, as expf); very negative x gives 0, very large x gives inf.
inline Vec exp(Vec x) {
  x = min(max(x, set1(-103.f)), set1(89.f));
  const Vec t = mul(x, set1(1.44269504088896341f));
  const Vec n = round_even(t);
  const Vec f = sub(t, n);
  Vec p = set1(1.5252733804059841e-05f);
  p = fmadd(p, f, set1(1.5403530393381610e-04f));
  p = fmadd(p, f, set1(1.3333558146428443e-03f));
  p = fmadd(p, f, set1(9.6181291076284772e-03f));
  p = fmadd(p, f, set1(5.5504108664821580e-02f));
  p = fmadd(p, f, set1(2.4022650695910071e-01f));
  p = fmadd(p, f, set1(6.9314718055994531e-01f));
  p = fmadd(p, f, set1(1.f));
  return mul(p, pow2(n));
}

// silu(x) = x / (1 + e^-x), as torch computes it but for `exp`'s rounding.
inline Vec silu(Vec x) { return div(x, add(set1(1.f), exp(negate(x)))); }

}  // namespace conveyor::f32
