// Paged decode attention over an FP8 (or auto) cache, dequantizing in registers, and its window variant (the
// newest tokens, and the first window_sinks ones, read from a full-precision ring instead). Flash-decoding: one
// softmax per warp, kept online.
//
// A thread block takes the query heads of one KV head (up to 8, in kHeads register slots), one sequence and
// one split of its positions (grid x: KV heads x head blocks, y: sequences, z: splits). Its 4 warps take
// turns over the split's tiles of 16 positions; each warp keeps a running max, sum and output for its heads,
// and the warps merge through shared memory at the end. With one split the block writes the output; with
// more it writes its unnormalized output, max and sum, and a reduce kernel merges the splits.
//
// Q.K: lane (token t = lane % 16, group g = lane / 16) reads 16-dim chunks g, g + 2, ... of token t's key: the
// key cache keeps a block's tokens' 16-byte chunks side by side ([.., head_size / x, block_size, x]), so a
// warp's loads are 512 contiguous bytes. The queries sit in shared memory (pre-scaled by scale * k_scale),
// read by all lanes at once.
// P.V: lane owns head dims lane, lane + 32, ...; a value row holds a block's tokens side by side, so a tile's
// 16 values of one dim are one 16-byte load (FP8). The probabilities reach every lane through shared memory.
// An FP8 cache's next tile is loaded while the current one is computed (its K and V fit in registers twice).
//
// Block ids are checked once per split (loaded into shared memory); out-of-range ids, lengths and window
// starts are reported through the error flag and skipped, never read.
#pragma once

#include <cmath>
#include <cstring>
#include <type_traits>

#include "../common/dynamic_scale.h"
#include "cache_codec.cuh"
#include "launch.h"

namespace fp8kv::gpu {

constexpr int kAttentionThreads = 128;
constexpr int kAttentionWarps = kAttentionThreads / kWarpSize;
constexpr int kTile = kAttentionTile;
constexpr int kLaneGroups = kWarpSize / kTile;  // lanes that share one token's dims
constexpr int kMaxSplitBlocks = kMaxSplitTokens / 8 + 2;  // block ids one split can touch (block size 8)

FP8KV_DEVICE int min_int(int a, int b) { return a < b ? a : b; }

// exp(x - max) that is 0 for a masked (-inf) entry even when every entry is masked.
FP8KV_DEVICE float softmax_weight(float x, float max) { return x == -INFINITY ? 0.0f : expf(x - max); }

// v if it lies in [lo, hi], else the nearest bound, reported: the kernels never index past what was checked.
FP8KV_DEVICE int checked_in(int v, int lo, int hi, int* error_flag, int error_bit, bool report) {
  if (v >= lo && v <= hi) return v;
  if (report) report_error(error_flag, error_bit);
  return v < lo ? lo : hi;
}

FP8KV_DEVICE float load_model_value(const void* base, int64_t i, DType t) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kBF16: return to_float(static_cast<const bf16_t*>(base)[i]);
    default: return to_float(static_cast<const half_t*>(base)[i]);
  }
}

FP8KV_DEVICE void store_model_value(void* base, int64_t i, DType t, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(base)[i] = v; break;
    case DType::kBF16: static_cast<bf16_t*>(base)[i] = from_float<bf16_t>(v); break;
    default: static_cast<half_t*>(base)[i] = from_float<half_t>(v); break;
  }
}

template <int kHeads, int kMaxD>
struct alignas(16) AttentionSmem {
  float q[kHeads][kMaxD];  // pre-scaled queries; after the loop, the warps' merged output
  float p[kAttentionWarps][kHeads][kTile];  // one tile's probabilities per warp
  float warp_max[kAttentionWarps][kHeads];
  float warp_sum[kAttentionWarps][kHeads];
  int64_t ring_value[kAttentionWarps][kTile];  // the window ring: a tile's tokens' value offsets, -1 masked
  int block_ids[kMaxSplitBlocks];  // the split's block ids, -1 where out of range
};

// What every source needs to know of one (KV head, sequence) and the split's positions.
struct Task {
  int seq, kv_head, seq_len;
  int start, end;  // positions of this source: [start, end)
  int lo;          // the oldest position attended to (a sliding window's first); start <= lo, earlier masked
  // The ring's sinks: its positions [start, recent) stand for [start - gap, recent - gap), the attention sinks
  // that precede the paged span, so that one run of tiles covers both (gap 0 elsewhere: positions as they are).
  int recent, gap;
};

// ---- the sources a split reads --------------------------------------------------------------------------

// Element decoding for a cache of cache_t (FP8 codes in kFormat, or a model dtype as is).
template <typename cache_t, Fp8Format kFormat>
using DecodeCodec = CacheCodec<std::conditional_t<std::is_same_v<cache_t, uint8_t>, float, cache_t>, cache_t, kFormat>;

// 16 bytes as four 32-bit words: the compiler keeps them in four registers (as 16 bytes it may give each byte
// a register of its own).
using Raw16 = Vec<uint32_t, 4>;

FP8KV_DEVICE Raw16 load_raw16(const uint8_t* p) { return load_vec<uint32_t, 4>(reinterpret_cast<const uint32_t*>(p)); }

