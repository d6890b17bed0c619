// reshape_and_cache: write each token's K and V into its slot of the paged caches, quantizing on the way.
//
// One thread block per token; each thread takes one 16-byte chunk of the key cache row (x elements of
// one head), so the key side is one wide store, and the value side x scattered element stores (the value
// cache keeps tokens innermost, docs/design.md section 4).
#pragma once

#include "cache_codec.cuh"
#include "launch.h"

namespace fp8kv::gpu {

constexpr int kCacheThreads = 128;

template <typename scalar_t, typename cache_t, Fp8Format kFormat, class Thread>
FP8KV_DEVICE void reshape_and_cache_body(const ReshapeAndCacheArgs<scalar_t, cache_t>& a, const Thread& th) {
  using Codec = CacheCodec<scalar_t, cache_t, kFormat>;
  constexpr int X = Codec::kX;
  const int64_t token = th.block_x();
  const int64_t slot = a.slot_mapping[token];
  if (slot < 0) return;  // padding
  if (slot >= a.num_slots) {
    if (th.index() == 0) report_error(a.error_flag, kErrorSlotOutOfRange);
    return;
  }
  const int64_t block = slot / a.block_size;
  const int offset = static_cast<int>(slot % a.block_size);
  const int chunks_per_head = a.head_size / X;

  for (int i = th.index(); i < a.num_kv_heads * chunks_per_head; i += kCacheThreads) {
    const int head = i / chunks_per_head;
    const int chunk = i % chunks_per_head;
    const scalar_t* k = a.key + token * a.key_token_stride + head * a.key_head_stride + chunk * X;
    const scalar_t* v = a.value + token * a.value_token_stride + head * a.value_head_stride + chunk * X;
    const float k_scale = Codec::scale_of(a.k_scale, a.k_scale_per_head, head);
    const float v_scale = Codec::scale_of(a.v_scale, a.v_scale_per_head, head);

    // key_cache[block, head, chunk, offset, :] = k[chunk * X : (chunk + 1) * X]
    Vec<cache_t, X> k_chunk;
    FP8KV_UNROLL
    for (int j = 0; j < X; ++j) k_chunk.e[j] = Codec::encode(k[j], k_scale);
    store_vec<cache_t, X>(a.key_cache + block * a.key_cache_block_stride + head * a.key_cache_head_stride +
                              (int64_t(chunk) * a.block_size + offset) * X,
                          k_chunk);

    // value_cache[block, head, d, offset] = v[d]
    cache_t* v_out = a.value_cache + block * a.value_cache_block_stride + head * a.value_cache_head_stride +
                     int64_t(chunk) * X * a.block_size + offset;
    FP8KV_UNROLL
    for (int j = 0; j < X; ++j) v_out[int64_t(j) * a.block_size] = Codec::encode(v[j], v_scale);
  }
}

#if !defined(FP8KV_PLATFORM_HOST)
template <typename scalar_t, typename cache_t, Fp8Format kFormat>
__global__ void __launch_bounds__(kCacheThreads)
    reshape_and_cache_kernel(const ReshapeAndCacheArgs<scalar_t, cache_t> args) {
  reshape_and_cache_body<scalar_t, cache_t, kFormat>(args, GpuThread{});
}
#endif

}  // namespace fp8kv::gpu
