// FP8 <-> float conversion shared by the CPU, CUDA and HIP ops.
//
// Torch-free and pure integer bit manipulation, so the same code gives the same bits on host, CUDA and
// HIP (no dependence on FTZ modes or on which hardware converters exist).
//
// Quantization contract (docs/design.md section 3): code = Q(clamp(x, -max, max)) with Q round-to-nearest-even,
// which is bit-exact with torch's `torch.clamp(x, -max, max).to(torch.float8_*)`:
//   * |x| >= max (and +-inf) saturate to +-max,
//   * NaN -> 0x7F | sign (E4M3FN, E5M2) or 0x80 (E4M3FNUZ, whose only NaN),
//   * E4M3FNUZ has no negative zero: anything that rounds to -0 is stored as 0x00.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>  // hipcc defines __forceinline__ and __host__/__device__ only here
#endif

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FP8KV_HOST_DEVICE __host__ __device__
#define FP8KV_INLINE __forceinline__
#else
#define FP8KV_HOST_DEVICE
#define FP8KV_INLINE inline __attribute__((always_inline))
#endif

namespace fp8kv {

enum class Fp8Format : int { E4M3FN = 0, E5M2 = 1, E4M3FNUZ = 2 };

template <Fp8Format F>
struct Fp8Traits;

template <>
struct Fp8Traits<Fp8Format::E4M3FN> {
  static constexpr int kExponentBits = 4;
  static constexpr int kMantissaBits = 3;
  static constexpr int kBias = 7;
  static constexpr float kMax = 448.0f;
  static constexpr uint32_t kMaxBits = 0x43E00000u;  // float bits of kMax
  static constexpr uint8_t kMaxCode = 0x7E;
  static constexpr uint8_t kNanCode = 0x7F;  // 0xFF is NaN too
  static constexpr bool kHasInf = false;
  static constexpr bool kHasNegativeZero = true;
  // Placing the 7 magnitude bits at fp16 bit 7 gives the value times 2^(kBias - 15); see fp8_to_half_bits.
  static constexpr float kHalfRescale = 256.0f;  // 2^(15 - kBias)
};

template <>
struct Fp8Traits<Fp8Format::E5M2> {
  static constexpr int kExponentBits = 5;
  static constexpr int kMantissaBits = 2;
  static constexpr int kBias = 15;
  static constexpr float kMax = 57344.0f;
  static constexpr uint32_t kMaxBits = 0x47600000u;
  static constexpr uint8_t kMaxCode = 0x7B;
  static constexpr uint8_t kNanCode = 0x7F;  // 0x7D..0x7F and 0xFD..0xFF are NaN, 0x7C/0xFC are +-inf
  static constexpr bool kHasInf = true;
  static constexpr bool kHasNegativeZero = true;
  static constexpr float kHalfRescale = 1.0f;  // E5M2 is exactly the high byte of an fp16
};

template <>
struct Fp8Traits<Fp8Format::E4M3FNUZ> {
  static constexpr int kExponentBits = 4;
  static constexpr int kMantissaBits = 3;
  static constexpr int kBias = 8;
  static constexpr float kMax = 240.0f;
  static constexpr uint32_t kMaxBits = 0x43700000u;
  static constexpr uint8_t kMaxCode = 0x7F;
  static constexpr uint8_t kNanCode = 0x80;  // the only NaN; there is no -0
  static constexpr bool kHasInf = false;
  static constexpr bool kHasNegativeZero = false;
  static constexpr float kHalfRescale = 128.0f;  // 2^(15 - kBias)
};

FP8KV_HOST_DEVICE FP8KV_INLINE uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

FP8KV_HOST_DEVICE FP8KV_INLINE float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// Saturating round-to-nearest-even float -> FP8 code (see the contract at the top of this file).
template <Fp8Format F>
FP8KV_HOST_DEVICE FP8KV_INLINE uint8_t float_to_fp8(float x) {
  using T = Fp8Traits<F>;
  constexpr int kM = T::kMantissaBits;
  constexpr int kDrop = 23 - kM;                             // fp32 mantissa bits that are rounded off
  constexpr uint32_t kMinNormalBits = uint32_t(128 - T::kBias) << 23;  // 2^(1 - bias)
  const uint32_t u = float_to_bits(x);
  const uint32_t abs_bits = u & 0x7FFFFFFFu;
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if (abs_bits > 0x7F800000u) {
    return T::kHasNegativeZero ? static_cast<uint8_t>(T::kNanCode | sign) : T::kNanCode;
  }
  uint32_t magnitude;
  if (abs_bits >= T::kMaxBits) {
    magnitude = T::kMaxCode;
  } else if (abs_bits >= kMinNormalBits) {
    // Round the fp32 mantissa to kM bits (ties to even), then rebias the exponent. A carry out of the
    // mantissa correctly bumps the exponent; it cannot pass kMaxCode because abs_bits < kMax.
    const uint32_t rounded = abs_bits + ((1u << (kDrop - 1)) - 1u) + ((abs_bits >> kDrop) & 1u);
    magnitude = (rounded >> kDrop) - (uint32_t(127 - T::kBias) << kM);
  } else {
    // Subnormal in FP8: count units of 2^(1 - bias - kM). Rounding up to 1 << kM yields the smallest
    // normal code, which is the right answer.
    const uint32_t exp_field = abs_bits >> 23;
    const uint32_t mant = exp_field ? ((abs_bits & 0x7FFFFFu) | 0x800000u) : abs_bits;
    const uint32_t e = exp_field ? exp_field : 1u;
    const uint32_t shift = uint32_t(151 - T::kBias - kM) - e;  // >= kDrop + 1
    if (shift > 25) {
      magnitude = 0;  // below half of the smallest subnormal (mant < 2^24)
    } else {
      magnitude = (mant + ((1u << (shift - 1)) - 1u) + ((mant >> shift) & 1u)) >> shift;
    }
  }
  if (!T::kHasNegativeZero && magnitude == 0) return 0;
  return static_cast<uint8_t>(magnitude | sign);
}

// Exact FP8 code -> float (NaN codes give NaN, E5M2 infinities give infinities).
template <Fp8Format F>
FP8KV_HOST_DEVICE FP8KV_INLINE float fp8_to_float(uint8_t v) {
  using T = Fp8Traits<F>;
  constexpr int kM = T::kMantissaBits;
  constexpr uint32_t kExpMask = (1u << T::kExponentBits) - 1u;
  const uint32_t sign = uint32_t(v & 0x80u) << 24;
  const uint32_t exp_field = (uint32_t(v) >> kM) & kExpMask;
  const uint32_t mant = uint32_t(v) & ((1u << kM) - 1u);
  if (F == Fp8Format::E4M3FNUZ) {
    if (v == 0x80) return bits_to_float(0x7FC00000u);
  } else if (F == Fp8Format::E4M3FN) {
    if ((v & 0x7F) == 0x7F) return bits_to_float(sign | 0x7FC00000u);
  } else if (exp_field == kExpMask) {  // E5M2
    return bits_to_float(sign | 0x7F800000u | (mant ? 0x400000u : 0u));
  }
  if (exp_field == 0) {
    // Subnormal: mant * 2^(1 - bias - kM), built exactly from bits (always a normal float).
    if (mant == 0) return bits_to_float(sign);
    int shift = 0;  // normalise the kM-bit mantissa so its top bit becomes the hidden bit
    uint32_t m = mant;
    while (!(m & (1u << kM))) {
      m <<= 1;
      ++shift;
    }
    const uint32_t e = uint32_t(127 + 1 - T::kBias - shift);
    return bits_to_float(sign | (e << 23) | ((m & ((1u << kM) - 1u)) << (23 - kM)));
  }
  return bits_to_float(sign | ((exp_field + 127u - T::kBias) << 23) | (mant << (23 - kM)));
}

// fp16 bit pattern whose value is fp8_to_float(v) / Fp8Traits<F>::kHalfRescale (exact, including
// subnormals). This is the cheap decode for vector code: fold kHalfRescale into the dequant scale.
// NaN codes of E4M3FN/E4M3FNUZ do NOT map to an fp16 NaN here (E5M2's do); callers that need NaN to
// propagate patch them separately.
template <Fp8Format F>
FP8KV_HOST_DEVICE FP8KV_INLINE uint16_t fp8_to_half_bits(uint8_t v) {
  if (F == Fp8Format::E5M2) return static_cast<uint16_t>(uint16_t(v) << 8);
  return static_cast<uint16_t>(((v & 0x80u) << 8) | ((v & 0x7Fu) << 7));
}

// True for the codes that decode to NaN.
template <Fp8Format F>
FP8KV_HOST_DEVICE FP8KV_INLINE bool fp8_is_nan(uint8_t v) {
  if (F == Fp8Format::E4M3FNUZ) return v == 0x80;
  if (F == Fp8Format::E4M3FN) return (v & 0x7F) == 0x7F;
  return (v & 0x7F) > 0x7C;
}

// Quantize as docs/design.md section 3 says, stored = Q(x / scale). Division, not multiplication by the
// reciprocal, so results are bit-exact with torch's `x / s`.
template <Fp8Format F>
FP8KV_HOST_DEVICE FP8KV_INLINE uint8_t scaled_float_to_fp8(float x, float scale) {
  return float_to_fp8<F>(x / scale);
}

}  // namespace fp8kv
