// e^x and SiLU on the vectors of the namespace that includes this file (simd_f32.h includes it
// once for each width), written on that namespace's Vec and operations. No include guard: it is
// meant to be included more than once.

// 2^n for integral n in [-150, 128], as two factors that are each a normal float.
inline Vec pow2(Vec n) {
  const Ints half = to_ints(mul(n, set1(0.5f)));
  const Ints rest = sub_ints(to_ints(n), half);
  const Ints bias = set1_ints(127);
  return mul(exponent_bits(add_ints(half, bias)), exponent_bits(add_ints(rest, bias)));
}

// e^x: 2^n * 2^f with f in [-0.5, 0.5], 2^f by its Taylor series to degree 7 (relative error
// ~1e-7, as expf); x at or below -103, -inf and NaN give the smallest subnormal (1.4e-45), not
// 0, so a caller that needs a masked lane to weigh nothing zeroes it apart; very large x gives inf.
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
