// launch_paged_attention(_window): the cache type of a call picks its source's kernels (instantiated in
// kernels_attention_fp8/auto/ring.cu), then the splits are merged. Torch-free.
#include "attention_launch.cuh"

namespace fp8kv::gpu {

FP8KV_FOR_EACH_FP8_SOURCE(FP8KV_DECLARE_SOURCE)
FP8KV_FOR_EACH_AUTO_SOURCE(FP8KV_DECLARE_SOURCE)
FP8KV_FOR_EACH_RING_SOURCE(FP8KV_DECLARE_SOURCE)

namespace {

__global__ void __launch_bounds__(kAttentionThreads) attention_reduce_kernel(const AttentionParams params) {
  __shared__ ReduceSmem smem;
  attention_reduce_body(params, smem, GpuThread{});
}

Error launch_paged(const AttentionParams& p, int splits, Stream stream) {
  switch (p.paged.dtype) {
    case DType::kF32: return launch_source<PagedF32>(p, splits, stream);
    case DType::kF16: return launch_source<PagedF16>(p, splits, stream);
    case DType::kBF16: return launch_source<PagedBF16>(p, splits, stream);
    case DType::kE4M3FN: return launch_source<PagedE4M3>(p, splits, stream);
    case DType::kE5M2: return launch_source<PagedE5M2>(p, splits, stream);
    case DType::kE4M3FNUZ: return launch_source<PagedE4M3Fnuz>(p, splits, stream);
  }
  return kInvalidValue;
}

Error launch_ring(const AttentionParams& p, int splits, Stream stream) {
  switch (p.ring.dtype) {
    case DType::kF32: return launch_source<RingF32>(p, splits, stream);
    case DType::kF16: return launch_source<RingF16>(p, splits, stream);
    case DType::kBF16: return launch_source<RingBF16>(p, splits, stream);
    default: return kInvalidValue;
  }
}

Error launch_reduce(const AttentionParams& p, Stream stream) {
  attention_reduce_kernel<<<dim3(p.num_heads, p.num_seqs), dim3(kAttentionThreads), 0, stream>>>(p);
  return last_launch_error();
}

}  // namespace

Error launch_paged_attention(const AttentionParams& p, Stream stream) {
  if (p.num_seqs == 0 || p.num_heads == 0) return kSuccess;
  if (p.window_starts != nullptr || p.paged_splits < 1) return kInvalidValue;
  const Error error = launch_paged(p, p.paged_splits, stream);
  if (error != kSuccess || (p.paged_splits == 1 && p.sinks == nullptr)) return error;
  return launch_reduce(p, stream);
}

Error launch_paged_attention_window(const AttentionParams& p, Stream stream) {
  if (p.num_seqs == 0 || p.num_heads == 0) return kSuccess;
  if (p.window_starts == nullptr || p.paged_splits < 1 || p.ring_splits < 1) return kInvalidValue;
  Error error = launch_paged(p, p.paged_splits, stream);
  if (error == kSuccess) error = launch_ring(p, p.ring_splits, stream);
  if (error != kSuccess) return error;
  return launch_reduce(p, stream);
}

}  // namespace fp8kv::gpu
