// Values in and out of tensor-core fragments: pairs of 16-bit floats packed in 32-bit registers, and FP8 codes
// turned into such pairs four at a time. Host and device (the host emulation runs the same code).
#pragma once

#include <cstdint>
#include <cstring>

#include "platform.cuh"

namespace fp8kv::gpu {

// Byte i of the result is byte (selector >> 4i) & 7 of the eight bytes {x, y} (CUDA's __byte_perm).
FP8KV_DEVICE uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t selector) {
#if defined(FP8KV_PLATFORM_CUDA) && defined(__CUDA_ARCH__)
  return __byte_perm(x, y, selector);
#else
  const uint64_t bytes = (uint64_t(y) << 32) | x;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) out |= uint32_t((bytes >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return out;
#endif
}

FP8KV_DEVICE uint16_t half_bits(float v) {
#if defined(FP8KV_PLATFORM_HOST)
  const _Float16 h = static_cast<_Float16>(v);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof(bits));
  return bits;
#else
  return __half_as_ushort(__float2half_rn(v));
#endif
}

// Two floats as one operand register of kType: `lo` in the low half (the lower k or n index).
template <MmaType kType>
FP8KV_DEVICE uint32_t pack_pair(float lo, float hi) {
  if constexpr (kType == MmaType::kF16) {
    return uint32_t(half_bits(lo)) | (uint32_t(half_bits(hi)) << 16);
  } else {
    return uint32_t(from_float<bf16_t>(lo).bits) | (uint32_t(from_float<bf16_t>(hi).bits) << 16);
  }
}

// The float in one half of an operand register (the host emulation's tensor core reads operands this way).
template <MmaType kType>
FP8KV_DEVICE float unpack_half(uint32_t pair, int which) {
  const auto bits = static_cast<uint16_t>(which == 0 ? pair & 0xFFFFu : pair >> 16);
  return kType == MmaType::kF16 ? half_bits_to_float(bits) : bits_to_float(uint32_t(bits) << 16);
}

// Four FP8 codes (one 32-bit word, code 0 in the low byte) as two f16 pairs: codes 0, 1 in `lo`, 2, 3 in `hi`.
// Every E5M2 value is an fp16 value (its upper byte), so those are only moved. The E4M3 formats are moved
// into fp16's exponent and mantissa fields as they are, which reads them 2^kShift too small (fp16's bias is
// 15, theirs 7 or 8): exact, subnormals included, and the kernel multiplies the 2^kShift back into its scales.
// That path cannot express their NaN codes (0x7F/0xFF in E4M3FN, 0x80 in E4M3FNUZ): `special` flags a word
// holding one, and the kernel fixes what they touch after the tile (rare, so the common path stays a few
// integer instructions: decoding them inline once made the E4M3FNUZ kernel twice as slow). On sm_89+ E4M3FN
// has a conversion instruction, NaN included.
template <Fp8Format F>
struct Fp8Quads {
#if defined(FP8KV_HW_FP8)
  static constexpr bool kHardware = F == Fp8Format::E4M3FN;
#else
  static constexpr bool kHardware = false;
#endif
  static constexpr bool kChecked = F != Fp8Format::E5M2 && !kHardware;  // has codes decode cannot express
  // What a decoded pair must be multiplied by to give the code's value.
  static constexpr float kRescale = kChecked ? Fp8Traits<F>::kHalfRescale : 1.0f;

  FP8KV_DEVICE static void decode(uint32_t w, uint32_t& lo, uint32_t& hi) {
    if constexpr (kHardware) {
#if defined(FP8KV_HW_FP8) && defined(__CUDA_ARCH__)
      // Written in PTX so that ptxas reads the upper pair in place (F2FP ... R.H1) instead of shifting it down.
      asm("{ .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h; }"
          : "=r"(lo), "=r"(hi)
          : "r"(w));
#elif defined(FP8KV_HW_FP8)
      const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xFFFFu), __NV_E4M3);
      const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
      lo = uint32_t(a.x) | (uint32_t(a.y) << 16);
      hi = uint32_t(b.x) | (uint32_t(b.y) << 16);
#endif
    } else {
      // Each code into the upper byte of its half.
      lo = byte_perm(w, 0, 0x1404);
      hi = byte_perm(w, 0, 0x3424);
      if constexpr (F != Fp8Format::E5M2) {  // s eeee mmm 0000 0000 -> s 0 eeee mmm 000 0000
        lo = (lo & 0x80008000u) | ((lo >> 1) & 0x3F803F80u);
        hi = (hi & 0x80008000u) | ((hi >> 1) & 0x3F803F80u);
      }
    }
  }

  // Bit 7 of byte b set when code b of w is one decode cannot express (only where kChecked).
  FP8KV_DEVICE static uint32_t special(uint32_t w) {
    if constexpr (!kChecked) {
      return 0;
    } else if constexpr (F == Fp8Format::E4M3FN) {  // a byte whose low 7 bits are all set
      return ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
    } else {  // E4M3FNUZ: a byte equal to 0x80
      const uint32_t x = w ^ 0x80808080u;
      return (x - 0x01010101u) & ~x & 0x80808080u;
    }
  }
};

}  // namespace fp8kv::gpu
