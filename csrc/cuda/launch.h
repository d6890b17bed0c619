// Torch-free interface between the torch bindings (torch_bindings_cuda.cu) and the kernels
// (kernels_*.cu): plain pointers, sizes and strides in elements.
//
// Type arguments: scalar_t is the model dtype (float, gpu::half_t, gpu::bf16_t); cache_t is uint8_t for an
// FP8 cache, whose format is kFormat, or scalar_t for an "auto" cache (kFormat is then unused and given as
// Fp8Format::E4M3FN). Every such combination is instantiated once, in the kernels_*.cu files.
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

// Decode attention reads the cache in tiles of kAttentionTile tokens; a thread block attends to one split
// of a sequence's positions, at most kMaxSplitTokens of them, so that its block ids fit shared memory.
constexpr int kAttentionTile = 16;
constexpr int kMaxSplitTokens = 1024;
constexpr int kMaxHeadSize = 256;   // head sizes: any multiple of 16 up to this
constexpr int kMaxSplits = 65535;   // grid z
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

// The element types the kernels know, at run time: the query / output dtype, and what a cache holds.
enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kE4M3FN = 3, kE5M2 = 4, kE4M3FNUZ = 5 };

template <typename T>
FP8KV_HOST_DEVICE constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::kF32;
  else if constexpr (std::is_same_v<T, bf16_t>) return DType::kBF16;
  else return DType::kF16;
}

// The cache type of an (element, format) pair as the bindings name it: uint8_t with a format, or the
// model dtype itself for an auto cache.
template <typename cache_t, Fp8Format kFormat>
constexpr DType cache_dtype_of() {
  if constexpr (!std::is_same_v<cache_t, uint8_t>) return dtype_of<cache_t>();
  else if constexpr (kFormat == Fp8Format::E5M2) return DType::kE5M2;
  else if constexpr (kFormat == Fp8Format::E4M3FNUZ) return DType::kE4M3FNUZ;
  else return DType::kE4M3FN;
}

// One paged cache (or the recent-token window ring, laid out as an auto cache), strides in elements.
struct CacheRef {
  const void* key;    // [num_blocks, num_kv_heads, head_size / x, block_size, x]
  const void* value;  // [num_blocks, num_kv_heads, head_size, block_size]
  DType dtype;
  const int* block_tables;  // [num_seqs, table_width], last dim contiguous
  int64_t table_stride;
  int table_width;
  int num_blocks, block_size, block_shift;  // block_size = 1 << block_shift
  int64_t key_block_stride, key_head_stride, value_block_stride, value_head_stride;
};

// One decode-attention call, for the kernels (torch-free, no model dtype in the types: the query and the
// output are read and written through `query_dtype` / `out_dtype`).
struct AttentionParams {
  void* out;  // [num_seqs, num_heads, head_size], contiguous
  DType out_dtype;
  const void* query;  // [num_seqs, num_heads, head_size], last dim contiguous
  DType query_dtype;
  int64_t query_seq_stride, query_head_stride;
  // Partial results of each split, [num_seqs, num_heads, total_splits (, head_size)]; unused when a call
  // has one split and no window.
  float* partial_out;
  float* partial_max;
  float* partial_sum;
  const int* seq_lens;        // [num_seqs]
  const float* alibi_slopes;  // [num_heads] or nullptr
  const float* k_scale;       // [1] or [num_kv_heads]
  const float* v_scale;
  bool k_scale_per_head, v_scale_per_head;
  int* error_flag;
  int num_seqs, num_heads, num_kv_heads, head_size, max_seq_len;
  float scale;
  CacheRef paged;
  int paged_splits;  // grid z of the paged kernel
  // paged_attention_window: positions [window_starts[s], seq_len) are read from `ring` (slot p % window_size)
  // instead of the paged cache, in ring_splits more splits (partials paged_splits ..).
  const int* window_starts;  // nullptr: no window
  int window_size;
  CacheRef ring;
  int ring_splits;
};

// How many splits a call's grid gets: enough thread blocks to fill the GPU about twice (sm_count blocks of
// 4 per core), none longer than kMaxSplitTokens positions of max_seq_len, and none shorter than 256 unless
// that is all there is. Depends only on the call's shapes, so a CUDA graph captured for a padded batch keeps
// a grid that suits every replay.
inline int attention_splits(int num_seqs, int kv_head_blocks, int max_len, int sm_count) {
  const int tiles = (max_len + kAttentionTile - 1) / kAttentionTile;
  const int max_split_tiles = kMaxSplitTokens / kAttentionTile;
  const int fewest = (tiles + max_split_tiles - 1) / max_split_tiles;
  const int min_split_tiles = 256 / kAttentionTile;
  const int most = (tiles + min_split_tiles - 1) / min_split_tiles;
  const long blocks = long(num_seqs) * kv_head_blocks;
  const long wanted = blocks > 0 ? (long(sm_count) * 8 + blocks - 1) / blocks : 1;
  long splits = wanted < most ? wanted : most;
  if (splits < fewest) splits = fewest;
  if (splits < 1) splits = 1;
  return static_cast<int>(splits > kMaxSplits ? kMaxSplits : splits);
}

// Query heads a thread block takes (of one KV head): 1, 4 or 8 register slots (4 at most for head sizes over
// 128, whose outputs take twice the registers). A group of 3 runs in 4 slots, one idle: each K/V element is
// still read and decoded once for the whole group; a group of 12 takes two blocks (8 + 4).
FP8KV_HOST_DEVICE FP8KV_INLINE int head_slots_for(int group, int head_size) {
  const int most = head_size > 128 ? 4 : 8;
  return group == 1 ? 1 : group <= 4 || most == 4 ? 4 : 8;
}
// Thread blocks per KV head.
FP8KV_HOST_DEVICE FP8KV_INLINE int head_blocks_for(int group, int head_size) {
  const int slots = head_slots_for(group, head_size);
  return (group + slots - 1) / slots;
}

// All return the launch error (success when nothing was launched). Preconditions are checked by the
// binding: head size a multiple of 16 up to kMaxHeadSize, block size 8, 16 or 32, 16-byte aligned caches,
// sizes within grid limits, partials for paged_splits (+ ring_splits) when there is more than one.
template <typename scalar_t, typename cache_t, Fp8Format kFormat>
Error launch_reshape_and_cache(const ReshapeAndCacheArgs<scalar_t, cache_t>& args, Stream stream);

Error launch_paged_attention(const AttentionParams& params, Stream stream);

// The same with params.window_starts and params.ring set.
Error launch_paged_attention_window(const AttentionParams& params, Stream stream);

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
