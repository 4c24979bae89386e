// float32 vectors: AVX2's 8 lanes (namespace conveyor::avx2) and, built with CONVEYOR_AVX512
// defined, AVX-512's 16 (conveyor::avx512). conveyor::f32 names the widest the build has. A
// kernel written on f32 runs the same operations on each lane whichever it is built for, so
// both builds give the same results bit for bit. Also e^x and SiLU on them (simd_f32_math.h),
// and lane masks (`Mask`: a compare's result, which lanes to keep).
#pragma once

#include <immintrin.h>

#include <cstdint>

#ifdef CONVEYOR_AVX512
namespace conveyor::avx512 {

using Vec = __m512;
using Ints = __m512i;
constexpr int64_t kLanes = 16;
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
// 16 bfloat16 values (each a float32's upper 16 bits) as the float32 values they are, exactly
inline Vec load(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
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
using Mask = __mmask16;
inline Mask less_equal(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
inline Mask not_equal(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_UQ); }
inline Mask both(Mask a, Mask b) { return a & b; }
// lane by lane: a where the mask is set, else b
inline Vec select(Mask m, Vec a, Vec b) { return _mm512_mask_blend_ps(m, b, a); }
inline Vec zero_unless(Mask m, Vec a) { return _mm512_maskz_mov_ps(m, a); }

#include "simd_f32_math.h"

}  // namespace conveyor::avx512

namespace conveyor {
namespace f32 = avx512;
}
#endif

namespace conveyor::avx2 {

using Vec = __m256;
using Ints = __m256i;
constexpr int64_t kLanes = 8;
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
// 8 bfloat16 values (each a float32's upper 16 bits) as the float32 values they are, exactly
inline Vec load(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
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
using Mask = __m256;  // all bits of a lane set or none
inline Mask less_equal(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
inline Mask not_equal(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_NEQ_UQ); }
inline Mask both(Mask a, Mask b) { return _mm256_and_ps(a, b); }
inline Vec select(Mask m, Vec a, Vec b) { return _mm256_blendv_ps(b, a, m); }
inline Vec zero_unless(Mask m, Vec a) { return _mm256_and_ps(m, a); }

#include "simd_f32_math.h"

}  // namespace conveyor::avx2

#ifndef CONVEYOR_AVX512
namespace conveyor {
namespace f32 = avx2;
}
#endif
