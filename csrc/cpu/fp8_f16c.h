// FP8 codes to floats on AVX2 / F16C: a shift makes each code an fp16 whose value is the code's value divided by
// the format's power of two (fp8_to_half_bits: exact, subnormals included), F16C widens it to a float, and the
// power of two is folded into a scale by the caller. NaN codes of E4M3FN / E4M3FNUZ would land on finite fp16
// values: they are patched to an fp16 NaN (E5M2's NaN and infinities come through as they are).
#pragma once

#include "cpu/isa.h"

#if defined(FP8KV_ISA_AVX2) || defined(FP8KV_ISA_AVX512)
#include <immintrin.h>

#include <cstdint>

#include "common/fp8.h"
#include "dispatch.h"

namespace fp8kv::cpu {

// Lane i: the fp16 bits of code i (value / kHalfRescale), for kCodes = 8 (the low bytes of `codes`, an __m128i
// result) or 16 (an __m256i).
template <KVFormat kFormat, int kCodes>
FP8KV_INLINE auto fp8_half_bits(__m128i codes) {
  static_assert(kCodes == 8 || kCodes == 16);
  constexpr Fp8Format F = fp8_format_of(kFormat);
  constexpr bool k256 = kCodes == 16;
  if constexpr (F == Fp8Format::E5M2) {
    if constexpr (k256) return _mm256_slli_epi16(_mm256_cvtepu8_epi16(codes), 8);
    else return _mm_slli_epi16(_mm_cvtepu8_epi16(codes), 8);
  } else {
    // Sign-extending then shifting by 7 puts the sign at bit 15 and a copy at bit 14, which the mask clears.
    if constexpr (k256) {
      __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7);
      h = _mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0xBFFF)));
      const __m256i nan = F == Fp8Format::E4M3FN
                ? _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x3F80)), _mm256_set1_epi16(0x3F80))
                : _mm256_cmpeq_epi16(h, _mm256_set1_epi16(static_cast<short>(0x8000)));
      return _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7E00), nan);
    } else {
      __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(codes), 7);
      h = _mm_and_si128(h, _mm_set1_epi16(static_cast<short>(0xBFFF)));
      const __m128i nan = F == Fp8Format::E4M3FN
                              ? _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x3F80)), _mm_set1_epi16(0x3F80))
                              : _mm_cmpeq_epi16(h, _mm_set1_epi16(static_cast<short>(0x8000)));
      return _mm_blendv_epi8(h, _mm_set1_epi16(0x7E00), nan);
    }
  }
}

// 8 codes -> 8 floats, each its value / kHalfRescale.
template <KVFormat kFormat>
FP8KV_INLINE __m256 fp8x8_scaled_floats(const uint8_t* src) {
  return _mm256_cvtph_ps(fp8_half_bits<kFormat, 8>(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
}

// 16 codes -> codes 0..7 in lo, 8..15 in hi, each its value / kHalfRescale.
template <KVFormat kFormat>
FP8KV_INLINE void fp8x16_scaled_floats(const uint8_t* src, __m256& lo, __m256& hi) {
  const __m256i h = fp8_half_bits<kFormat, 16>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

}  // namespace fp8kv::cpu
#endif
