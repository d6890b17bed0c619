// Torch-free interface between the torch bindings (torch_bindings_cuda.cu) and the kernels
// (kernels_instantiate.cu): plain pointers, sizes and strides in elements.
//
// Type arguments: scalar_t is the model dtype (float, gpu::half_t, gpu::bf16_t); cache_t is uint8_t for an
// FP8 cache, whose format is kFormat, or scalar_t for an "auto" cache (kFormat is then unused and given as
// Fp8Format::E4M3FN). Every such combination is instantiated once, in kernels_instantiate.cu.
#pragma once

#include <cstdint>

#include "platform.cuh"

namespace fp8kv::gpu {

// Bits of the error flag. The kernels never read or write outside the cache; they skip what is out of
// range, set a bit, and the binding raises once the kernel is done.
constexpr int kErrorSlotOutOfRange = 1;   // slot_mapping holds a slot >= num_blocks * block_size
constexpr int kErrorBlockOutOfRange = 2;  // block_tables holds a block id outside [0, num_blocks)
constexpr int kErrorSeqLenOutOfRange = 4;  // seq_len < 0, > max_seq_len, or past the block table's end

constexpr int kPartitionSize = 512;  // tokens per thread block in paged attention (v2-style partitions)
constexpr int kMaxHeadSize = 256;
constexpr int kSupportedHeadSizes[] = {64, 80, 96, 112, 128, 256};
constexpr int kSupportedBlockSizes[] = {8, 16, 32};

template <typename scalar_t, typename cache_t>
struct ReshapeAndCacheArgs {
  const scalar_t* key;    // [num_tokens, num_kv_heads, head_size], last dim contiguous
  const scalar_t* value;  // same
  cache_t* key_cache;     // [num_blocks, num_kv_heads, head_size / x, block_size, x]
  cache_t* value_cache;   // [num_blocks, num_kv_heads, head_size, block_size]
  const int64_t* slot_mapping;  // [num_tokens]; negative = padding, skipped
  const float* k_scale;         // [1] or [num_kv_heads]
  const float* v_scale;
  int* error_flag;  // one int, zeroed by the caller
  int64_t num_tokens;
  int num_kv_heads;
  int head_size;
  int block_size;
  int64_t num_slots;  // num_blocks * block_size
  int64_t key_token_stride, key_head_stride;
  int64_t value_token_stride, value_head_stride;
  int64_t key_cache_block_stride, key_cache_head_stride;  // inner dims contiguous
  int64_t value_cache_block_stride, value_cache_head_stride;
  bool k_scale_per_head, v_scale_per_head;
};

template <typename scalar_t, typename cache_t>
struct PagedAttentionArgs {
  scalar_t* out;             // [num_seqs, num_heads, head_size], contiguous
  float* partial_out;        // [num_seqs, num_heads, num_partitions, head_size]; unused if 1 partition
  float* partial_max;        // [num_seqs, num_heads, num_partitions]
  float* partial_sum;        // [num_seqs, num_heads, num_partitions]
  const scalar_t* query;     // [num_seqs, num_heads, head_size], last dim contiguous
  const cache_t* key_cache;  // layouts as above, inner dims contiguous
  const cache_t* value_cache;
  const int* block_tables;   // [num_seqs, max_blocks_per_seq], last dim contiguous
  const int* seq_lens;       // [num_seqs]
  const float* alibi_slopes;  // [num_heads] or nullptr
  const float* k_scale;
  const float* v_scale;
  int* error_flag;
  int num_seqs, num_heads, num_kv_heads, head_size, block_size;
  int num_blocks, max_blocks_per_seq, max_seq_len, num_partitions;
  float scale;
  int64_t query_seq_stride, query_head_stride;
  int64_t block_table_stride;
  int64_t key_cache_block_stride, key_cache_head_stride;
  int64_t value_cache_block_stride, value_cache_head_stride;
  bool k_scale_per_head, v_scale_per_head;
};

inline int num_partitions_for(int max_seq_len) {
  const int n = (max_seq_len + kPartitionSize - 1) / kPartitionSize;
  return n > 0 ? n : 1;
}

// Both return the launch error (success when nothing was launched). Preconditions are checked by the
// binding: supported head/block size, 16-byte aligned caches, sizes within grid limits.
template <typename scalar_t, typename cache_t, Fp8Format kFormat>
Error launch_reshape_and_cache(const ReshapeAndCacheArgs<scalar_t, cache_t>& args, Stream stream);

template <typename scalar_t, typename cache_t, Fp8Format kFormat>
Error launch_paged_attention(const PagedAttentionArgs<scalar_t, cache_t>& args, Stream stream);

// Every (scalar_t, cache_t, kFormat) the kernels are built for; X is a macro taking the three.
#define FP8KV_FOR_EACH_CACHE_TYPE_OF(X, scalar_t)                  \
  X(scalar_t, scalar_t, ::fp8kv::Fp8Format::E4M3FN)               \
  X(scalar_t, uint8_t, ::fp8kv::Fp8Format::E4M3FN)                \
  X(scalar_t, uint8_t, ::fp8kv::Fp8Format::E5M2)                  \
  X(scalar_t, uint8_t, ::fp8kv::Fp8Format::E4M3FNUZ)

#define FP8KV_FOR_EACH_KERNEL_TYPE(X)                         \
  FP8KV_FOR_EACH_CACHE_TYPE_OF(X, float)                     \
  FP8KV_FOR_EACH_CACHE_TYPE_OF(X, ::fp8kv::gpu::half_t)      \
  FP8KV_FOR_EACH_CACHE_TYPE_OF(X, ::fp8kv::gpu::bf16_t)

}  // namespace fp8kv::gpu
