// reshape_and_cache: write each token's K and V into its slot of the paged caches, quantizing on the way.
//
// One thread block per token; each thread takes kPiece elements of one head (a quarter of an FP8 key chunk,
// half of a 16-bit one, a whole float32 one), so the key side is one store of kPiece elements and the value
// side kPiece scattered element stores (the value cache keeps tokens innermost, docs/design.md section 4).
// Small pieces because a decode step writes few tokens: the time is each thread's chain of conversions
// (IEEE division and rounding per element), not bytes; with a whole 16-code FP8 chunk per thread the FP8
// write of 64 tokens took 2.2x the bfloat16 write (H200, 2026-11-26).
#pragma once

#include "../common/dynamic_scale.h"
#include "cache_codec.cuh"
#include "launch.h"

namespace fp8kv::gpu {

constexpr int kCacheThreads = 128;
constexpr int kCachePiece = 4;  // elements a thread converts

// Dynamic scales: each warp takes whole heads of the token (its lanes stride over the dims, a shuffle tree takes
// the largest magnitude) and stores the head's K and V scales at the token's slot. NaN is left out: fmaxf keeps
// the number of a (number, NaN) pair, and the running maximum starts at 0.
template <typename scalar_t, typename cache_t, Fp8Format kFormat, class Thread>
FP8KV_DEVICE void write_dynamic_scales(const ReshapeAndCacheArgs<scalar_t, cache_t>& a, const Thread& th,
                                       int64_t token, int64_t at) {
  constexpr int kWarps = kCacheThreads / kWarpSize;
  const int lane = th.index() % kWarpSize;
  for (int head = th.index() / kWarpSize; head < a.num_kv_heads; head += kWarps) {
    const scalar_t* k = a.key + token * a.key_token_stride + head * a.key_head_stride;
    const scalar_t* v = a.value + token * a.value_token_stride + head * a.value_head_stride;
    float k_max = 0.0f, v_max = 0.0f;
    for (int d = lane; d < a.head_size; d += kWarpSize) {
      k_max = fmaxf(k_max, fabsf(to_float(k[d])));
      v_max = fmaxf(v_max, fabsf(to_float(v[d])));
    }
    for (int mask = kWarpSize / 2; mask > 0; mask /= 2) {
      k_max = fmaxf(k_max, th.shfl_xor(k_max, mask));
      v_max = fmaxf(v_max, th.shfl_xor(v_max, mask));
    }
    if (lane == 0) {
      a.k_scale_cache[at + int64_t(head) * a.block_size] = scale_bits(k_max, Fp8Traits<kFormat>::kMax);
      a.v_scale_cache[at + int64_t(head) * a.block_size] = scale_bits(v_max, Fp8Traits<kFormat>::kMax);
    }
  }
}

template <typename scalar_t, typename cache_t, Fp8Format kFormat, class Thread>
FP8KV_DEVICE void reshape_and_cache_body(const ReshapeAndCacheArgs<scalar_t, cache_t>& a, const Thread& th) {
  using Codec = CacheCodec<scalar_t, cache_t, kFormat>;
  constexpr int X = Codec::kX;
  constexpr int kPiece = X < kCachePiece ? X : kCachePiece;
  const int64_t token = th.block_x();
  const int64_t slot = a.slot_mapping[token];
  if (slot < 0) return;  // padding
  if (slot >= a.num_slots) {
    if (th.index() == 0) report_error(a.error_flag, kErrorSlotOutOfRange);
    return;
  }
  const int64_t block = slot / a.block_size;
  const int offset = static_cast<int>(slot % a.block_size);
  const int pieces_per_head = a.head_size / kPiece;
  // The scale cache's index of (block, head 0, offset); a head is block_size further.
  const int64_t scale_at = block * a.num_kv_heads * a.block_size + offset;
  const bool dynamic = Codec::kQuantized && a.k_scale_cache != nullptr;
  if (dynamic) {  // uniform over the block: every thread reaches the barrier
    write_dynamic_scales<scalar_t, cache_t, kFormat>(a, th, token, scale_at);
    th.sync();  // the scales in global memory, visible to the block's other warps
  }

  for (int i = th.index(); i < a.num_kv_heads * pieces_per_head; i += kCacheThreads) {
    const int head = i / pieces_per_head;
    const int first = (i % pieces_per_head) * kPiece;  // dim of the piece's first element
    const int chunk = first / X;
    const scalar_t* k = a.key + token * a.key_token_stride + head * a.key_head_stride + first;
    const scalar_t* v = a.value + token * a.value_token_stride + head * a.value_head_stride + first;
    float k_scale = Codec::scale_of(a.k_scale, a.k_scale_per_head, head);
    float v_scale = Codec::scale_of(a.v_scale, a.v_scale_per_head, head);
    if (dynamic) {  // their reciprocals, to multiply by
      k_scale = 1.0f / scale_value(a.k_scale_cache[scale_at + int64_t(head) * a.block_size]);
      v_scale = 1.0f / scale_value(a.v_scale_cache[scale_at + int64_t(head) * a.block_size]);
    }
    const auto encode = [dynamic](scalar_t x, float scale) {
      return dynamic ? Codec::encode_times(x, scale) : Codec::encode(x, scale);
    };

    // key_cache[block, head, chunk, offset, first % X : + kPiece] = k[first : first + kPiece]
    Vec<cache_t, kPiece> k_piece;
    FP8KV_UNROLL
    for (int j = 0; j < kPiece; ++j) k_piece.e[j] = encode(k[j], k_scale);
    store_vec<cache_t, kPiece>(a.key_cache + block * a.key_cache_block_stride + head * a.key_cache_head_stride +
                                   (int64_t(chunk) * a.block_size + offset) * X + first % X,
                               k_piece);

    // value_cache[block, head, d, offset] = v[d]
    cache_t* v_out = a.value_cache + block * a.value_cache_block_stride + head * a.value_cache_head_stride +
                     int64_t(first) * a.block_size + offset;
    FP8KV_UNROLL
    for (int j = 0; j < kPiece; ++j) v_out[int64_t(j) * a.block_size] = encode(v[j], v_scale);
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
