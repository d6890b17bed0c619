// Launchers of the cache and attention kernels and their explicit instantiations: the translation unit that
// holds their device code. Torch-free, so the compile checks build it for several GPU architectures with nvcc
// and, as HIP source, with hipcc (scripts/compile_check.sh).
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
  const dim3 block(kAttentionThreads);
  bool launched = false;
  with_heads_per_block(args.num_heads, args.num_kv_heads, [&](auto heads) {
    constexpr int kHeads = decltype(heads)::value;
    const dim3 grid(args.num_heads / kHeads, args.num_seqs, args.num_partitions);
    launched = with_block_size(args.block_size, [&](auto block_size) {
      paged_attention_kernel<scalar_t, cache_t, kFormat, decltype(block_size)::value, kHeads>
          <<<grid, block, 0, stream>>>(args);
    });
  });
  if (!launched) return kInvalidValue;
  const Error error = last_launch_error();
  if (error != kSuccess || args.num_partitions == 1) return error;
  paged_attention_reduce_kernel<scalar_t, cache_t>
      <<<dim3(args.num_heads, args.num_seqs), block, 0, stream>>>(args);
  return last_launch_error();
}

template <typename scalar_t, typename cache_t, Fp8Format kFormat, typename window_t>
Error launch_paged_attention_window(const PagedAttentionWindowArgs<scalar_t, cache_t, window_t>& args,
                                    Stream stream) {
  const PagedAttentionArgs<scalar_t, cache_t>& a = args.paged;
  const WindowPositions& w = args.positions;
  if (a.num_seqs == 0 || a.num_heads == 0) return kSuccess;
  if (a.num_partitions != w.num_fp8_partitions + w.num_window_partitions || w.num_fp8_partitions < 1 ||
      w.num_window_partitions < 1) {
    return kInvalidValue;
  }
  const dim3 block(kAttentionThreads);
  Error error = kSuccess;
  bool launched = false;
  with_heads_per_block(a.num_heads, a.num_kv_heads, [&](auto heads) {
    constexpr int kHeads = decltype(heads)::value;
    const unsigned head_blocks = static_cast<unsigned>(a.num_heads / kHeads);
    launched = with_block_size(a.block_size, [&](auto block_size) {
      constexpr int kBlockSize = decltype(block_size)::value;
      window_paged_part_kernel<scalar_t, cache_t, kFormat, kBlockSize, kHeads>
          <<<dim3(head_blocks, a.num_seqs, w.num_fp8_partitions), block, 0, stream>>>(a, w);
      error = last_launch_error();
      if (error != kSuccess) return;
      window_ring_part_kernel<scalar_t, cache_t, window_t, kBlockSize, kHeads>
          <<<dim3(head_blocks, a.num_seqs, w.num_window_partitions), block, 0, stream>>>(a, w, args.window);
      error = last_launch_error();
    });
  });
  if (!launched) return kInvalidValue;
  if (error != kSuccess) return error;
  paged_attention_window_reduce_kernel<scalar_t, cache_t>
      <<<dim3(a.num_heads, a.num_seqs), block, 0, stream>>>(a, w);
  return last_launch_error();
}

#define FP8KV_INSTANTIATE_WINDOW(scalar_t, cache_t, format, window_t)            \
  template Error launch_paged_attention_window<scalar_t, cache_t, format, window_t>( \
      const PagedAttentionWindowArgs<scalar_t, cache_t, window_t>&, Stream);

#define FP8KV_INSTANTIATE(scalar_t, cache_t, format)                \
  template Error launch_reshape_and_cache<scalar_t, cache_t, format>( \
      const ReshapeAndCacheArgs<scalar_t, cache_t>&, Stream);        \
  template Error launch_paged_attention<scalar_t, cache_t, format>(   \
      const PagedAttentionArgs<scalar_t, cache_t>&, Stream);        \
  FP8KV_FOR_EACH_WINDOW_TYPE_OF(FP8KV_INSTANTIATE_WINDOW, scalar_t, cache_t, format)

FP8KV_FOR_EACH_KERNEL_TYPE(FP8KV_INSTANTIATE)

#undef FP8KV_INSTANTIATE
#undef FP8KV_INSTANTIATE_WINDOW

}  // namespace fp8kv::gpu
