// Launchers of the cache kernels and their explicit instantiations: the only translation unit that holds
// device code. Torch-free, so the compile checks build it for several GPU architectures with nvcc and, as
// HIP source, with hipcc (scripts/compile_check.sh).
#include "attention_kernels.cuh"
#include "cache_kernels.cuh"
#include "launch.h"

namespace fp8kv::gpu {

template <typename scalar_t, typename cache_t, Fp8Format kFormat>
Error launch_reshape_and_cache(const ReshapeAndCacheArgs<scalar_t, cache_t>& args, Stream stream) {
  if (args.num_tokens == 0) return kSuccess;
  reshape_and_cache_kernel<scalar_t, cache_t, kFormat>
      <<<dim3(static_cast<unsigned>(args.num_tokens)), dim3(kCacheThreads), 0, stream>>>(args);
  return last_launch_error();
}

template <typename scalar_t, typename cache_t, Fp8Format kFormat>
Error launch_paged_attention(const PagedAttentionArgs<scalar_t, cache_t>& args, Stream stream) {
  if (args.num_seqs == 0 || args.num_heads == 0) return kSuccess;
  const dim3 grid(args.num_heads, args.num_seqs, args.num_partitions);
  const dim3 block(kAttentionThreads);
  switch (args.block_size) {
    case 8:
      paged_attention_kernel<scalar_t, cache_t, kFormat, 8><<<grid, block, 0, stream>>>(args);
      break;
    case 16:
      paged_attention_kernel<scalar_t, cache_t, kFormat, 16><<<grid, block, 0, stream>>>(args);
      break;
    case 32:
      paged_attention_kernel<scalar_t, cache_t, kFormat, 32><<<grid, block, 0, stream>>>(args);
      break;
    default:
      return kInvalidValue;
  }
  const Error error = last_launch_error();
  if (error != kSuccess || args.num_partitions == 1) return error;
  paged_attention_reduce_kernel<scalar_t, cache_t>
      <<<dim3(args.num_heads, args.num_seqs), block, 0, stream>>>(args);
  return last_launch_error();
}

#define FP8KV_INSTANTIATE(scalar_t, cache_t, format)                \
  template Error launch_reshape_and_cache<scalar_t, cache_t, format>( \
      const ReshapeAndCacheArgs<scalar_t, cache_t>&, Stream);        \
  template Error launch_paged_attention<scalar_t, cache_t, format>(   \
      const PagedAttentionArgs<scalar_t, cache_t>&, Stream);

FP8KV_FOR_EACH_KERNEL_TYPE(FP8KV_INSTANTIATE)

#undef FP8KV_INSTANTIATE

}  // namespace fp8kv::gpu