// The 16 / sizeof(cache_t) values in one Raw16, as floats.
template <typename cache_t, Fp8Format kFormat>
FP8KV_DEVICE void decode_raw16(const Raw16& raw, float* out) {
  FP8KV_UNROLL
  for (int w = 0; w < 4; ++w) {
    const uint32_t word = raw.e[w];
    if constexpr (std::is_same_v<cache_t, float>) {
      out[w] = bits_to_float(word);
    } else if constexpr (std::is_same_v<cache_t, bf16_t>) {
      out[2 * w] = bits_to_float(word << 16);
      out[2 * w + 1] = bits_to_float(word & 0xFFFF0000u);
    } else if constexpr (std::is_same_v<cache_t, half_t>) {
      out[2 * w] = half_bits_to_float(static_cast<uint16_t>(word & 0xFFFFu));
      out[2 * w + 1] = half_bits_to_float(static_cast<uint16_t>(word >> 16));
    } else {
#if defined(FP8KV_HW_FP8)
      constexpr bool kPairs = kFormat != Fp8Format::E4M3FNUZ;  // sm_89+: one instruction per pair of codes
#else
      constexpr bool kPairs = false;
#endif
      if constexpr (kPairs) {
#if defined(FP8KV_HW_FP8)
        constexpr auto interp = kFormat == Fp8Format::E5M2 ? __NV_E5M2 : __NV_E4M3;
        FP8KV_UNROLL
        for (int half = 0; half < 2; ++half) {
          const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
              static_cast<__nv_fp8x2_storage_t>((word >> (16 * half)) & 0xFFFFu), interp);
          out[4 * w + 2 * half] = half_bits_to_float(h.x);
          out[4 * w + 2 * half + 1] = half_bits_to_float(h.y);
        }
#endif
      } else {
        FP8KV_UNROLL
        for (int b = 0; b < 4; ++b) out[4 * w + b] = fp8_decode<kFormat>(static_cast<uint8_t>(word >> (8 * b)));
      }
    }
  }
}

// The values of 16 dims (kParts 16-byte parts of 16 / kParts elements) as floats.
template <typename cache_t, Fp8Format kFormat, int kParts>
FP8KV_DEVICE void decode16(const Raw16 (&raw)[kParts], float* out) {
  constexpr int kX = 16 / static_cast<int>(sizeof(cache_t));
  FP8KV_UNROLL
  for (int e = 0; e < kParts; ++e) decode_raw16<cache_t, kFormat>(raw[e], out + e * kX);
}

// The paged cache: position p is in block_ids[p >> shift - first_entry] at offset p & (block_size - 1).
template <typename cache_t, Fp8Format kFormat>
struct PagedSource {
  using Cache = cache_t;
  static constexpr Fp8Format kFmt = kFormat;
  static constexpr int kE = static_cast<int>(sizeof(cache_t));
  static constexpr bool kQuantized = std::is_same_v<cache_t, uint8_t>;
  static constexpr bool kBlockIds = true;  // preloads the split's block ids
  // Thread blocks per SM the kernel is built for (its register budget): 3 for the hot FP8 formats, whose
  // decode is one instruction per pair on sm_89+; 2 (more registers) for the rest.
  static constexpr int kMinBlocks = kQuantized && kFormat != Fp8Format::E4M3FNUZ ? 3 : 2;

  FP8KV_DEVICE static const CacheRef& cache(const AttentionParams& p) { return p.paged; }
  FP8KV_DEVICE static int splits(const AttentionParams& p) { return p.paged_splits; }
  FP8KV_DEVICE static int split_base(const AttentionParams&) { return 0; }
  // The static scales; 1 with dynamic ones, which each token carries (token_scales).
  FP8KV_DEVICE static float k_scale(const AttentionParams& p, int kv_head) {
    return kQuantized && p.k_scale_cache == nullptr ? p.k_scale[p.k_scale_per_head ? kv_head : 0] : 1.0f;
  }
  FP8KV_DEVICE static float v_scale(const AttentionParams& p, int kv_head) {
    return kQuantized && p.v_scale_cache == nullptr ? p.v_scale[p.v_scale_per_head ? kv_head : 0] : 1.0f;
  }
  // The dynamic scales of the token at (block, offset), 1 with static ones: ks folds into its logit, vs into its
  // probability (docs/design.md section 10).
  FP8KV_DEVICE static void token_scales(const AttentionParams& p, int block, int kv_head, int offset, float& ks,
                                        float& vs) {
    ks = vs = 1.0f;
    if constexpr (kQuantized) {
      if (p.k_scale_cache != nullptr) {
        const int64_t at = (int64_t(block) * p.num_kv_heads + kv_head) * p.paged.block_size + offset;
        ks = scale_value(p.k_scale_cache[at]);
        vs = scale_value(p.v_scale_cache[at]);
      }
    }
  }
};

// The window ring (a model dtype, no scales): position p at seat p < window_sinks ? p : window_sinks +
// p % window_size.
template <typename window_t>
struct RingSource {
  using Cache = window_t;
  static constexpr Fp8Format kFmt = Fp8Format::E4M3FN;  // unused: not quantized
  static constexpr int kE = static_cast<int>(sizeof(window_t));
  static constexpr bool kQuantized = false;
  static constexpr bool kBlockIds = false;
  static constexpr int kMinBlocks = 2;

