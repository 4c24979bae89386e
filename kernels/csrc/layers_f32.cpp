// The decoder layer's elementwise steps in float32 on x86 CPUs with AVX2 and FMA: RMSNorm (with
// the residual add before it), rope, and SiLU(gate) * up. Each is one pass over its rows,
// called once per layer where eager torch makes several passes and inductor's compiled
// functions cost tens of microseconds a call to enter. Also a greedy step's pick, each row's
// first maximum, in one pass (torch's max over a row of 32,000 runs at ~4.5 GB/s), and a sampled
// row's draw (`draw`, below).
//
// Built with -ffp-contract=off, so that a product and a sum are never fused into one rounding:
// the residual sum, rope and the product with up are eager torch's bit for bit, the norm is
// but for the order of its sum of squares, and SiLU's e^x is `exp8` (within ~1e-7 of torch's).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

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

// The index of a row's first maximum; a NaN wins (the first one), and a row of -inf gives 0,
// as in torch. Four vectors of running maxima, each lane keeping its first greatest (a strict
// compare), so that one compare's latency does not pace the loop; among lanes with the same
// value the lowest index wins.
int64_t first_max(const float* row, int64_t n) {
  constexpr int kChains = 4;
  const int64_t full = n / (8 * kChains) * (8 * kChains);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 best[kChains], nan = _mm256_setzero_ps();
  __m256i best_at[kChains], at[kChains];
  for (int c = 0; c < kChains; ++c) {
    best[c] = ninf;
    best_at[c] = _mm256_set1_epi32(-1);
    at[c] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * c));
  }
  const __m256i step = _mm256_set1_epi32(8 * kChains);
  for (int64_t i = 0; i < full; i += 8 * kChains) {
    for (int c = 0; c < kChains; ++c) {
      const __m256 x = _mm256_loadu_ps(row + i + 8 * c);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      const __m256 greater = _mm256_cmp_ps(x, best[c], _CMP_GT_OQ);
      best[c] = _mm256_blendv_ps(best[c], x, greater);
      best_at[c] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_at[c]),
                                                        _mm256_castsi256_ps(at[c]), greater));
      at[c] = _mm256_add_epi32(at[c], step);
    }
  }
  alignas(32) float values[8 * kChains];
  alignas(32) int32_t where[8 * kChains];
  for (int c = 0; c < kChains; ++c) {
    _mm256_store_ps(values + 8 * c, best[c]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(where + 8 * c), best_at[c]);
  }
  int64_t result = -1;
  float top = -std::numeric_limits<float>::infinity();
  for (int lane = 0; lane < 8 * kChains; ++lane) {
    if (where[lane] < 0) continue;
    if (result < 0 || values[lane] > top || (values[lane] == top && where[lane] < result)) {
      top = values[lane];
      result = where[lane];
    }
  }
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t i = full; i < n; ++i) {
    const float x = row[i];
    any_nan |= x != x;
    if (x > top) {
      top = x;
      result = i;
    }
  }
  if (any_nan) {
    for (int64_t i = 0; i < n; ++i)
      if (row[i] != row[i]) return i;
  }
  return result < 0 ? 0 : result;  // every value -inf: the first, as torch
}

