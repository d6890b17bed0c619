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
  // Dynamic scales (common/dynamic_scale.h): bfloat16 bits [num_blocks, num_kv_heads, block_size], contiguous,
  // computed and stored by the write and used instead of k_scale / v_scale; nullptr: static scales.
  uint16_t* k_scale_cache;
  uint16_t* v_scale_cache;
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
  // Dynamic scales of the paged cache (common/dynamic_scale.h): bfloat16 bits [num_blocks, num_kv_heads,
  // block_size], contiguous, one per token and KV head, used instead of k_scale / v_scale; nullptr: static scales.
  const uint16_t* k_scale_cache;
  const uint16_t* v_scale_cache;
  int* error_flag;
  int num_seqs, num_heads, num_kv_heads, head_size, max_seq_len;
  float scale;
  CacheRef paged;
  int paged_splits;  // grid z of the paged kernel
  // paged_attention_window: positions [window_starts[s], seq_len) and the attention sinks [0, min(window_sinks,
  // window_starts[s])) are read from `ring` (seat p < window_sinks ? p : window_sinks + p % window_size) instead
  // of the paged cache, in ring_splits more splits (partials paged_splits ..).
  const int* window_starts;  // nullptr: no window
  int window_size;
  int window_sinks;  // S >= 0, a launch constant: the ring's first S seats hold positions [0, S)
  CacheRef ring;
  int ring_splits;
  // The paged cache on tensor cores (attention_tc_kernels.cuh; the binding's plan, tc_plan, decides): its
  // pipeline depth and dynamic shared memory. Otherwise the CUDA-core kernel of attention_kernels.cuh.
  bool tensor_cores;
  int tc_stages;
  int tc_smem_bytes;
  // Model features (docs/design.md section 4): a sequence attends to its newest sliding_window positions (0: all
  // of them); logits become softcap * tanh(logit / softcap) (0: as they are); sinks [num_heads] (nullptr: none)
  // are one more logit per head in the softmax's denominator, merged in the reduce kernel.
  int sliding_window;
  float softcap;
  const float* sinks;
};

// Where a kernel's tiles of a paged cache start when a sliding window begins at position `first`: on a multiple
// of every kernel's tile (and so of 8-position value groups), the positions before `first` masked.
constexpr int kWindowAlign = 32;

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

// ---- the tensor-core decode kernel (attention_tc_kernels.cuh): its shared-memory layout and the host's plan ----
// A thread block of kTcWarps warps takes the (up to 8 or 16) query heads of one KV head, one sequence and one
// split of its positions; each warp streams its own tiles of kTcTile positions through a pipeline of
// `stages` shared-memory buffers (cp.async), so a tile's loads are in flight while earlier tiles are computed.
constexpr int kTcWarps = 4;
constexpr int kTcThreads = kTcWarps * 32;
constexpr int kTcTile = 32;
// Splits are long, so that few blocks pay the start-up latency of a block (sequence length, block table,
// query fragments: ~3 us before the first bytes stream) and most calls need no reduce kernel.
constexpr int kTcMaxSplitTokens = 8192;
constexpr int kTcMaxSplitBlocks = kTcMaxSplitTokens / 8 + 2;  // block ids one split can touch (block size 8)
// The split's block ids, then 4 floats of scratch (the warps' largest query magnitudes).
constexpr int kTcScratchOffset = kTcMaxSplitBlocks * 4;
constexpr int kTcBlockIdBytes = (kTcScratchOffset + 16 + 15) / 16 * 16;
constexpr int kTcMinSplitTiles = 4;  // a split is at least a tile a warp, unless the sequence is shorter
constexpr int kTcSharedMemoryReserved = 1024;  // what the driver keeps of each block's shared memory