  FP8KV_DEVICE static const CacheRef& cache(const AttentionParams& p) { return p.ring; }
  FP8KV_DEVICE static int splits(const AttentionParams& p) { return p.ring_splits; }
  FP8KV_DEVICE static int split_base(const AttentionParams& p) { return p.paged_splits; }
  FP8KV_DEVICE static float k_scale(const AttentionParams&, int) { return 1.0f; }
  FP8KV_DEVICE static float v_scale(const AttentionParams&, int) { return 1.0f; }
  FP8KV_DEVICE static void token_scales(const AttentionParams&, int, int, int, float& ks, float& vs) {
    ks = vs = 1.0f;
  }
};

// The sequence's length and this source's positions, checked (report: one thread per sequence reports).
template <class Src>
FP8KV_DEVICE Task make_task(const AttentionParams& p, int seq, int kv_head, bool report) {
  Task t{seq, kv_head, 0, 0, 0, 0, 0, 0};
  const int64_t table_capacity = int64_t(p.paged.table_width) * p.paged.block_size;
  // A paged cache's tiles start on a kWindowAlign boundary at or before its first attended position: the
  // window's first, and not before `floor` (the ring holds the sinks below it).
  const auto from_window = [&](Task& task, int floor) {
    const int first = p.sliding_window > 0 && task.seq_len > p.sliding_window ? task.seq_len - p.sliding_window : 0;
    task.lo = min_int(first > floor ? first : floor, task.end);
    task.start = task.lo / kWindowAlign * kWindowAlign;
  };
  if (p.window_starts == nullptr) {
    const int capacity = static_cast<int>(table_capacity < p.max_seq_len ? table_capacity : p.max_seq_len);
    t.seq_len = checked_in(p.seq_lens[seq], 0, capacity, p.error_flag, kErrorSeqLenOutOfRange, report);
    t.end = t.seq_len;
    from_window(t, 0);
    return t;
  }
  t.seq_len = checked_in(p.seq_lens[seq], 0, p.max_seq_len, p.error_flag, kErrorSeqLenOutOfRange, report);
  const int oldest = t.seq_len > p.window_size ? t.seq_len - p.window_size : 0;
  const int window_start = checked_in(p.window_starts[seq], oldest, t.seq_len, p.error_flag,
                                      kErrorWindowStartOutOfRange, report);
  const int sink_end = min_int(p.window_sinks, window_start);  // the sinks [0, sink_end) are the ring's
  if constexpr (Src::kBlockIds) {
    const int capacity = static_cast<int>(table_capacity < window_start ? table_capacity : window_start);
    t.end = checked_in(window_start, 0, capacity, p.error_flag, kErrorSeqLenOutOfRange, report);
    from_window(t, sink_end);
  } else {
    // Recent positions [max(first, window_start), seq_len), preceded by the sinks from the window's first on.
    const int first = p.sliding_window > 0 && t.seq_len > p.sliding_window ? t.seq_len - p.sliding_window : 0;
    const int sinks = first < sink_end ? sink_end - first : 0;
    t.recent = window_start > first ? window_start : first;
    t.gap = sinks > 0 ? t.recent - sink_end : 0;
    t.start = t.recent - sinks;
    t.lo = t.start;
    t.end = t.seq_len;
  }
  return t;
}

// ---- the kernel body -------------------------------------------------------------------------------------

template <class Src, int kChunks, int kHeads>
struct Attention {
  using cache_t = typename Src::Cache;
  static constexpr int kE = Src::kE;
  static constexpr int kMaxD = kChunks * 16;
  static constexpr int kChunksPerLane = (kChunks + kLaneGroups - 1) / kLaneGroups;
  static constexpr int kRowsPerLane = (kMaxD + kWarpSize - 1) / kWarpSize;
  // FP8 tiles are loaded one ahead where two tiles' K and V fit in registers beside the outputs; otherwise
  // (wider caches, big heads or groups) each 16-byte part is loaded where it is used.
  static constexpr bool kPrefetch =
      Src::kBlockIds && kE == 1 && (kChunksPerLane + kRowsPerLane) * 8 + kHeads * kRowsPerLane <= 80;
  using Smem = AttentionSmem<kHeads, kMaxD>;

  // Where this lane's token of a tile lives.
  struct Token {
    int64_t key_base;  // element offset of its block and KV head in the key cache
    int offset;        // within the block
    bool ok;           // inside the split and its block id valid
    float k_scale, v_scale;  // its dynamic scales (Src::token_scales), 1 with static ones
  };

  // One tile's raw K and V bytes of one lane, loaded ahead (kPrefetch only).
  struct Regs {
    Token token;
    Raw16 k[kPrefetch ? kChunksPerLane : 1][kE];
    Raw16 v[kPrefetch ? kRowsPerLane : 1][kE];
  };

  const AttentionParams& p;
  const CacheRef& c;
  Smem& sm;
  Task task;
  int lane, warp, head_size, first_entry;

  // Element offset of the key / value of block `block` for this KV head.
  FP8KV_DEVICE int64_t key_base(int block) const {
    return int64_t(block) * c.key_block_stride + int64_t(task.kv_head) * c.key_head_stride;
  }
  FP8KV_DEVICE int64_t value_base(int block) const {
    return int64_t(block) * c.value_block_stride + int64_t(task.kv_head) * c.value_head_stride;
  }

