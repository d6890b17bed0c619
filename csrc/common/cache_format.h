// The KV cache format as the ops take it: a small integer (`int kv_cache_format` in the op schemas), never the
// user's kv-cache-dtype string. Python resolves that string once (fp8cache/kvcache/formats.py, the only alias
// table: "fp8" means E4M3FN on CPUs and CUDA, E4M3FNUZ on ROCm) and passes CacheFormat, an IntEnum with these
// names and values; tests/kvcache/test_formats.py parses this enum to hold the two equal.
//
// Torch-free, so the CUDA host emulation (cuda/host_emulation.cpp) codes its formats the same way.
#pragma once

#include <cstdint>

namespace fp8kv {

enum class KVFormat : int64_t {
  AUTO = 0,  // the model dtype: a full-precision cache
  E4M3FN = 1,
  E5M2 = 2,
  E4M3FNUZ = 3,
};

constexpr bool is_kv_format_code(int64_t code) { return code >= 0 && code <= 3; }

// Names are fp8cache's canonical kv-cache-dtype strings, for error messages.
constexpr const char* kv_format_name(KVFormat f) {
  return f == KVFormat::AUTO       ? "auto"
         : f == KVFormat::E4M3FN   ? "fp8_e4m3"
         : f == KVFormat::E5M2     ? "fp8_e5m2"
         : f == KVFormat::E4M3FNUZ ? "fp8_e4m3fnuz"
                                   : "?";
}

}  // namespace fp8kv
