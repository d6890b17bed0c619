// The argument checks of the dynamic scale caches that every backend shares (torch-dependent, unlike
// common/dynamic_scale.h, whose math the kernels use).
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace fp8kv {

// The scale caches' bits (nullptr, nullptr: static scales).
struct ScaleCaches {
  uint16_t* k = nullptr;
  uint16_t* v = nullptr;
  bool dynamic() const { return k != nullptr; }
};

// Both scale caches or neither; bfloat16 [num_blocks, num_kv_heads, block_size] of the backend's checked cache
// geometry `g`, contiguous, on the caches' `device`, and only beside an FP8 cache (an "auto" cache holds the
// values themselves).
template <typename Geometry>
inline ScaleCaches check_scale_caches(const std::optional<at::Tensor>& k_scale_cache,
                                      const std::optional<at::Tensor>& v_scale_cache, const Geometry& g, bool fp8,
                                      const at::Device& device) {
  if (!k_scale_cache.has_value() && !v_scale_cache.has_value()) return {};
  TORCH_CHECK(k_scale_cache.has_value() && v_scale_cache.has_value(),
              "give both k_scale_cache and v_scale_cache (dynamic scales) or neither (static scales)");
  TORCH_CHECK(fp8, "an 'auto' cache holds the values themselves: pass no k_scale_cache / v_scale_cache");
  for (const at::Tensor* t : {&*k_scale_cache, &*v_scale_cache}) {
    const char* name = t == &*k_scale_cache ? "k_scale_cache" : "v_scale_cache";
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->size(0) == g.num_blocks &&
                    t->size(1) == g.num_kv_heads && t->size(2) == g.block_size,
                name, " must be bfloat16 [num_blocks=", g.num_blocks, ", num_kv_heads=", g.num_kv_heads,
                ", block_size=", g.block_size, "], got ", t->scalar_type(), " ", t->sizes(),
                "; allocate it with fp8cache.kvcache.dynamic_scales.allocate_scale_caches");
    TORCH_CHECK(t->device() == device, name, " is on ", t->device(), " but the caches are on ", device,
                "; move it with .to(", device, ")");
    TORCH_CHECK(t->is_contiguous(), name, " must be contiguous");
  }
  return {static_cast<uint16_t*>(k_scale_cache->data_ptr()), static_cast<uint16_t*>(v_scale_cache->data_ptr())};
}

}  // namespace fp8kv