  // The sequence position of a task position (the ring's sinks stand next to its recent positions, Task).
  FP8KV_DEVICE int position(int pos) const {
    if constexpr (Src::kBlockIds) {
      return pos;
    } else {
      return pos < task.recent ? pos - task.gap : pos;
    }
  }

  // Block id and offset of sequence position `pos` (-1: out of range, reported).
  FP8KV_DEVICE int block_of(int pos, int& offset) const {
    if constexpr (Src::kBlockIds) {
      offset = pos & (c.block_size - 1);
      return sm.block_ids[(pos >> c.block_shift) - first_entry];
    } else {
      const int sinks = p.window_sinks;
      const int slot = pos < sinks ? pos : sinks + pos % p.window_size;
      offset = slot & (c.block_size - 1);
      const int block = c.block_tables[int64_t(task.seq) * c.table_stride + (slot >> c.block_shift)];
      if (block < 0 || block >= c.num_blocks) {
        report_error(p.error_flag, kErrorWindowBlockOutOfRange);
        return -1;
      }
      return block;
    }
  }

  FP8KV_DEVICE Token locate(int tile) const {
    const int pos = task.start + tile * kTile + lane % kTile;
    Token t{0, 0, false, 1.0f, 1.0f};
    const int block = pos < task.end && pos >= task.lo ? block_of(position(pos), t.offset) : -1;
    t.ok = block >= 0;
    t.key_base = key_base(t.ok ? block : 0);
    if (t.ok) Src::token_scales(p, block, task.kv_head, t.offset, t.k_scale, t.v_scale);
    return t;
  }

  // The 16 dims of chunk group + kLaneGroups * i of this lane's token (zero where there is nothing to read).
  FP8KV_DEVICE void load_key(const Token& t, int i, Raw16 (&out)[kE]) const {
    const auto* key = static_cast<const uint8_t*>(c.key);
    const int chunk = lane / kTile + kLaneGroups * i;
    constexpr int kX = 16 / kE;
    FP8KV_UNROLL
    for (int e = 0; e < kE; ++e) {
      if (chunk * 16 < head_size && t.ok) {
        const int64_t element = t.key_base + (int64_t(chunk * kE + e) * c.block_size + t.offset) * kX;
        out[e] = load_raw16(key + element * kE);
      } else {
        out[e] = Raw16{};
      }
    }
  }

  // The paged cache's V of one tile for this lane's dim lane + k * kWarpSize: 16 tokens = 16 * kE bytes.
  FP8KV_DEVICE void load_value(int pos0, int k, Raw16 (&out)[kE]) const {
    const auto* value = static_cast<const uint8_t*>(c.value);
    const int first = (pos0 >> c.block_shift) - first_entry;
    const int offset = pos0 & (c.block_size - 1);
    const int d = lane + k * kWarpSize;
    FP8KV_UNROLL
    for (int e = 0; e < kE; ++e) out[e] = Raw16{};
    if (d >= head_size || pos0 + kTile <= task.lo) return;
    if (c.block_size >= kTile) {
      const int block = sm.block_ids[first];
      if (block < 0) return;
      const uint8_t* row = value + (value_base(block) + int64_t(d) * c.block_size + offset) * kE;
      FP8KV_UNROLL
      for (int e = 0; e < kE; ++e) out[e] = load_raw16(row + e * 16);
      return;
    }
    // Block size 8: 8 tokens of each of two blocks, 8 * kE bytes each, halves of the 16 * kE.
    FP8KV_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int block = (half == 0 || pos0 + 8 < task.end) && pos0 + 8 * half + 8 > task.lo
                            ? sm.block_ids[first + half] : -1;
      if (block < 0) continue;
      const uint8_t* row = value + (value_base(block) + int64_t(d) * c.block_size) * kE;
      FP8KV_UNROLL
      for (int b = 0; b < 8 * kE; b += 8) {
        const Vec<uint32_t, 2> part = load_vec<uint32_t, 2>(reinterpret_cast<const uint32_t*>(row + b));
        const int at = half * 8 * kE + b;  // byte of the 16 * kE
        out[at / 16].e[(at % 16) / 4] = part.e[0];
        out[at / 16].e[(at % 16) / 4 + 1] = part.e[1];
      }
    }
  }

  FP8KV_DEVICE void load(int tile, Regs& r) const {
    r.token = locate(tile);
    if constexpr (kPrefetch) {
      FP8KV_UNROLL
      for (int i = 0; i < kChunksPerLane; ++i) load_key(r.token, i, r.k[i]);
      FP8KV_UNROLL
      for (int k = 0; k < kRowsPerLane; ++k) load_value(task.start + tile * kTile, k, r.v[k]);
    }
  }

  // The window ring's V of one tile, gathered token by token (its slots wrap and its blocks are small).
  FP8KV_DEVICE void ring_values(int d, float* out) const {
    const auto* value = static_cast<const cache_t*>(c.value);
    using Codec = DecodeCodec<cache_t, Src::kFmt>;
    FP8KV_UNROLL
    for (int j = 0; j < kTile; ++j) {
      const int64_t at = sm.ring_value[warp][j];
      out[j] = at >= 0 ? Codec::decode(value[at + int64_t(d) * c.block_size]) : 0.0f;
    }
  }
};