// The head-size class a kernel is built for (its register arrays), and its query-head slots: 8, or 16 for
// GQA groups over 8 at head sizes up to 128 (their outputs take twice the registers).
FP8KV_HOST_DEVICE constexpr int tc_dims(int head_size) { return head_size <= 64 ? 64 : head_size <= 128 ? 128 : 256; }
FP8KV_HOST_DEVICE constexpr int tc_heads(int group, int head_size) { return group > 8 && head_size <= 128 ? 16 : 8; }
FP8KV_HOST_DEVICE constexpr int tc_head_blocks(int group, int head_size) {
  return (group + tc_heads(group, head_size) - 1) / tc_heads(group, head_size);
}
// Groups of four 16-byte key chunks a lane reads per token (elem: bytes a cache element takes, 1 or 2).
FP8KV_HOST_DEVICE constexpr int tc_key_groups(int elem, int dims) { return (dims * elem / 16 + 3) / 4; }
// k-steps of 16 dims in Q.K: a group holds 4 / elem of them.
FP8KV_HOST_DEVICE constexpr int tc_key_steps(int elem, int dims) { return tc_key_groups(elem, dims) * (4 / elem); }
FP8KV_HOST_DEVICE constexpr int tc_key_stage_bytes(int elem, int dims) { return 4 * tc_key_groups(elem, dims) * 512; }
// One warp's tile in shared memory: keys [4 n-tiles][key groups][32 lanes][16 B], then values
// [dims / 16][elem halves][32 lanes][16 B].
FP8KV_HOST_DEVICE constexpr int tc_stage_bytes(int elem, int dims) {
  return tc_key_stage_bytes(elem, dims) + dims / 16 * 512 * elem;
}
// Query fragment registers a lane loads per k-step: the mma's four A registers (two of them zero with 8 heads:
// loaded as they are, they need no moves), twice that when float32 queries are split in a high and a low half.
FP8KV_HOST_DEVICE constexpr int tc_query_regs(int heads, bool precise) { return heads > 0 ? 4 * (precise ? 2 : 1) : 0; }
FP8KV_HOST_DEVICE constexpr int tc_query_bytes(int elem, int dims, int heads, bool precise) {
  return tc_key_steps(elem, dims) * 32 * tc_query_regs(heads, precise) * 4;
}
// The warps' outputs, maxima and sums, merged after the loop in the pipeline's memory.
FP8KV_HOST_DEVICE constexpr int tc_merge_bytes(int dims, int heads) { return kTcWarps * heads * (dims + 2) * 4; }
FP8KV_HOST_DEVICE constexpr int tc_smem_bytes(int elem, int dims, int heads, bool precise, int stages) {
  const int pipeline = kTcWarps * stages * tc_stage_bytes(elem, dims);
  const int merge = tc_merge_bytes(dims, heads);
  return kTcBlockIdBytes + tc_query_bytes(elem, dims, heads, precise) + (pipeline > merge ? pipeline : merge);
}

// What the tensor-core kernel needs for one call's shapes on one device; stages 0: it cannot take them (a
// float32 cache, a head size it is not built for, too little shared memory), the CUDA-core kernel does.
struct TcPlan {
  int stages = 0;
  int smem_bytes = 0;
  int blocks_per_sm = 0;
};

// Blocks an SM the registers hold at least: the minimum tc_attention_kernel's __launch_bounds__ asks ptxas for.
// The 8-slot 16-bit-query kernels at 128 dims use 128-152 registers (sm_90), so they are held to 3 (168 each);
// float32 queries' split halves and 16 slots need more.
FP8KV_HOST_DEVICE constexpr int tc_register_blocks(int dims, int heads, bool precise) {
  return dims <= 64 ? 3 : dims <= 128 ? (heads == 8 && !precise ? 3 : 2) : 1;
}

