// How one cache element is written and read: FP8 codes with a scale, or the model dtype as is ("auto").
#pragma once

#include <type_traits>

#include "platform.cuh"

namespace fp8kv::gpu {

template <typename scalar_t, typename cache_t, Fp8Format kFormat>
struct CacheCodec {
  static constexpr bool kQuantized = std::is_same_v<cache_t, uint8_t>;
  static_assert(kQuantized || std::is_same_v<cache_t, scalar_t>, "an auto cache holds the model dtype");

  // Elements per 16-byte chunk of the key cache's innermost dimension (docs/design.md section 4).
  static constexpr int kX = 16 / static_cast<int>(sizeof(cache_t));

  // stored = Q(x / scale) (docs/design.md section 3); an auto cache stores x unchanged.
  FP8KV_DEVICE static cache_t encode(scalar_t x, float scale) {
    if constexpr (kQuantized) {
      return fp8_encode<kFormat>(to_float(x) / scale);
    } else {
      return x;
    }
  }

  // stored = Q(x * inverse_scale): dynamic scales multiply by their float32 reciprocal, as the CPU write and the
  // reference do (common/dynamic_scale.h), a fraction of a division's cost.
  FP8KV_DEVICE static cache_t encode_times(scalar_t x, float inverse_scale) {
    if constexpr (kQuantized) {
      return fp8_encode<kFormat>(to_float(x) * inverse_scale);
    } else {
      return x;
    }
  }

  // The stored value without its scale: attention folds the scale into the dot product and the output.
  FP8KV_DEVICE static float decode(cache_t v) {
    if constexpr (kQuantized) {
      return fp8_decode<kFormat>(v);
    } else {
      return to_float(v);
    }
  }

  // decode of N consecutive stored elements.
  template <int N>
  FP8KV_DEVICE static void decode_vec(const Vec<cache_t, N>& v, float* out) {
    if constexpr (kQuantized && N % 2 == 0) {
      fp8_decode_pairs<kFormat, N>(v.e, out);
    } else {
      FP8KV_UNROLL
      for (int j = 0; j < N; ++j) out[j] = decode(v.e[j]);
    }
  }

  FP8KV_DEVICE static float scale_of(const float* scales, bool per_head, int kv_head) {
    if constexpr (kQuantized) {
      return scales[per_head ? kv_head : 0];
    } else {
      return 1.0f;
    }
  }
};

}  // namespace fp8kv::gpu