// What one attention block works on: grid x is (KV head, block of up to kHeads of its query heads), y the
// sequence, z the split; `heads` of the block's kHeads slots are real (a group's last block may hold fewer).
struct BlockWork {
  int kv_head, first_head, heads, seq, split;
};

template <int kHeads, class Thread>
FP8KV_DEVICE BlockWork block_work(const AttentionParams& p, const Thread& th) {
  const int group_size = p.num_heads / p.num_kv_heads;
  const int head_blocks = (group_size + kHeads - 1) / kHeads;
  BlockWork w{};
  w.kv_head = th.block_x() / head_blocks;
  w.first_head = w.kv_head * group_size + (th.block_x() % head_blocks) * kHeads;
  w.heads = min_int(kHeads, w.kv_head * group_size + group_size - w.first_head);
  w.seq = th.block_y();
  w.split = th.block_z();
  return w;
}

// Tiles per split when num_splits share `tiles` (the last splits may get fewer, or none).
FP8KV_DEVICE int split_tiles(int tiles, int num_splits) { return (tiles + num_splits - 1) / num_splits; }

// The result of a block with nothing to attend to (an empty output, or a split the merge weighs 0): zeros in
// out when the block writes it `direct`ly, else an empty partial (max -inf, sum 0) in split slot `part` of
// `total_splits`; row0 is the block's (sequence, first head) row, heads its heads.
template <int kThreads>
FP8KV_DEVICE void write_empty_split(const AttentionParams& p, bool direct, int64_t row0, int heads, int total_splits,
                                    int part, int tid) {
  const int head_size = p.head_size;
  for (int i = tid; i < heads * head_size; i += kThreads) {
    const int h = i / head_size, d = i % head_size;
    if (direct) {
      store_model_value(p.out, (row0 + h) * head_size + d, p.out_dtype, 0.0f);
    } else {
      p.partial_out[((row0 + h) * total_splits + part) * head_size + d] = 0.0f;
    }
  }
  if (!direct && tid < heads) {
    p.partial_max[(row0 + tid) * total_splits + part] = -INFINITY;
    p.partial_sum[(row0 + tid) * total_splits + part] = 0.0f;
  }
}

