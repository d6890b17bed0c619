// FP8 codes to floats on AVX2 / F16C: a shift makes each code an fp16 whose value is the code's value divided by
// the format's power of two (fp8_to_half_bits: exact, subnormals included), F16C widens it to a float, and the
// power of two is folded into a scale by the caller. NaN codes of E4M3FN / E4M3FNUZ would land on finite fp16
// values: they are patched to an fp16 NaN (E5M2's NaN and infinities come through as they are).
#pragma once

#include "cpu/isa.h"

#if defined(FP8KV_ISA_AVX2) || defined(FP8KV_ISA_AVX512)
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "common/fp8.h"
#include "dispatch.h"

namespace fp8kv::cpu {

// Lane i: the fp16 bits of code i of the 16 in `codes` (value / kHalfRescale).
template <KVFormat kFormat>
FP8KV_INLINE __m256i fp8_half_bits(__m128i codes) {
  constexpr Fp8Format F = fp8_format_of(kFormat);
  if constexpr (F == Fp8Format::E5M2) {
    return _mm256_slli_epi16(_mm256_cvtepu8_epi16(codes), 8);
  } else {
    // Sign-extending then shifting by 7 puts the sign at bit 15 and a copy at bit 14, which the mask clears.
    __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7);
    h = _mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0xBFFF)));
    const __m256i nan_bits = _mm256_set1_epi16(F == Fp8Format::E4M3FN ? 0x3F80 : static_cast<short>(0x8000));
    const __m256i nan = F == Fp8Format::E4M3FN ? _mm256_cmpeq_epi16(_mm256_and_si256(h, nan_bits), nan_bits)
                                               : _mm256_cmpeq_epi16(h, nan_bits);
    return _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7E00), nan);
  }
}

// 8 codes -> 8 floats, each its value / kHalfRescale (the loaded bytes above the 8 are zero).
template <KVFormat kFormat>
FP8KV_INLINE __m256 fp8x8_scaled_floats(const uint8_t* src) {
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  return _mm256_cvtph_ps(_mm256_castsi256_si128(fp8_half_bits<kFormat>(codes)));
}

// 16 codes -> codes 0..7 in lo, 8..15 in hi, each its value / kHalfRescale.
template <KVFormat kFormat>
FP8KV_INLINE void fp8x16_scaled_floats(const uint8_t* src, __m256& lo, __m256& hi) {
  const __m256i h = fp8_half_bits<kFormat>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// 8 model-dtype values (bfloat16, float16 through F16C, float32) -> 8 floats, for the kernels that read model-dtype
// caches the way they read FP8 ones.
template <typename T>
FP8KV_INLINE __m256 model_dtype_x8_floats(const T* src) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(w), 16));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  } else {
    static_assert(std::is_same_v<T, float>);
    return _mm256_loadu_ps(src);
  }
}

}  // namespace fp8kv::cpu
#endif