// The weight of the last token of a row's nucleus: the largest weight v such that the tokens of
// weight >= v weigh at least `target` together (every token tied at v is in; the weights are
// those `draw` makes, before min_p). Weights are non-negative floats, so their bits order as
// their values do: a histogram of their weights by the top 10 bits finds the bucket the
// nucleus ends in, two more (the next 11 bits, the last 10, over that bucket's tokens alone)
// the weight itself. Three passes, no sort. Each bucket's weight is summed in float64 in the
// row's order: at the first level in four interleaved histograms (so that adds to one bucket
// do not wait on each other), then the four's sums added. Where rounding leaves the target
// above every bucket's sum, the whole row.
float nucleus_floor(const float* w, int64_t n, double target) {
  constexpr int kLevels = 3, kWays = 4;
  constexpr int kShift[kLevels] = {21, 10, 0};
  constexpr uint32_t kBuckets[kLevels] = {1024, 2048, 1024};
  alignas(32) double hist[kWays][2048];
  uint32_t prefix = 0;  // the bits chosen so far, in their places
  double above = 0.0;   // the weight of the tokens above the buckets still open
  for (int level = 0; level < kLevels; ++level) {
    const int shift = kShift[level];
    const uint32_t buckets = kBuckets[level], mask = buckets - 1;
    for (int k = 0; k < (level == 0 ? kWays : 1); ++k)
      std::fill(hist[k], hist[k] + buckets, 0.0);
    if (level == 0) {
      int64_t i = 0;
      // widened four at a time: a scalar widening writes only part of its register, so each
      // would wait on the add before it
      alignas(32) double wide[kWays];
      for (; i + kWays <= n; i += kWays) {
        _mm256_store_pd(wide, _mm256_cvtps_pd(_mm_loadu_ps(w + i)));
        for (int k = 0; k < kWays; ++k) {
          uint32_t bits;
          std::memcpy(&bits, w + i + k, sizeof bits);
          hist[k][(bits >> shift) & mask] += wide[k];
        }
      }
      for (; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, w + i, sizeof bits);
        hist[0][(bits >> shift) & mask] += w[i];
      }
    } else {  // only the tokens of the bucket chosen: eight compared at once
      const int prefix_shift = kShift[level - 1];
      const __m256i want = _mm256_set1_epi32(static_cast<int32_t>(prefix >> prefix_shift));
      alignas(32) double wide[8];
      for (int64_t i = 0; i < n; i += 8) {
        if (i + 8 <= n) {
          const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i));
          const __m256i hit = _mm256_cmpeq_epi32(_mm256_srli_epi32(bits, prefix_shift), want);
          if (_mm256_testz_si256(hit, hit)) continue;
          _mm256_store_pd(wide, _mm256_cvtps_pd(_mm_loadu_ps(w + i)));
          _mm256_store_pd(wide + 4, _mm256_cvtps_pd(_mm_loadu_ps(w + i + 4)));
        } else {
          for (int64_t j = i; j < n; ++j) wide[j - i] = w[j];
        }
        for (int64_t j = i; j < std::min(n, i + 8); ++j) {
          uint32_t bits;
          std::memcpy(&bits, w + j, sizeof bits);
          if ((bits >> prefix_shift) == (prefix >> prefix_shift))
            hist[0][(bits >> shift) & mask] += wide[j - i];
        }
      }
    }
    if (level == 0)  // the four histograms into the first, bucket by bucket
      for (uint32_t b = 0; b < buckets; ++b) hist[0][b] += hist[1][b] + hist[2][b] + hist[3][b];
    int64_t chosen = -1;
    for (int64_t b = buckets - 1; b >= 0; --b) {
      if (above + hist[0][b] >= target) {
        chosen = b;
        break;
      }
      above += hist[0][b];
    }
    if (chosen < 0) return 0.f;
    prefix |= static_cast<uint32_t>(chosen) << shift;
  }
  float floor;
  std::memcpy(&floor, &prefix, sizeof floor);
  return floor;
}

// A sampled row's token: the inverse of its distribution's cumulative sum at u. Weights
// w = e^(x / t - max / t) (a weight under min_p, the smallest share of the most likely token's
// that is kept, is 0; with top_p < 1, so is one past the nucleus, `nucleus_floor`, whose weight
// is made before min_p), summed in float64 in blocks of 64 (each block's sum in a fixed order,
// then the blocks one after another); the token is the first whose running sum passes u times
// the total: the block that passes it, then its tokens one by one. Three passes over the row,
// the weights kept in `w` between the last two, where softmax, a float64 copy and its cumulative
// sum cost six (with top_p, four more over the weights). A row whose maximum is not finite
// (every token -inf, a NaN, +inf) gives that maximum's index, as the greedy pick does.
constexpr int64_t kDrawBlock = 64;