template <class Src, int kChunks, int kHeads, class Thread>
FP8KV_DEVICE void attention_body(const AttentionParams& p, AttentionSmem<kHeads, kChunks * 16>& sm,
                                 const Thread& th) {
  using A = Attention<Src, kChunks, kHeads>;
  using cache_t = typename Src::Cache;
  constexpr int kMaxD = A::kMaxD;
  const int tid = th.index();
  const BlockWork work = block_work<kHeads>(p, th);
  const int kv_head = work.kv_head, first_head = work.first_head, heads = work.heads, seq = work.seq;
  const int split = work.split;
  const CacheRef& c = Src::cache(p);
  const int head_size = p.head_size;

  A a{p, c, sm, make_task<Src>(p, seq, kv_head, tid == 0 && split == 0 && th.block_x() == 0), tid % kWarpSize,
      tid / kWarpSize, head_size, 0};
  const Task& task = a.task;
  const int num_splits = Src::splits(p);
  const int tiles = (task.end - task.start + kTile - 1) / kTile;
  const int t0 = split * split_tiles(tiles, num_splits), t1 = min_int(t0 + split_tiles(tiles, num_splits), tiles);
  // No reduce: write the output here (sinks join the softmax in the reduce).
  const bool direct = num_splits == 1 && p.window_starts == nullptr && p.sinks == nullptr;
  const int64_t row0 = int64_t(seq) * p.num_heads + first_head;  // (seq, first head)
  const int total_splits = p.paged_splits + (p.window_starts != nullptr ? p.ring_splits : 0);
  const int part = Src::split_base(p) + split;

  if (t0 >= t1) {  // nothing to attend to: an empty output, or a split the merge weighs 0
    write_empty_split<kAttentionThreads>(p, direct, row0, heads, total_splits, part, tid);
    return;
  }

  // Queries, pre-scaled; idle head slots are zero.
  const float q_scale = p.scale * Src::k_scale(p, kv_head);
  for (int i = tid; i < kHeads * kMaxD; i += kAttentionThreads) {
    const int h = i / kMaxD, d = i % kMaxD;
    sm.q[h][d] = h < heads && d < head_size
                     ? load_model_value(p.query, int64_t(seq) * p.query_seq_stride +
                                                     int64_t(first_head + h) * p.query_head_stride + d,
                                        p.query_dtype) * q_scale
                     : 0.0f;
  }
  if constexpr (Src::kBlockIds) {
    // Block ids from the first attended position on: a sliding window's older blocks may be gone.
    const int pos_first = task.start + t0 * kTile > task.lo ? task.start + t0 * kTile : task.lo;
    const int pos_last = min_int(task.start + t1 * kTile, task.end) - 1;
    a.first_entry = pos_first >> c.block_shift;
    const int entries = (pos_last >> c.block_shift) - a.first_entry + 1;
    const int* table = c.block_tables + int64_t(seq) * c.table_stride + a.first_entry;
    for (int i = tid; i < entries + 1 && i < kMaxSplitBlocks; i += kAttentionThreads) {
      int block = -1;
      if (i < entries) {
        block = table[i];
        if (block < 0 || block >= c.num_blocks) {
          report_error(p.error_flag, kErrorBlockOutOfRange);
          block = -1;
        }
      }
      sm.block_ids[i] = block;
    }
  }
  th.sync();

  float slope[kHeads];
  FP8KV_UNROLL
  for (int h = 0; h < kHeads; ++h) slope[h] = p.alibi_slopes != nullptr && h < heads ? p.alibi_slopes[first_head + h] : 0.0f;
  const int newest = task.seq_len - 1;

  float m[kHeads], l[kHeads], acc[kHeads][A::kRowsPerLane];
  FP8KV_UNROLL
  for (int h = 0; h < kHeads; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
    FP8KV_UNROLL
    for (int k = 0; k < A::kRowsPerLane; ++k) acc[h][k] = 0.0f;
  }

  const int lane = a.lane, warp = a.warp, token = lane % kTile, group = lane / kTile;
  typename A::Regs cur, next;
  int tile = t0 + warp;
  if (tile < t1) a.load(tile, cur);
  for (; tile < t1; tile += kAttentionWarps) {
    const int next_tile = tile + kAttentionWarps;
    if constexpr (A::kPrefetch) {
      if (next_tile < t1) a.load(next_tile, next);
    }
    const int pos0 = task.start + tile * kTile;
    const int pos = pos0 + token;

    // Q.K for this lane's token, over this lane's chunks, for every head slot.
    float dot[kHeads];
    FP8KV_UNROLL
    for (int h = 0; h < kHeads; ++h) dot[h] = 0.0f;
    FP8KV_UNROLL
    for (int i = 0; i < A::kChunksPerLane; ++i) {
      const int chunk = group + kLaneGroups * i;
      if (chunk * 16 >= head_size) continue;
      float kv[16];
      if constexpr (A::kPrefetch) {
        decode16<cache_t, Src::kFmt>(cur.k[i], kv);
      } else {
        Raw16 raw[A::kE];
        a.load_key(cur.token, i, raw);
        decode16<cache_t, Src::kFmt>(raw, kv);
      }
      FP8KV_UNROLL
      for (int h = 0; h < kHeads; ++h) {
        FP8KV_UNROLL
        for (int j = 0; j < 16; j += 4) {
          const Vec<float, 4> qv = load_vec<float, 4>(&sm.q[h][chunk * 16 + j]);
          FP8KV_UNROLL
          for (int e = 0; e < 4; ++e) dot[h] += qv.e[e] * kv[j + e];
        }
      }
    }
    FP8KV_UNROLL
    for (int h = 0; h < kHeads; ++h) {
      for (int mask = kTile; mask < kWarpSize; mask *= 2) dot[h] += th.shfl_xor(dot[h], mask);
      dot[h] *= cur.token.k_scale;
    }

    // Online softmax over the tile's 16 tokens (lanes t and t + 16 hold the same values).
    FP8KV_UNROLL
    for (int h = 0; h < kHeads; ++h) {
      float logit = cur.token.ok ? dot[h] + slope[h] * static_cast<float>(a.position(pos) - newest) : -INFINITY;
      if (p.softcap > 0.0f && cur.token.ok) logit = p.softcap * tanhf(logit / p.softcap);
      float tile_max = logit;
      for (int mask = kTile / 2; mask > 0; mask /= 2) tile_max = fmaxf(tile_max, th.shfl_xor(tile_max, mask));
      const float m_new = fmaxf(m[h], tile_max);
      const float weight = softmax_weight(logit, m_new);
      float tile_sum = weight;
      for (int mask = kTile / 2; mask > 0; mask /= 2) tile_sum += th.shfl_xor(tile_sum, mask);
      const float correction = m_new == -INFINITY ? 1.0f : softmax_weight(m[h], m_new);
      l[h] = l[h] * correction + tile_sum;
      m[h] = m_new;
      FP8KV_UNROLL
      for (int k = 0; k < A::kRowsPerLane; ++k) acc[h][k] *= correction;
      if (group == 0) sm.p[warp][h][token] = weight * cur.token.v_scale;  // the sum above is without it
    }
    if constexpr (!Src::kBlockIds) {
      if (group == 0) {
        int offset = 0;
        const int block = cur.token.ok ? a.block_of(a.position(pos), offset) : -1;
        sm.ring_value[warp][token] = block >= 0 ? a.value_base(block) + offset : -1;
      }
    }
    th.sync_warp();

    // P.V for this lane's dims.
    FP8KV_UNROLL
    for (int k = 0; k < A::kRowsPerLane; ++k) {
      const int d = lane + k * kWarpSize;
      if (d >= head_size) continue;
      float v[16];
      if constexpr (A::kPrefetch) {
        decode16<cache_t, Src::kFmt>(cur.v[k], v);
      } else if constexpr (Src::kBlockIds) {
        Raw16 raw[A::kE];
        a.load_value(pos0, k, raw);
        decode16<cache_t, Src::kFmt>(raw, v);
      } else {
        a.ring_values(d, v);
      }
      // The last tile: past the end a block holds stale (even NaN) values; the first of a sliding window:
      // before its first position nothing was read.
      if (pos0 + kTile > task.end || pos0 < task.lo) {
        FP8KV_UNROLL
        for (int j = 0; j < kTile; ++j) v[j] = pos0 + j < task.end && pos0 + j >= task.lo ? v[j] : 0.0f;
      }
      FP8KV_UNROLL
      for (int h = 0; h < kHeads; ++h) {
        FP8KV_UNROLL
        for (int j = 0; j < kTile; j += 4) {
          const Vec<float, 4> pv = load_vec<float, 4>(&sm.p[warp][h][j]);
          FP8KV_UNROLL
          for (int e = 0; e < 4; ++e) acc[h][k] += pv.e[e] * v[j + e];
        }
      }
    }
    th.sync_warp();  // sm.p and sm.ring_value are rewritten by the next tile

    if constexpr (A::kPrefetch) {
      cur = next;
    } else {
      if (next_tile < t1) a.load(next_tile, cur);
    }
  }

  // Merge the warps: each one's (max, sum, output) rescaled to the block's max, summed in shared memory.
  if (lane == 0) {
    FP8KV_UNROLL
    for (int h = 0; h < kHeads; ++h) {
      sm.warp_max[warp][h] = m[h];
      sm.warp_sum[warp][h] = l[h];
    }
  }
  th.sync();  // also: every warp is done reading sm.q, which now holds the merged output
  float block_max[kHeads], block_sum[kHeads];
  FP8KV_UNROLL
  for (int h = 0; h < kHeads; ++h) {
    block_max[h] = -INFINITY;
    for (int w = 0; w < kAttentionWarps; ++w) block_max[h] = fmaxf(block_max[h], sm.warp_max[w][h]);
    block_sum[h] = 0.0f;
    for (int w = 0; w < kAttentionWarps; ++w) {
      block_sum[h] += softmax_weight(sm.warp_max[w][h], block_max[h]) * sm.warp_sum[w][h];
    }
  }
  for (int w = 0; w < kAttentionWarps; ++w) {
    if (warp == w) {
      FP8KV_UNROLL
      for (int h = 0; h < kHeads; ++h) {
        const float factor = softmax_weight(m[h], block_max[h]);
        FP8KV_UNROLL
        for (int k = 0; k < A::kRowsPerLane; ++k) {
          const int d = lane + k * kWarpSize;
          if (d >= kMaxD) continue;
          sm.q[h][d] = (w == 0 ? 0.0f : sm.q[h][d]) + acc[h][k] * factor;
        }
      }
    }
    th.sync();
  }

  const float v_scale = Src::v_scale(p, kv_head);
  FP8KV_UNROLL
  for (int h = 0; h < kHeads; ++h) {  // h a constant: block_sum[h] stays in a register
    if (h >= heads) continue;
    for (int d = tid; d < head_size; d += kAttentionThreads) {
      const float value = sm.q[h][d] * v_scale;
      if (direct) {
        store_model_value(p.out, (row0 + h) * head_size + d, p.out_dtype,
                          block_sum[h] != 0.0f ? value / block_sum[h] : 0.0f);
      } else {
        p.partial_out[((row0 + h) * total_splits + part) * head_size + d] = value;
      }
    }
    if (!direct && tid == 0) {
      p.partial_max[(row0 + h) * total_splits + part] = block_max[h];
      p.partial_sum[(row0 + h) * total_splits + part] = block_sum[h];
    }
  }
}

