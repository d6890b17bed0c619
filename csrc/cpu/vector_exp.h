// exp for the vector paths: softmax in attention_avx512.h and attention_avx2.h, SiLU in layer_ops.cpp. Both
// widths evaluate one Cephes expf polynomial (~1 ulp): n = round(x / ln 2), r = x - n ln 2 in two parts,
// exp(x) = 2^n (1 + r + r^2 P(r)); they differ only in how they round n and apply 2^n.
#pragma once

#include "cpu/isa.h"

#if defined(FP8KV_ISA_AVX2) || defined(FP8KV_ISA_AVX512)
#include <immintrin.h>

#include "common/fp8.h"

namespace fp8kv::cpu {

// 1 + r + r^2 P(r) with r = x - n ln 2, on the float vectors of Ops (V and its set1, fmadd, fnmadd, mul, add).
template <typename Ops>
FP8KV_INLINE typename Ops::V exp_remainder(typename Ops::V x, typename Ops::V n) {
  using V = typename Ops::V;
  V r = Ops::fnmadd(n, Ops::set1(0.693359375f), x);
  r = Ops::fnmadd(n, Ops::set1(-2.12194440e-4f), r);
  V p = Ops::set1(1.9875691500e-4f);
  p = Ops::fmadd(p, r, Ops::set1(1.3981999507e-3f));
  p = Ops::fmadd(p, r, Ops::set1(8.3334519073e-3f));
  p = Ops::fmadd(p, r, Ops::set1(4.1665795894e-2f));
  p = Ops::fmadd(p, r, Ops::set1(1.6666665459e-1f));
  p = Ops::fmadd(p, r, Ops::set1(5.0000001201e-1f));
  return Ops::fmadd(p, Ops::mul(r, r), Ops::add(r, Ops::set1(1.f)));
}

struct Ymm {
  using V = __m256;
  static FP8KV_INLINE V set1(float f) { return _mm256_set1_ps(f); }
  static FP8KV_INLINE V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static FP8KV_INLINE V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static FP8KV_INLINE V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static FP8KV_INLINE V add(V a, V b) { return _mm256_add_ps(a, b); }
};

namespace avx2 {

// exp(x) for x <= 88 (the softmax passes logit - max <= 0), 2^n built in the exponent bits; below -87.3 it is
// exp(-87.3); NaN stays NaN.
FP8KV_INLINE __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));  // a NaN x passes through
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(exp_remainder<Ymm>(x, n), _mm256_castsi256_ps(scale));
}

}  // namespace avx2

#if defined(FP8KV_ISA_AVX512)
struct Zmm {
  using V = __m512;
  static FP8KV_INLINE V set1(float f) { return _mm512_set1_ps(f); }
  static FP8KV_INLINE V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static FP8KV_INLINE V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static FP8KV_INLINE V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static FP8KV_INLINE V add(V a, V b) { return _mm512_add_ps(a, b); }
};

namespace avx512 {

// exp(x); below -87.3 it is exp(-87.3), above ~88.7 +inf; NaN stays NaN.
FP8KV_INLINE __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);  // a NaN x is returned as is
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp_remainder<Zmm>(x, n), n);
}

}  // namespace avx512
#endif

}  // namespace fp8kv::cpu
#endif
