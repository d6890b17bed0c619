// launch_source<Src>: the attention kernel of one cache source over a call's grid. Defined here for the
// translation units that instantiate it (kernels_attention_*.cu, one source kind each, compiled in parallel);
// kernels_attention.cu dispatches to them.
#pragma once

#include <atomic>

#include "attention_kernels.cuh"
#include "attention_tc_kernels.cuh"
#include "launch.h"

namespace fp8kv::gpu {

template <class Src>
Error launch_source(const AttentionParams& p, int splits, Stream stream);

#if defined(FP8KV_PLATFORM_CUDA)
// The tensor-core kernel of a paged cache (instantiated in kernels_attention_tc_*.cu, one cache type each).
template <typename cache_t, Fp8Format kFormat>
Error launch_tc(const AttentionParams& p, int splits, Stream stream);

// Kernels may use more than the default 48 KB of dynamic shared memory only once told so, per device.
template <class Cfg>
Error allow_shared_memory(int bytes) {
  constexpr int kDevices = 64;
  static std::atomic<int> allowed[kDevices] = {};
  int device = 0;
  if (const Error error = cudaGetDevice(&device); error != kSuccess) return error;
  if (device >= 0 && device < kDevices && allowed[device].load(std::memory_order_relaxed) >= bytes) return kSuccess;
  const Error error = cudaFuncSetAttribute(tc_attention_kernel<Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (error == kSuccess && device >= 0 && device < kDevices) allowed[device].store(bytes, std::memory_order_relaxed);
  return error;
}

template <typename cache_t, Fp8Format kFormat>
Error launch_tc(const AttentionParams& p, int splits, Stream stream) {
  const int group = p.num_heads / p.num_kv_heads;
  const dim3 grid(static_cast<unsigned>(p.num_kv_heads * tc_head_blocks(group, p.head_size)), p.num_seqs, splits);
  Error error = kInvalidValue;
  with_tc_config<cache_t, kFormat>(p.head_size, group, p.query_dtype == DType::kF32, [&](auto config) {
    using Cfg = decltype(config);
    error = allow_shared_memory<Cfg>(p.tc_smem_bytes);
    if (error != kSuccess) return;
    tc_attention_kernel<Cfg><<<grid, dim3(kTcThreads), p.tc_smem_bytes, stream>>>(p);
    error = last_launch_error();
  });
  return error;
}

#define FP8KV_DECLARE_TC(cache_t, format) \
  extern template Error launch_tc<cache_t, format>(const AttentionParams&, int, Stream);
#define FP8KV_INSTANTIATE_TC(cache_t, format) \
  template Error launch_tc<cache_t, format>(const AttentionParams&, int, Stream);
FP8KV_DECLARE_TC(uint8_t, Fp8Format::E4M3FN)
FP8KV_DECLARE_TC(uint8_t, Fp8Format::E5M2)
FP8KV_DECLARE_TC(uint8_t, Fp8Format::E4M3FNUZ)
FP8KV_DECLARE_TC(half_t, Fp8Format::E4M3FN)
FP8KV_DECLARE_TC(bf16_t, Fp8Format::E4M3FN)
#endif

#if !defined(FP8KV_PLATFORM_HOST)
template <class Src>
Error launch_source(const AttentionParams& p, int splits, Stream stream) {
  const int group = p.num_heads / p.num_kv_heads;
#if defined(FP8KV_PLATFORM_CUDA)
  if constexpr (Src::kBlockIds && !std::is_same_v<typename Src::Cache, float>) {
    if (p.tensor_cores) return launch_tc<typename Src::Cache, Src::kFmt>(p, splits, stream);
  }
#endif
  const dim3 grid(static_cast<unsigned>(p.num_kv_heads * head_blocks_for(group, p.head_size)), p.num_seqs, splits);
  with_attention_shape(p.head_size, group, [&](auto chunks, auto heads) {
    attention_kernel<Src, decltype(chunks)::value, decltype(heads)::value>
        <<<grid, dim3(kAttentionThreads), 0, stream>>>(p);
  });
  return last_launch_error();
}
#endif

// The sources whose kernels exist (one name each, so that the macros below take them as one argument).
using PagedE4M3 = PagedSource<uint8_t, Fp8Format::E4M3FN>;
using PagedE5M2 = PagedSource<uint8_t, Fp8Format::E5M2>;
using PagedE4M3Fnuz = PagedSource<uint8_t, Fp8Format::E4M3FNUZ>;
using PagedF32 = PagedSource<float, Fp8Format::E4M3FN>;
using PagedF16 = PagedSource<half_t, Fp8Format::E4M3FN>;
using PagedBF16 = PagedSource<bf16_t, Fp8Format::E4M3FN>;
using RingF32 = RingSource<float>;
using RingF16 = RingSource<half_t>;
using RingBF16 = RingSource<bf16_t>;

#define FP8KV_FOR_EACH_FP8_SOURCE(X) X(PagedE4M3) X(PagedE5M2) X(PagedE4M3Fnuz)
#define FP8KV_FOR_EACH_AUTO_SOURCE(X) X(PagedF32) X(PagedF16) X(PagedBF16)
#define FP8KV_FOR_EACH_RING_SOURCE(X) X(RingF32) X(RingF16) X(RingBF16)

#define FP8KV_DECLARE_SOURCE(Src) extern template Error launch_source<Src>(const AttentionParams&, int, Stream);
#define FP8KV_INSTANTIATE_SOURCE(Src) template Error launch_source<Src>(const AttentionParams&, int, Stream);

}  // namespace fp8kv::gpu