// Merge the splits of one (head, sequence): out = sum_s w_s out_s / sum_s w_s sum_s, w_s = exp(max_s - max).
// Empty splits carry max -inf and weigh 0. The weights of kReduceChunk splits at a time are computed once, by as
// many threads, into shared memory; each thread then sums its dims over them with several partials' loads in
// flight. (Each thread walking every split's maximum, sum and output one dependent load after another took
// ~20 us at 64 splits on an H100, 2026-11-27: more than the attention itself.)
constexpr int kReduceChunk = 256;
constexpr int kReduceDims = (kMaxHeadSize + kAttentionThreads - 1) / kAttentionThreads;  // dims a thread sums

struct ReduceSmem {
  float weight[kReduceChunk];
  float warp[kAttentionWarps];
};

// The block's maximum or sum of one value per thread (every thread gets it).
template <bool kMax, class Thread>
FP8KV_DEVICE float block_reduce(float v, ReduceSmem& sm, const Thread& th) {
  for (int mask = kWarpSize / 2; mask > 0; mask /= 2) {
    const float other = th.shfl_xor(v, mask);
    v = kMax ? fmaxf(v, other) : v + other;
  }
  if (th.index() % kWarpSize == 0) sm.warp[th.index() / kWarpSize] = v;
  th.sync();
  v = sm.warp[0];
  for (int w = 1; w < kAttentionWarps; ++w) v = kMax ? fmaxf(v, sm.warp[w]) : v + sm.warp[w];
  th.sync();  // sm.warp is reused
  return v;
}

