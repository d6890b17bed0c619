// Argument checks shared by the CPU ops: every bad input becomes a TORCH_CHECK naming the problem.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "../scale_cache_checks.h"

namespace fp8kv::cpu {

// Geometry of a paged KV cache pair (docs/design.md section 4 layouts).
struct CacheGeometry {
  int64_t num_blocks;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  int64_t x;  // elements per 16-byte chunk of the key cache's innermost dimension
};

// `prefix` names the pair in errors: "" for key_cache / value_cache, "window_" for the window ring.
inline CacheGeometry check_caches(const at::Tensor& key_cache, const at::Tensor& value_cache, bool fp8,
                                  const char* prefix = "") {
  const std::string k = std::string(prefix) + "key_cache", v = std::string(prefix) + "value_cache";
  TORCH_CHECK(key_cache.dim() == 5, k, " must be [num_blocks, num_kv_heads, head_size // x, block_size, x], got shape ",
              key_cache.sizes());
  TORCH_CHECK(value_cache.dim() == 4, v, " must be [num_blocks, num_kv_heads, head_size, block_size], got shape ",
              value_cache.sizes());
  TORCH_CHECK(key_cache.device().is_cpu() && value_cache.device().is_cpu(), k, " and ", v, " must be CPU tensors");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), k, " and ", v,
              " must be contiguous (allocate them with ops.allocate_kv_cache)");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), k, " and ", v, " dtypes differ: ",
              key_cache.scalar_type(), " vs ", value_cache.scalar_type());
  const auto dtype = key_cache.scalar_type();
  if (fp8) {
    TORCH_CHECK(dtype == at::kByte, "an FP8 kv_cache_dtype stores uint8 caches, got ", dtype,
                "; allocate them with ops.allocate_kv_cache(..., kv_cache_dtype, ...)");
  } else {
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "kv_cache_dtype 'auto' needs ",
                k, " and ", v, " in float32, bfloat16 or float16, got ", dtype);
  }
  CacheGeometry g{key_cache.size(0), key_cache.size(1), value_cache.size(2), key_cache.size(3),
                  key_cache.size(4)};
  const int64_t x = 16 / static_cast<int64_t>(key_cache.element_size());
  TORCH_CHECK(g.x == x, k, "'s last dimension must be x = 16 // element_size = ", x, ", got ", g.x);
  TORCH_CHECK(key_cache.size(2) * x == g.head_size, k, " head_size // x = ", key_cache.size(2), " does not match ", v,
              " head_size ", g.head_size);
  TORCH_CHECK(value_cache.size(0) == g.num_blocks && value_cache.size(1) == g.num_kv_heads &&
                  value_cache.size(3) == g.block_size,
              k, " ", key_cache.sizes(), " and ", v, " ", value_cache.sizes(), " do not match");
  return g;
}

// A float32 scale tensor of shape [1] or [num_heads] as one value per head.
inline std::vector<float> check_scale(const at::Tensor& scale, int64_t num_heads, const char* name) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat, name, " must be a float32 tensor, got ", scale.scalar_type());
  TORCH_CHECK(scale.device().is_cpu(), name, " must be a CPU tensor for the CPU ops");
  TORCH_CHECK(scale.numel() == 1 || scale.numel() == num_heads, name, " must have 1 or ", num_heads,
              " (one per KV head) elements, got shape ", scale.sizes());
  const at::Tensor s = scale.contiguous();
  const float* p = s.data_ptr<float>();
  std::vector<float> out(static_cast<size_t>(num_heads));
  for (int64_t h = 0; h < num_heads; ++h) out[h] = p[scale.numel() == 1 ? 0 : h];
  return out;
}


inline void check_model_dtype(const at::Tensor& t, const char* name) {
  const auto d = t.scalar_type();
  TORCH_CHECK(d == at::kFloat || d == at::kBFloat16 || d == at::kHalf, name,
              " must be float32, bfloat16 or float16, got ", d);
}

}  // namespace fp8kv::cpu
