// Dynamic KV scales (docs/design.md "Dynamic KV scales"; fp8cache/kvcache/dynamic_scales.py is the Python twin):
// one scale per token and KV head, amax / the format's max rounded UP to a bfloat16 (so the largest element never
// clips, and lands within 2^-7 of the format's max), stored as bfloat16 [num_blocks, num_kv_heads, block_size]
// beside the FP8 codes. A bfloat16 is the upper half of a float32, so a kernel reads one with a shift.
// Torch-free, for host and device code.
#pragma once

#include <cstdint>
#include <cstring>

namespace fp8kv {

// Scales stay normal and finite: [2^-126, the largest finite bfloat16].
constexpr uint32_t kMinScaleBits = 0x0080, kMaxScaleBits = 0x7F7F;

// The float value of a stored scale's bfloat16 bits.
inline float scale_value(uint16_t bits) {
  const uint32_t f = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &f, sizeof v);
  return v;
}

// The bfloat16 bits of amax / fmax rounded up (amax >= 0, NaN left out by the caller), clamped to the range above.
inline uint16_t scale_bits(float amax, float fmax) {
  const float exact = amax / fmax;
  uint32_t f;
  std::memcpy(&f, &exact, sizeof f);
  uint32_t hi = (f + 0xFFFFu) >> 16;  // round up: any bit below the bfloat16's mantissa carries
  hi = hi < kMinScaleBits ? kMinScaleBits : hi > kMaxScaleBits ? kMaxScaleBits : hi;
  return static_cast<uint16_t>(hi);
}

}  // namespace fp8kv
