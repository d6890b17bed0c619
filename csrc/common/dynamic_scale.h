// Dynamic KV scales (docs/design.md "Dynamic KV scales"; fp8cache/kvcache/dynamic_scales.py is the Python twin):
// one power-of-two scale per token and KV head, stored as an E8M0 exponent code c (scale = 2^(c - 127)) in
// uint8 [num_blocks, num_kv_heads, block_size] beside the FP8 codes. Torch-free, for host and device code.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fp8kv {

constexpr int kScaleBias = 127;
constexpr int kMinScaleCode = 1, kMaxScaleCode = 254;  // normal float32 powers of two only

// 2^(code - 127) as a float, built from its bits (codes are in [1, 254]: a normal float).
inline float scale_code_value(uint8_t code) {
  const uint32_t bits = static_cast<uint32_t>(code) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The smallest power of two s with amax <= fmax * s, as its code in [1, 254]. amax >= 0 (NaN left out by the
// caller); ldexp of fmax is exact at every exponent tried, so the comparisons are exact and the code is the
// same as the Python reference's.
inline uint8_t scale_code(float amax, float fmax) {
  if (!(amax <= 3.4028235e38f)) return kMaxScaleCode;  // infinite: the values saturate
  if (!(amax > 0.f)) return kMinScaleCode;
  int e;
  std::frexp(amax / fmax, &e);  // amax / fmax = m 2^e, m in [0.5, 1): ceil(log2) is e, or e - 1 when m = 0.5
  if (e > kScaleBias + 1) e = kScaleBias + 1;
  if (e < -kScaleBias) e = -kScaleBias;
  if (amax <= std::ldexp(fmax, e - 1)) --e;  // the division rounded up past a power of two
  if (amax > std::ldexp(fmax, e)) ++e;       // or down below one
  const int code = e + kScaleBias;
  return static_cast<uint8_t>(code < kMinScaleCode ? kMinScaleCode : code > kMaxScaleCode ? kMaxScaleCode : code);
}

}  // namespace fp8kv