template <class Thread>
FP8KV_DEVICE void attention_reduce_body(const AttentionParams& p, ReduceSmem& sm, const Thread& th) {
  const int head = th.block_x(), seq = th.block_y(), tid = th.index();
  const int total_splits = p.paged_splits + (p.window_starts != nullptr ? p.ring_splits : 0);
  const int64_t row = int64_t(seq) * p.num_heads + head;
  const float* part_max = p.partial_max + row * total_splits;
  const float* part_sum = p.partial_sum + row * total_splits;
  const float* part_out = p.partial_out + row * total_splits * p.head_size;
  // A sink is one more logit in the denominator, with no value (the kernels leave it to this merge).
  const float sink = p.sinks != nullptr ? p.sinks[head] : -INFINITY;
  float max_logit = sink;
  for (int s = tid; s < total_splits; s += kAttentionThreads) max_logit = fmaxf(max_logit, part_max[s]);
  max_logit = block_reduce<true>(max_logit, sm, th);

  float acc[kReduceDims], denom = 0.0f;
  FP8KV_UNROLL
  for (int k = 0; k < kReduceDims; ++k) acc[k] = 0.0f;
  for (int first = 0; first < total_splits; first += kReduceChunk) {
    const int n = min_int(kReduceChunk, total_splits - first);
    for (int s = tid; s < n; s += kAttentionThreads) {
      const float w = softmax_weight(part_max[first + s], max_logit);
      sm.weight[s] = w;
      denom += w * part_sum[first + s];
    }
    th.sync();
    FP8KV_UNROLL
    for (int k = 0; k < kReduceDims; ++k) {
      const int d = tid + k * kAttentionThreads;
      if (d >= p.head_size) continue;
      const float* out_d = part_out + int64_t(first) * p.head_size + d;
      float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;  // four chains: four loads in flight
      int s = 0;
      for (; s + 4 <= n; s += 4) {
        const float o0 = out_d[int64_t(s) * p.head_size], o1 = out_d[int64_t(s + 1) * p.head_size];
        const float o2 = out_d[int64_t(s + 2) * p.head_size], o3 = out_d[int64_t(s + 3) * p.head_size];
        // A split that weighs 0 is skipped, not multiplied: 0 * NaN would be NaN.
        a0 += sm.weight[s] != 0.0f ? sm.weight[s] * o0 : 0.0f;
        a1 += sm.weight[s + 1] != 0.0f ? sm.weight[s + 1] * o1 : 0.0f;
        a2 += sm.weight[s + 2] != 0.0f ? sm.weight[s + 2] * o2 : 0.0f;
        a3 += sm.weight[s + 3] != 0.0f ? sm.weight[s + 3] * o3 : 0.0f;
      }
      for (; s < n; ++s) a0 += sm.weight[s] != 0.0f ? sm.weight[s] * out_d[int64_t(s) * p.head_size] : 0.0f;
      acc[k] += (a0 + a1) + (a2 + a3);
    }
    th.sync();  // sm.weight is rewritten for the next chunk
  }
  denom = block_reduce<false>(denom, sm, th) + softmax_weight(sink, max_logit);
  FP8KV_UNROLL
  for (int k = 0; k < kReduceDims; ++k) {
    const int d = tid + k * kAttentionThreads;
    if (d < p.head_size) store_model_value(p.out, row * p.head_size + d, p.out_dtype, denom != 0.0f ? acc[k] / denom : 0.0f);
  }
}

// fn(std::integral_constant<int, kChunks>{}, std::integral_constant<int, kHeads>{}) for a call's head size
// and GQA group: 16-dim chunks of 4, 8 or 16 (head sizes up to 64, 128, 256) and 1, 4 or 8 head slots
// (head_slots_for).
template <class Fn>
void with_attention_shape(int head_size, int group, const Fn& fn) {
  const auto by_heads = [&](auto chunks) {
    const int slots = head_slots_for(group, head_size);
    if (slots == 1) fn(chunks, std::integral_constant<int, 1>{});
    else if (slots == 4) fn(chunks, std::integral_constant<int, 4>{});
    else fn(chunks, std::integral_constant<int, 8>{});
  };
  if (head_size <= 64) {
    by_heads(std::integral_constant<int, 4>{});
  } else if (head_size <= 128) {
    by_heads(std::integral_constant<int, 8>{});
  } else {  // at most 4 slots (head_slots_for)
    if (head_slots_for(group, head_size) == 1) fn(std::integral_constant<int, 16>{}, std::integral_constant<int, 1>{});
    else fn(std::integral_constant<int, 16>{}, std::integral_constant<int, 4>{});
  }
}

#if !defined(FP8KV_PLATFORM_HOST)
// An occupancy floor of Src::kMinBlocks blocks per SM (2 for 8 head slots, whose outputs take more registers): 3 gives up to ~170 registers a thread, room for an FP8
// tile's K and V twice (the current one and the next) so that loads stay in flight while a warp computes;
// without a floor ptxas picks its own trade of spills for occupancy, kernel by kernel. HIP reads a second
// argument as waves per execution unit, so it gets the thread count only.
#if defined(FP8KV_PLATFORM_CUDA)
#define FP8KV_ATTENTION_LAUNCH_BOUNDS(min_blocks) __launch_bounds__(kAttentionThreads, min_blocks)
#else
#define FP8KV_ATTENTION_LAUNCH_BOUNDS(min_blocks) __launch_bounds__(kAttentionThreads)
#endif

template <class Src, int kChunks, int kHeads>
__global__ void FP8KV_ATTENTION_LAUNCH_BOUNDS(kHeads > 4 ? 2 : Src::kMinBlocks)
    attention_kernel(const AttentionParams params) {
  __shared__ AttentionSmem<kHeads, kChunks * 16> smem;
  attention_body<Src, kChunks, kHeads>(params, smem, GpuThread{});
}
#endif

}  // namespace fp8kv::gpu
