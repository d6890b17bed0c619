// Launchers of the cache-write and decoder-layer kernels and their explicit instantiations. The kernel
// translation units (kernels_*.cu) are torch-free, so the compile checks build them for several GPU
// architectures with nvcc and, as HIP source, with hipcc (scripts/compile_check.sh); they are split so that a
// build compiles them in parallel.
#include "cache_kernels.cuh"
#include "launch.h"
#include "layer_kernels.cuh"

namespace fp8kv::gpu {

template <typename scalar_t, typename cache_t, Fp8Format kFormat>
Error launch_reshape_and_cache(const ReshapeAndCacheArgs<scalar_t, cache_t>& args, Stream stream) {
  if (args.num_tokens == 0) return kSuccess;
  reshape_and_cache_kernel<scalar_t, cache_t, kFormat>
      <<<dim3(static_cast<unsigned>(args.num_tokens)), dim3(kCacheThreads), 0, stream>>>(args);
  return last_launch_error();
}

template <typename T>
Error launch_rms_norm(const RowsArgs<T>& args, Stream stream) {
  if (args.rows == 0) return kSuccess;
  rms_norm_kernel<T><<<dim3(static_cast<unsigned>(args.rows)), dim3(kLayerThreads), 0, stream>>>(args);
  return last_launch_error();
}

template <typename T>
Error launch_fused_add_rms_norm(const RowsArgs<T>& args, Stream stream) {
  if (args.rows == 0) return kSuccess;
  fused_add_rms_norm_kernel<T><<<dim3(static_cast<unsigned>(args.rows)), dim3(kLayerThreads), 0, stream>>>(args);
  return last_launch_error();
}

template <typename T>
Error launch_rotary(const RotaryArgs<T>& args, Stream stream) {
  if (args.tokens == 0) return kSuccess;
  rotary_kernel<T><<<dim3(static_cast<unsigned>(args.tokens)), dim3(kLayerThreads), 0, stream>>>(args);
  return last_launch_error();
}

template <typename T>
Error launch_silu_and_mul(const SiluMulArgs<T>& args, Stream stream) {
  if (args.rows == 0) return kSuccess;
  silu_and_mul_kernel<T><<<dim3(static_cast<unsigned>(args.rows)), dim3(kLayerThreads), 0, stream>>>(args);
  return last_launch_error();
}

#define FP8KV_INSTANTIATE_LAYER(T)                                         \
  template Error launch_rms_norm<T>(const RowsArgs<T>&, Stream);           \
  template Error launch_fused_add_rms_norm<T>(const RowsArgs<T>&, Stream); \
  template Error launch_rotary<T>(const RotaryArgs<T>&, Stream);           \
  template Error launch_silu_and_mul<T>(const SiluMulArgs<T>&, Stream);

FP8KV_INSTANTIATE_LAYER(float)
FP8KV_INSTANTIATE_LAYER(half_t)
FP8KV_INSTANTIATE_LAYER(bf16_t)
#undef FP8KV_INSTANTIATE_LAYER

#define FP8KV_INSTANTIATE(scalar_t, cache_t, format)                \
  template Error launch_reshape_and_cache<scalar_t, cache_t, format>( \
      const ReshapeAndCacheArgs<scalar_t, cache_t>&, Stream);

FP8KV_FOR_EACH_KERNEL_TYPE(FP8KV_INSTANTIATE)
#undef FP8KV_INSTANTIATE

}  // namespace fp8kv::gpu
