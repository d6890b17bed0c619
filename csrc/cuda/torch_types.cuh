// torch's element types -> the kernels' (same size and bits), for the torch bindings only: the kernels
// themselves stay torch-free. Include after launch.h / hadamard.cuh (they bring the HIP runtime first).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "platform.cuh"

namespace fp8kv::gpu {

template <typename T>
struct KernelTypeOf {
  using type = T;
};
template <>
struct KernelTypeOf<c10::Half> {
  using type = half_t;
};
template <>
struct KernelTypeOf<c10::BFloat16> {
  using type = bf16_t;
};
template <typename T>
using kernel_t = typename KernelTypeOf<T>::type;

static_assert(sizeof(half_t) == sizeof(c10::Half) && sizeof(bf16_t) == sizeof(c10::BFloat16));

}  // namespace fp8kv::gpu
