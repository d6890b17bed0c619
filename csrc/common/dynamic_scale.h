// Dynamic KV scales (docs/design.md "Dynamic KV scales"; fp8cache/kvcache/dynamic_scales.py is the Python twin):
// one scale per token and KV head, amax / the format's max rounded UP to a bfloat16 (so the largest element never
// clips, and lands within 2^-7 of the format's max), stored as bfloat16 [num_blocks, num_kv_heads, block_size]
// beside the FP8 codes. A bfloat16 is the upper half of a float32, so a kernel reads one with a shift.
// Torch-free, for host and device code: the CPU ops and the CUDA/HIP kernels share this one definition.
#pragma once

#include <cstdint>

#include "fp8.h"  // float_to_bits / bits_to_float, FP8KV_HOST_DEVICE

namespace fp8kv {

// Scales stay normal and finite: [2^-126, the largest finite bfloat16].
constexpr uint32_t kMinScaleBits = 0x0080, kMaxScaleBits = 0x7F7F;

// The float value of a stored scale's bfloat16 bits.
FP8KV_HOST_DEVICE FP8KV_INLINE float scale_value(uint16_t bits) {
  return bits_to_float(static_cast<uint32_t>(bits) << 16);
}

// The bfloat16 bits of amax / fmax rounded up (amax >= 0, NaN left out by the caller), clamped to the range above.
FP8KV_HOST_DEVICE FP8KV_INLINE uint16_t scale_bits(float amax, float fmax) {
  const uint32_t f = float_to_bits(amax / fmax);
  uint32_t hi = (f + 0xFFFFu) >> 16;  // round up: any bit below the bfloat16's mantissa carries
  hi = hi < kMinScaleBits ? kMinScaleBits : hi > kMaxScaleBits ? kMaxScaleBits : hi;
  return static_cast<uint16_t>(hi);
}

}  // namespace fp8kv
