// KV cache format code + model dtype -> template instantiation (for the op bindings; includes torch).
//
//   FP8KV_DISPATCH_BY_KV_FORMAT(src_scalar_type, format, FN)
//
// calls FN(scalar_t, cache_t, kFormat) with
//   scalar_t: float, c10::BFloat16 or c10::Half (the query / key / model dtype, src_scalar_type),
//   cache_t:  uint8_t for the FP8 formats, scalar_t for AUTO,
//   kFormat:  a fp8kv::KVFormat constant (AUTO, E4M3FN, E5M2, E4M3FNUZ; common/cache_format.h).
// FN is usually a function-like macro: #define CALL(scalar_t, cache_t, kFormat) my_kernel<...>(...)
//
// `format` is a KVFormat from kv_format_from_code: the ops take the code Python resolved from the user's
// kv-cache-dtype string ("fp8" already made the device's native format there), so no string is parsed here.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "common/cache_format.h"
#include "common/fp8.h"

namespace fp8kv {

// The FP8 format of a non-AUTO KVFormat, for fp8.h's templates.
constexpr Fp8Format fp8_format_of(KVFormat f) {
  return f == KVFormat::E5M2 ? Fp8Format::E5M2
         : f == KVFormat::E4M3FNUZ ? Fp8Format::E4M3FNUZ
                                   : Fp8Format::E4M3FN;
}

// The KVFormat of an op's `int kv_cache_format` argument; refuses codes that name none.
inline KVFormat kv_format_from_code(int64_t code) {
  TORCH_CHECK(is_kv_format_code(code), "unknown kv_cache_format code ", code,
              "; valid: 0 (auto), 1 (fp8_e4m3), 2 (fp8_e5m2), 3 (fp8_e4m3fnuz); resolve a kv-cache-dtype string "
              "with fp8cache.kvcache.formats.format_code");
  return static_cast<KVFormat>(code);
}

}  // namespace fp8kv

#define FP8KV_DISPATCH_FP8_FORMAT_(SCALAR_T, FORMAT, FN)                               \
  switch (FORMAT) {                                                                \
    case ::fp8kv::KVFormat::E4M3FN: FN(SCALAR_T, uint8_t, ::fp8kv::KVFormat::E4M3FN); break;     \
    case ::fp8kv::KVFormat::E5M2: FN(SCALAR_T, uint8_t, ::fp8kv::KVFormat::E5M2); break;         \
    case ::fp8kv::KVFormat::E4M3FNUZ: FN(SCALAR_T, uint8_t, ::fp8kv::KVFormat::E4M3FNUZ); break; \
    default: TORCH_CHECK(false, "internal error: AUTO is not an FP8 format");            \
  }

#define FP8KV_DISPATCH_BY_KV_FORMAT(SRC_DTYPE, FORMAT, FN)                                               \
  do {                                                                                                   \
    const ::fp8kv::KVFormat fp8kv_format_ = (FORMAT);                                                    \
    const ::c10::ScalarType fp8kv_src_ = (SRC_DTYPE);                                                     \
    if (fp8kv_format_ == ::fp8kv::KVFormat::AUTO) {                                                      \
      if (fp8kv_src_ == ::c10::ScalarType::Float) {                                                       \
        FN(float, float, ::fp8kv::KVFormat::AUTO);                                                       \
      } else if (fp8kv_src_ == ::c10::ScalarType::BFloat16) {                                             \
        FN(c10::BFloat16, c10::BFloat16, ::fp8kv::KVFormat::AUTO);                                       \
      } else if (fp8kv_src_ == ::c10::ScalarType::Half) {                                                 \
        FN(c10::Half, c10::Half, ::fp8kv::KVFormat::AUTO);                                               \
      } else {                                                                                           \
        TORCH_CHECK(false, "unsupported model dtype ", fp8kv_src_, "; use float32, bfloat16 or float16"); \
      }                                                                                                  \
    } else {                                                                                             \
      if (fp8kv_src_ == ::c10::ScalarType::Float) {                                                       \
        FP8KV_DISPATCH_FP8_FORMAT_(float, fp8kv_format_, FN)                                             \
      } else if (fp8kv_src_ == ::c10::ScalarType::BFloat16) {                                             \
        FP8KV_DISPATCH_FP8_FORMAT_(c10::BFloat16, fp8kv_format_, FN)                                     \
      } else if (fp8kv_src_ == ::c10::ScalarType::Half) {                                                 \
        FP8KV_DISPATCH_FP8_FORMAT_(c10::Half, fp8kv_format_, FN)                                         \
      } else {                                                                                           \
        TORCH_CHECK(false, "unsupported model dtype ", fp8kv_src_, "; use float32, bfloat16 or float16"); \
      }                                                                                                  \
    }                                                                                                    \
  } while (0)
