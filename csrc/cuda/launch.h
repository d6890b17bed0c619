// Torch-free interface between the torch bindings (torch_bindings_cuda.cu) and the kernels
// (kernels_instantiate.cu): plain pointers, sizes and strides in elements.
//
// Type arguments: scalar_t is the model dtype (float, gpu::half_t, gpu::bf16_t); cache_t is uint8_t for an
// FP8 cache, whose format is kFormat, or scalar_t for an "auto" cache (kFormat is then unused and given as
// Fp8Format::E4M3FN). Every such combination is instantiated once, in kernels_instantiate.cu.
#pragma once

#include <cstdint>
#include <type_traits>

#include "platform.cuh"

namespace fp8kv::gpu {

// Bits of the error flag. The kernels never read or write outside the cache; they skip what is out of
// range, set a bit, and the binding raises once the kernel is done.
constexpr int kErrorSlotOutOfRange = 1;   // slot_mapping holds a slot >= num_blocks * block_size
constexpr int kErrorBlockOutOfRange = 2;  // block_tables holds a block id outside [0, num_blocks)
constexpr int kErrorSeqLenOutOfRange = 4;  // seq_len < 0, > max_seq_len, or past the block table's end
constexpr int kErrorWindowStartOutOfRange = 8;   // outside [max(0, seq_len - window_size), seq_len]
constexpr int kErrorWindowBlockOutOfRange = 16;  // window_block_tables: an id outside [0, num_window_blocks)

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

// paged_attention_window: positions [0, window_start) from the paged cache, as paged_attention reads them,
// and [window_start, seq_len) from the window cache, a ring of window_t (float, half_t or bf16_t; an "auto"
// cache layout) where position p sits at ring slot p % window_size, in block
// window_block_tables[seq][slot / block_size]. Partitions [0, num_fp8_partitions) cover the paged part, the
// others the window (num_window_partitions); one softmax over all.

// Where each sequence's window starts: all that the paged part and the merge need of the window.
struct WindowPositions {
  const int* window_starts;  // [num_seqs]
  int window_size;
  int num_fp8_partitions, num_window_partitions;
};

template <typename window_t>
struct WindowCache {
  const window_t* key_cache;    // [num_blocks, num_kv_heads, head_size / x, block_size, x]
  const window_t* value_cache;  // [num_blocks, num_kv_heads, head_size, block_size]
  const int* block_tables;      // [num_seqs, >= ceil(window_size / block_size)], last dim contiguous
  int num_blocks;
  int64_t block_table_stride;
  int64_t key_block_stride, key_head_stride, value_block_stride, value_head_stride;
};

template <typename scalar_t, typename cache_t, typename window_t>
struct PagedAttentionWindowArgs {
  PagedAttentionArgs<scalar_t, cache_t> paged;  // num_partitions counts both kinds; partials always used
  WindowPositions positions;
  WindowCache<window_t> window;
};

inline int num_partitions_for(int max_seq_len) {
  const int n = (max_seq_len + kPartitionSize - 1) / kPartitionSize;
  return n > 0 ? n : 1;
}

// A window holds at most min(window_size, max_seq_len) positions of a sequence, in partitions that do not
// cross the ring's wrap (attention_kernels.cuh): one more when a sequence can wrap.
inline int num_window_partitions_for(int window_size, int max_seq_len) {
  const bool wraps = window_size < max_seq_len;
  return num_partitions_for(wraps ? window_size : max_seq_len) + (wraps ? 1 : 0);
}

// All return the launch error (success when nothing was launched). Preconditions are checked by the
// binding: supported head/block size, 16-byte aligned caches, sizes within grid limits.
template <typename scalar_t, typename cache_t, Fp8Format kFormat>
Error launch_reshape_and_cache(const ReshapeAndCacheArgs<scalar_t, cache_t>& args, Stream stream);

template <typename scalar_t, typename cache_t, Fp8Format kFormat>
Error launch_paged_attention(const PagedAttentionArgs<scalar_t, cache_t>& args, Stream stream);

template <typename scalar_t, typename cache_t, Fp8Format kFormat, typename window_t>
Error launch_paged_attention_window(const PagedAttentionWindowArgs<scalar_t, cache_t, window_t>& args,
                                    Stream stream);

// fn(std::integral_constant<int, B>{}) for block size B of kSupportedBlockSizes; false for another size.
template <class Fn>
bool with_block_size(int block_size, const Fn& fn) {
  switch (block_size) {
    case 8: fn(std::integral_constant<int, 8>{}); return true;
    case 16: fn(std::integral_constant<int, 16>{}); return true;
    case 32: fn(std::integral_constant<int, 32>{}); return true;
    default: return false;
  }
}

// Every (scalar_t, cache_t, kFormat) the kernels are built for; X is a macro taking the three.
// Query heads per attention thread block: 4 where the GQA group is a multiple of 4, so that four heads read
// and decode each K/V element of their KV head once; otherwise 1.
constexpr int kGroupedHeads = 4;

template <class Fn>
void with_heads_per_block(int num_heads, int num_kv_heads, const Fn& fn) {
  if ((num_heads / num_kv_heads) % kGroupedHeads == 0) {
    fn(std::integral_constant<int, kGroupedHeads>{});
  } else {
    fn(std::integral_constant<int, 1>{});
  }
}

#define FP8KV_FOR_EACH_CACHE_TYPE_OF(X, scalar_t)                  \
  X(scalar_t, scalar_t, ::fp8kv::Fp8Format::E4M3FN)               \
  X(scalar_t, uint8_t, ::fp8kv::Fp8Format::E4M3FN)                \
  X(scalar_t, uint8_t, ::fp8kv::Fp8Format::E5M2)                  \
  X(scalar_t, uint8_t, ::fp8kv::Fp8Format::E4M3FNUZ)

// The window dtypes of paged_attention_window; X is a macro taking (scalar_t, cache_t, kFormat, window_t).
#define FP8KV_FOR_EACH_WINDOW_TYPE_OF(X, scalar_t, cache_t, format) \
  X(scalar_t, cache_t, format, float)                              \
  X(scalar_t, cache_t, format, ::fp8kv::gpu::half_t)               \
  X(scalar_t, cache_t, format, ::fp8kv::gpu::bf16_t)

#define FP8KV_FOR_EACH_KERNEL_TYPE(X)                         \
  FP8KV_FOR_EACH_CACHE_TYPE_OF(X, float)                     \
  FP8KV_FOR_EACH_CACHE_TYPE_OF(X, ::fp8kv::gpu::half_t)      \
  FP8KV_FOR_EACH_CACHE_TYPE_OF(X, ::fp8kv::gpu::bf16_t)

}  // namespace fp8kv::gpu
