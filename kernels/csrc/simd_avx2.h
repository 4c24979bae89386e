// What the AVX2 (and FMA) float32 kernels in this folder share: a vector e^x and SiLU, those of
// simd_f32.h on AVX2's 8 lanes.
#pragma once

#include <immintrin.h>

#include "simd_f32.h"

namespace conveyor {

// e^x for 8 floats (relative error ~1e-7, as expf); x at or below -103, -inf and NaN give the
// smallest subnormal (1.4e-45), not 0; very large x gives inf.
inline __m256 exp8(__m256 x) { return avx2::exp(x); }

// silu(x) = x / (1 + e^-x) for 8 floats, as torch computes it but for `exp8`'s rounding.
inline __m256 silu8(__m256 x) { return avx2::silu(x); }

}  // namespace conveyor