// stages: a pipeline depth asked for (2-4), 0 for the plan's own choice: the most blocks an SM (shared memory
// and registers), then the deepest pipeline. More warps an SM beat depth: on an H200 at 32/8 heads, d128, FP8,
// 2 stages and 3 blocks an SM took 58 us at 8 x 8192 and 104 us at 32 x 4096, 3 stages and 2 blocks 65 and 111
// (docs/design.md section 9); even 2 stages keep ~100 KB an SM in flight.
inline TcPlan tc_plan(DType cache, int head_size, int group, bool precise, int smem_per_sm, int smem_per_block,
                      int stages_wanted = 0) {
  const int elem = cache == DType::kF32 ? 0 : cache == DType::kF16 || cache == DType::kBF16 ? 2 : 1;
  if (elem == 0 || head_size <= 0 || head_size > kMaxHeadSize || head_size % (16 / elem) != 0) return {};
  const int dims = tc_dims(head_size), heads = tc_heads(group, head_size);
  if (precise && dims > 128) return {};  // float32 queries' split halves do not fit the registers beside 256 dims
  const int by_registers = tc_register_blocks(dims, heads, precise);
  TcPlan best;
  for (int stages = 4; stages >= 2; --stages) {
    if (stages_wanted != 0 && stages != stages_wanted) continue;
    const int bytes = tc_smem_bytes(elem, dims, heads, precise, stages);
    if (bytes > smem_per_block) continue;
    int blocks = smem_per_sm / (bytes + kTcSharedMemoryReserved);
    blocks = blocks < 1 ? 1 : blocks > by_registers ? by_registers : blocks;
    if (blocks > best.blocks_per_sm) best = {stages, bytes, blocks};
  }
  return best.stages == 0 && stages_wanted != 0 ? tc_plan(cache, head_size, group, precise, smem_per_sm, smem_per_block)
                                                 : best;
}

// The fewest splits `tiles` tiles can have: a split holds at most kTcMaxSplitTokens positions.
inline int tc_fewest_splits(int tiles) {
  const int max_split_tiles = kTcMaxSplitTokens / kTcTile;
  return tiles > 0 ? (tiles + max_split_tiles - 1) / max_split_tiles : 1;
}

// Splits of each (sequence, head block) for the tensor-core kernel: the count whose blocks finish soonest when
// sm_count * blocks_per_sm of them run at once. Costed in eighths of the time a warp takes for a tile: whole
// waves of equal splits, each as long as its warps' largest share of tiles plus a block's start-up (two tiles),
// and for more than one split the reduce kernel (two tiles, and an eighth a split it merges). Within [one per
// kTcMaxSplitTokens positions, one per kTcMinSplitTiles tiles]; from shapes only, so that a CUDA graph
// captured for max_len suits every replay. Fitted on an H200 (FP8KV_TC_SPLITS sweeps, 32/8 heads d128 and 9/3
// d64): at 1 x 16384, 32 splits (4 tiles a warp) beat 16 and 64 (9/3: 15.6 us against 19.5 and 17.2); at
// 1 x 512, 4 splits of a tile a warp beat 1 and 2 (32/8: 13.8 us against 15.4 and 16.1).
inline int tc_splits(int num_seqs, int kv_head_blocks, int max_len, int sm_count, int blocks_per_sm) {
  const int tiles = (max_len + kTcTile - 1) / kTcTile;
  const int fewest = tc_fewest_splits(tiles);
  int most = (tiles + kTcMinSplitTiles - 1) / kTcMinSplitTiles;
  most = most < fewest ? fewest : most > kMaxSplits ? kMaxSplits : most;
  const long units = long(num_seqs) * kv_head_blocks;
  const long slots = long(sm_count) * blocks_per_sm;
  if (units <= 0 || slots <= 0) return fewest < 1 ? 1 : fewest;
  int best = fewest;
  long best_cost = -1;
  for (int s = fewest; s <= most; ++s) {
    const long waves = (units * s + slots - 1) / slots;
    const long warp_tiles = ((tiles + s - 1) / s + kTcWarps - 1) / kTcWarps;
    const long cost = waves * (8 * warp_tiles + 16) + (s > 1 ? 16 + s : 0);
    if (best_cost < 0 || cost < best_cost) {
      best_cost = cost;
      best = s;
    }
    if (waves > 64) break;  // further splits only add waves
  }
  return best < 1 ? 1 : best;
}

// A split count asked for, within [one per kTcMaxSplitTokens positions, one per tile, kMaxSplits].
inline int tc_splits_within(int wanted, int max_len) {
  const int tiles = (max_len + kTcTile - 1) / kTcTile;
  const int fewest = tc_fewest_splits(tiles);
  const int most = tiles < fewest ? fewest : tiles > kMaxSplits ? kMaxSplits : tiles;
  return wanted < fewest ? fewest : wanted > most ? most : wanted;
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