// One block's weights summed: its eight-wide lanes apart in float64, then the lanes in order.
inline double block_sum(const float* w) {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (int64_t i = 0; i < kDrawBlock; i += 8) {
    const __m256 e = _mm256_loadu_ps(w + i);
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[8];
  _mm256_store_pd(lanes, lo);
  _mm256_store_pd(lanes + 4, hi);
  double sum = 0.0;
  for (double lane : lanes) sum += lane;
  return sum;
}

int64_t draw(const float* row, int64_t n, float t, float min_p, float top_p, float u,
             std::vector<float>& w, std::vector<double>& blocks) {
  const int64_t top = first_max(row, n);
  const float m = row[top];
  if (!std::isfinite(m)) return top;
  const int64_t num_blocks = (n + kDrawBlock - 1) / kDrawBlock;
  if (static_cast<int64_t>(w.size()) < num_blocks * kDrawBlock) w.resize(num_blocks * kDrawBlock);
  if (static_cast<int64_t>(blocks.size()) < num_blocks) blocks.resize(num_blocks);
  // the most likely token's weight (e^0 as exp8 gives it) times min_p
  const float top_weight = _mm256_cvtss_f32(conveyor::exp8(_mm256_setzero_ps()));
  const float min_weight = min_p * top_weight;
  const bool nucleus = top_p < 1.f;
  const __m256 vt = _mm256_set1_ps(t), vm = _mm256_set1_ps(m / t);
  const __m256 vmin = _mm256_set1_ps(nucleus ? 0.f : min_weight);
  // exp8 does not give 0 for -inf: a masked token's weight is set to 0 apart
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  double total = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int64_t i = b * kDrawBlock; i < (b + 1) * kDrawBlock; i += 8) {
      __m256 x;
      if (i + 8 <= n) {
        x = _mm256_loadu_ps(row + i);
      } else {  // past the row: weight 0
        alignas(32) float tail[8];
        for (int j = 0; j < 8; ++j)
          tail[j] = i + j < n ? row[i + j] : -std::numeric_limits<float>::infinity();
        x = _mm256_load_ps(tail);
      }
      __m256 e = conveyor::exp8(_mm256_sub_ps(_mm256_div_ps(x, vt), vm));
      e = _mm256_and_ps(e, _mm256_cmp_ps(e, vmin, _CMP_GE_OQ));
      e = _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), e);
      _mm256_storeu_ps(w.data() + i, e);
    }
    blocks[b] = block_sum(w.data() + b * kDrawBlock);
    total += blocks[b];
  }
  if (nucleus) {  // the tokens past the nucleus, then those under min_p, weigh 0
    const float floor = std::max(nucleus_floor(w.data(), n, top_p * total), min_weight);
    const __m256 vfloor = _mm256_set1_ps(floor);
    total = 0.0;
    for (int64_t b = 0; b < num_blocks; ++b) {
      for (int64_t i = b * kDrawBlock; i < (b + 1) * kDrawBlock; i += 8) {
        const __m256 e = _mm256_loadu_ps(w.data() + i);
        _mm256_storeu_ps(w.data() + i, _mm256_and_ps(e, _mm256_cmp_ps(e, vfloor, _CMP_GE_OQ)));
      }
      blocks[b] = block_sum(w.data() + b * kDrawBlock);
      total += blocks[b];
    }
  }
  const double target = static_cast<double>(u) * total;
  double before = 0.0;  // the weights of the blocks before this one
  int64_t last = top;   // the last token with weight: where rounding leaves the target unpassed
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (before + blocks[b] > target) {
      double running = before;
      for (int64_t i = b * kDrawBlock; i < std::min(n, (b + 1) * kDrawBlock); ++i) {
        if (w[i] <= 0.f) continue;  // never drawn, even where rounding left the target passed
        last = i;
        running += w[i];
        if (running > target) return i;
      }
    } else if (blocks[b] > 0.0) {
      for (int64_t i = std::min(n, (b + 1) * kDrawBlock) - 1; i >= b * kDrawBlock; --i)
        if (w[i] > 0.f) {
          last = i;
          break;
        }
    }
    before += blocks[b];
  }
  return last;
}

}  // namespace

extern "C" {

// out[r] = row r's sampled token (`draw`) at temperature t[r], min_p[r], top_p[r] and the
// uniform number u[r] in [0, 1); rows `stride` elements apart. A row's token does not depend on
// the other rows.
void conveyor_draw_f32(const float* x, int64_t rows, int64_t n, int64_t stride, const float* t,
                       const float* min_p, const float* top_p, const float* u, int64_t* out,
                       int threads) {
#pragma omp parallel num_threads(rows >= 4 ? threads : 1)
  {
    thread_local std::vector<float> w;
    thread_local std::vector<double> blocks;
#pragma omp for
    for (int64_t r = 0; r < rows; ++r)
      out[r] = draw(x + r * stride, n, t[r], min_p[r], top_p[r], u[r], w, blocks);
  }
}

// out[r] = the index of row r's first maximum; rows `stride` elements apart.
void conveyor_argmax_f32(const float* x, int64_t rows, int64_t n, int64_t stride, int64_t* out,
                         int threads) {
#pragma omp parallel for num_threads(rows >= 8 ? threads : 1)
  for (int64_t r = 0; r < rows; ++r) out[r] = first_max(x + r * stride, n);
}

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
