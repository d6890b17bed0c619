// kv_cache_dtype string + model dtype -> template instantiation (for the op bindings; includes torch).
//
//   FP8KV_DISPATCH_BY_KV_CACHE_DTYPE(src_scalar_type, kv_cache_dtype, FN)
//
// calls FN(scalar_t, cache_t, kFormat) with
//   scalar_t: float, c10::BFloat16 or c10::Half (the query / key / model dtype, src_scalar_type),
//   cache_t:  uint8_t for the FP8 formats, scalar_t for "auto",
//   kFormat:  a fp8kv::KVFormat constant (AUTO, E4M3FN, E5M2, E4M3FNUZ).
// FN is usually a function-like macro: #define CALL(scalar_t, cache_t, kFormat) my_kernel<...>(...)
//
// "fp8" resolves to this build's native format: E4M3FNUZ when compiled for ROCm (USE_ROCM or
// __HIP_PLATFORM_AMD__), else E4M3FN. CPU ops must use FP8KV_DISPATCH_BY_KV_CACHE_DTYPE_CPU, because
// "fp8" on a CPU tensor means E4M3FN even inside a ROCm build (DESIGN section 2).
#pragma once

#include <string>

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "common/fp8.h"

namespace fp8kv {

enum class KVFormat : int { AUTO = -1, E4M3FN = 0, E5M2 = 1, E4M3FNUZ = 2 };

constexpr const char* kValidKvCacheDtypes = "auto, fp8, fp8_e4m3, fp8_e5m2, fp8_e4m3fnuz";

#if defined(USE_ROCM) || defined(__HIP_PLATFORM_AMD__)
constexpr KVFormat kDeviceDefaultFp8 = KVFormat::E4M3FNUZ;
#else
constexpr KVFormat kDeviceDefaultFp8 = KVFormat::E4M3FN;
#endif
constexpr KVFormat kCpuDefaultFp8 = KVFormat::E4M3FN;

// The FP8 format of a non-AUTO KVFormat, for fp8.h's templates.
constexpr Fp8Format fp8_format_of(KVFormat f) {
  return f == KVFormat::E5M2 ? Fp8Format::E5M2
         : f == KVFormat::E4M3FNUZ ? Fp8Format::E4M3FNUZ
                                   : Fp8Format::E4M3FN;
}

inline KVFormat parse_kv_cache_dtype(const std::string& name, KVFormat default_fp8) {
  if (name == "auto") return KVFormat::AUTO;
  if (name == "fp8") return default_fp8;
  if (name == "fp8_e4m3") return KVFormat::E4M3FN;
  if (name == "fp8_e5m2") return KVFormat::E5M2;
  if (name == "fp8_e4m3fnuz") return KVFormat::E4M3FNUZ;
  TORCH_CHECK(false, "unknown kv_cache_dtype '", name, "'; valid choices are: ", kValidKvCacheDtypes);
}

inline const char* kv_format_name(KVFormat f) {
  switch (f) {
    case KVFormat::AUTO: return "auto";
    case KVFormat::E4M3FN: return "fp8_e4m3";
    case KVFormat::E5M2: return "fp8_e5m2";
    case KVFormat::E4M3FNUZ: return "fp8_e4m3fnuz";
  }
  return "?";
}

}  // namespace fp8kv

#define FP8KV_DISPATCH_FP8_FORMAT_(SCALAR_T, FORMAT, FN)                               \
  switch (FORMAT) {                                                                \
    case ::fp8kv::KVFormat::E4M3FN: FN(SCALAR_T, uint8_t, ::fp8kv::KVFormat::E4M3FN); break;     \
    case ::fp8kv::KVFormat::E5M2: FN(SCALAR_T, uint8_t, ::fp8kv::KVFormat::E5M2); break;         \
    case ::fp8kv::KVFormat::E4M3FNUZ: FN(SCALAR_T, uint8_t, ::fp8kv::KVFormat::E4M3FNUZ); break; \
    default: TORCH_CHECK(false, "internal error: AUTO is not an FP8 format");            \
  }

#define FP8KV_DISPATCH_BY_KV_CACHE_DTYPE_WITH_DEFAULT(DEFAULT_FP8, SRC_DTYPE, KV_DTYPE, FN)               \
  do {                                                                                                   \
    const ::fp8kv::KVFormat fp8kv_format_ = ::fp8kv::parse_kv_cache_dtype((KV_DTYPE), (DEFAULT_FP8));    \
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

// For device (CUDA / HIP) ops: "fp8" is the device's native format.
#define FP8KV_DISPATCH_BY_KV_CACHE_DTYPE(SRC_DTYPE, KV_DTYPE, FN) \
  FP8KV_DISPATCH_BY_KV_CACHE_DTYPE_WITH_DEFAULT(::fp8kv::kDeviceDefaultFp8, SRC_DTYPE, KV_DTYPE, FN)

// For CPU ops: "fp8" is always E4M3FN.
#define FP8KV_DISPATCH_BY_KV_CACHE_DTYPE_CPU(SRC_DTYPE, KV_DTYPE, FN) \
  FP8KV_DISPATCH_BY_KV_CACHE_DTYPE_WITH_DEFAULT(::fp8kv::kCpuDefaultFp8, SRC_DTYPE, KV_DTYPE, FN)
