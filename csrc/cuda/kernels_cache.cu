// Launchers of the cache-write and decoder-layer kernels and their explicit instantiations. The kernel
// translation units (kernels_*.cu) are torch-free, so the compile checks build them for several GPU
// architectures with nvcc and, as HIP source, with hipcc (scripts/compile_check.sh); they are split so that a
// build compiles them in parallel.
#include "cache_kernels.cuh"
#include "launch.h"
#include "layer_kernels.cuh"

namespace fp8kv::gpu {

// One block of `threads` per row (token) of a call's `blocks`; none for an empty call.
template <typename Args>
Error launch_per_row(void (*kernel)(Args), int64_t blocks, int threads, const Args& args, Stream stream) {
  if (blocks == 0) return kSuccess;
  kernel<<<dim3(static_cast<unsigned>(blocks)), dim3(threads), 0, stream>>>(args);
  return last_launch_error();
}

template <typename scalar_t, typename cache_t, Fp8Format kFormat>
Error launch_reshape_and_cache(const ReshapeAndCacheArgs<scalar_t, cache_t>& args, Stream stream) {
  return launch_per_row(reshape_and_cache_kernel<scalar_t, cache_t, kFormat>, args.num_tokens, kCacheThreads, args,
                        stream);
}

// The decoder-layer ops' launchers, launch_rms_norm<T> and its kind: one block of kLayerThreads per row.
#define FP8KV_LAYER_LAUNCHER(launcher, kernel, Args, rows)                    \
  template <typename T>                                                       \
  Error launcher(const Args<T>& args, Stream stream) {                        \
    return launch_per_row(kernel<T>, args.rows, kLayerThreads, args, stream); \
  }

FP8KV_LAYER_LAUNCHER(launch_rms_norm, rms_norm_kernel, RowsArgs, rows)
FP8KV_LAYER_LAUNCHER(launch_fused_add_rms_norm, fused_add_rms_norm_kernel, RowsArgs, rows)
FP8KV_LAYER_LAUNCHER(launch_rotary, rotary_kernel, RotaryArgs, tokens)
FP8KV_LAYER_LAUNCHER(launch_silu_and_mul, silu_and_mul_kernel, SiluMulArgs, rows)
#undef FP8KV_LAYER_LAUNCHER

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
