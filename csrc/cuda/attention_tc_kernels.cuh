// Paged decode attention on tensor cores, for FP8 and 16-bit caches (docs/design.md section 9).
//
// Why: decode reads every cached byte once and does a few multiply-adds per byte per query head of the GQA
// group. On CUDA cores that arithmetic, the FP8 decoding and the register file it needs kept the earlier
// kernel (attention_kernels.cuh, still used for float32 caches, the window ring and HIP) far from the memory
// limit. Here the group's heads are the rows of an m16n8k16 tile, so Q.K and P.V are a handful of mma
// instructions per tile, and each warp streams its tiles through shared memory with cp.async, several tiles
// deep, so that enough bytes are in flight to keep HBM busy (Little's law: ~25 KB an SM on an H100/H200).
//
// A thread block (kTcWarps warps) takes the query heads of one KV head (up to 8, or 16: tc_heads), one sequence
// and one split of its positions; warp w takes the split's tiles w, w + kTcWarps, ... of kTcTile positions and
// keeps an online softmax for its heads; the warps merge through shared memory at the end, and splits merge
// in attention_reduce_body as for the CUDA-core kernel (same partials).
//
// Fragments (lane = 4 g + t; PTX's m16n8k16 layouts):
//   Q.K: S[head][token] = Q (A: 16 heads x 16 dims) x K^T (B: 16 dims x 8 tokens). The dims of a k-step are
//     permuted so that the four 16-byte key chunks a lane loads per token feed its B fragments directly:
//     k-step (group q, step j), slots (2t, 2t+1 | 2t+8, 2t+9) <-> dims kX (4q + t) + 4j + (0, 1 | 2, 3). The
//     query fragments are built once, in shared memory, with the same permutation.
//   The 32 tokens of a tile are permuted too, token(n-tile n, column c) = 8 (c / 2) + 4 (n / 2) + 2 (n % 2) +
//     c % 2, so that S's accumulator fragments are, as they are, the B fragments of P.V, and a lane's value
//     loads are 8 consecutive tokens of one dim.
//   P.V: O^T[dim][head] = V^T (A: 16 dims x 16 tokens) x P^T (B: 16 tokens x 8 heads).
// FP8 codes become f16 pairs with a few integer instructions (mma_fragments.cuh); 16-bit caches are used as
// they are (bf16 with bf16 mma). Float32 queries are split into a high and a low f16 half, and so are the
// probabilities, so that float32 models keep float32 accuracy (two mma instead of one).
#pragma once

#include <cmath>

#include "attention_kernels.cuh"
#include "mma_fragments.cuh"

namespace fp8kv::gpu {

template <typename cache_t, Fp8Format kFormat, int kD, int kHeads, bool kPrecise>
struct TcConfig {
  using Cache = cache_t;
  using Src = PagedSource<cache_t, kFormat>;  // block ids, lengths, scales: as the CUDA-core kernel
  using Quads = Fp8Quads<kFormat>;
  static constexpr Fp8Format kFmt = kFormat;
  static constexpr int kDims = kD;
  static constexpr int kSlots = kHeads;
  static constexpr bool kSplitHalves = kPrecise;
  static constexpr int kE = static_cast<int>(sizeof(cache_t));
  static constexpr bool kQuantized = std::is_same_v<cache_t, uint8_t>;
  static_assert(kQuantized || std::is_same_v<cache_t, half_t> || std::is_same_v<cache_t, bf16_t>,
                "tensor cores take FP8 and 16-bit caches");
  static constexpr MmaType kMma = std::is_same_v<cache_t, bf16_t> ? MmaType::kBF16 : MmaType::kF16;
  static constexpr int kX = 16 / kE;  // elements in a 16-byte key chunk
  static constexpr int kGroups = tc_key_groups(kE, kD);
  static constexpr int kStepsPerGroup = 4 / kE;
  static constexpr int kKSteps = tc_key_steps(kE, kD);
  static constexpr int kMTiles = kD / 16;
  static constexpr int kRows = kHeads / 8;  // QK rows in use: g, and g + 8 for 16 heads; = P.V head tiles
  static constexpr int kQRegs = tc_query_regs(kHeads, kPrecise);
  static constexpr int kKeyBytes = tc_key_stage_bytes(kE, kD);
  static constexpr int kStageBytes = tc_stage_bytes(kE, kD);
  static constexpr int kQueryBytes = tc_query_bytes(kE, kD, kHeads, kPrecise);
  // What a decoded element must be multiplied by to give the stored value.
  static constexpr float kRescale = kQuantized ? Quads::kRescale : 1.0f;
};

using U32x4 = Vec<uint32_t, 4>;

FP8KV_DEVICE U32x4 load_shared16(const uint8_t* p) { return load_vec<uint32_t, 4>(reinterpret_cast<const uint32_t*>(p)); }

// Four cached elements of one lane as two operand registers: FP8 codes decoded (flagging in `specials` the
// rare codes the decoding cannot express, for TcAttention::fix_specials), 16-bit values as they are.
template <class Cfg>
FP8KV_DEVICE void operand_pairs(const U32x4& raw, int quad, uint32_t& lo, uint32_t& hi, uint32_t& specials) {
  if constexpr (Cfg::kQuantized) {
    using Quads = typename Cfg::Quads;
    Quads::decode(raw.e[quad], lo, hi);
    if constexpr (Quads::kChecked) specials |= Quads::special(raw.e[quad]);
  } else {
    lo = raw.e[2 * quad];
    hi = raw.e[2 * quad + 1];
  }
}

// Position within a tile of the token in n-tile n, column c of S (see the top of this file).
FP8KV_DEVICE int tc_token(int n, int c) { return 8 * (c >> 1) + 4 * (n >> 1) + 2 * (n & 1) + (c & 1); }

template <class Cfg, class Thread>
struct TcAttention {
  using cache_t = typename Cfg::Cache;
  static constexpr int kE = Cfg::kE, kX = Cfg::kX, kGroups = Cfg::kGroups, kMTiles = Cfg::kMTiles;
  static constexpr int kRows = Cfg::kRows, kQRegs = Cfg::kQRegs;
  static constexpr MmaType kMma = Cfg::kMma;

  const AttentionParams& p;
  const CacheRef& c;
  const Thread& th;
  const int* block_ids;  // the split's, from first_entry on; -1 where out of range
  const uint32_t* query;  // [k-steps][32 lanes][kQRegs] fragments
  Task task;
  int lane, g, t, first_entry;
  float logit_scale;  // log2(e) * k_scale * kRescale / (the query's power-of-two factor): logits in log2 units
  float cap_log2;      // log2(e) * the logit soft-cap, 0 for none
  float slope[kRows];  // log2(e) * the ALiBi slope of each row

  // Where this lane's copies come from: its KV head's chunk t (keys) and dim g (values) of block 0, and the
  // strides in bytes to other blocks, chunk groups and dims.
  const uint8_t* key_lane;
  const uint8_t* value_lane;
  int64_t key_block_bytes, value_block_bytes;
  int key_group_bytes, value_dims_bytes;
  int key_chunk_bytes[kGroups];  // 16 where chunk 4q + t is inside the head, else 0
  uint32_t value_dims;  // bit 2i + h: dim 16i + g + 8h is inside the head

  FP8KV_DEVICE void locate(int head_size) {
    const auto* key = static_cast<const uint8_t*>(c.key);
    const auto* value = static_cast<const uint8_t*>(c.value);
    key_lane = key + (int64_t(task.kv_head) * c.key_head_stride + int64_t(t) * c.block_size * kX) * kE;
    value_lane = value + (int64_t(task.kv_head) * c.value_head_stride + int64_t(g) * c.block_size) * kE;
    key_block_bytes = c.key_block_stride * kE;
    value_block_bytes = c.value_block_stride * kE;
    key_group_bytes = 4 * c.block_size * 16;
    value_dims_bytes = 8 * c.block_size * kE;
    FP8KV_UNROLL
    for (int q = 0; q < kGroups; ++q) key_chunk_bytes[q] = (4 * q + t) * kX < head_size ? 16 : 0;
    value_dims = 0;
    FP8KV_UNROLL
    for (int k = 0; k < 2 * kMTiles; ++k) value_dims |= (16 * (k / 2) + g + 8 * (k % 2) < head_size ? 1u : 0u) << k;
  }

  // The running softmax of this lane's rows and its share of their outputs.
  float m[kRows], l[kRows];
  float o[kMTiles][kRows][4];
  // Dynamic scales (p.k_scale_cache set): each token's K scale multiplies its logit and its V scale its
  // probability. The weights p * vs are f16 (or bf16) mma operands, so each row takes them relative to unit[r],
  // the largest weight it has seen (in the running max's frame, as the outputs): o holds the outputs over
  // unit[r], rescaled when it grows and multiplied by it at the end. A weight under 2^-24 of the row's largest
  // (f16 subnormals) falls out of P.V, a contribution below the 16-bit operands' precision of that largest.
  bool dynamic;
  float unit[kRows];
  float k_next, v_next;  // this lane's position's scales in the next tile, loaded a tile ahead (load_scales)

  // The dynamic scales of this lane's position in `tile` (1 and 0 outside the sequence or a missing block) into
  // k_next / v_next: loaded while the tile before it is computed, so their latency hides behind its mma's.
  FP8KV_DEVICE void load_scales(int tile) {
    const int pos = task.start + tile * kTcTile + lane;
    k_next = 1.0f;
    v_next = 0.0f;
    if (pos < task.end && pos >= task.lo && block_at(pos) >= 0) {
      Cfg::Src::token_scales(p, block_at(pos), task.kv_head, pos & (c.block_size - 1), k_next, v_next);
    }
  }

  FP8KV_DEVICE int block_at(int pos) const { return block_ids[(pos >> c.block_shift) - first_entry]; }

  // This lane's copies of tile `tile` into `stage` (zero-filled past the end and for missing blocks). A lane's
  // four key tokens (tc_token(n, g), n = 0..3: 2n apart) and its eight value tokens each lie in one aligned
  // group of 8 positions, so in one block (blocks hold 8 or more): one block id each.
  FP8KV_DEVICE void issue(int tile, uint8_t* stage) const {
    const int base = task.start + tile * kTcTile;
    const int key_pos = base + tc_token(0, g);
    // The block of the lane's group of 8 (looked up at a position the sequence attends to, if any: a sliding
    // window's older blocks may be gone).
    const int key_seen = key_pos > task.lo ? key_pos : task.lo;
    const int key_block = key_seen < task.end && key_seen <= key_pos + 6 ? block_at(key_seen) : -1;
    const uint8_t* key = key_lane + int64_t(key_block < 0 ? 0 : key_block) * key_block_bytes +
                         (key_pos & (c.block_size - 1)) * 16;
    FP8KV_UNROLL
    for (int n = 0; n < 4; ++n) {
      const int pos = key_pos + 2 * n;
      const int bytes = key_block >= 0 && pos < task.end && pos >= task.lo ? 16 : 0;
      FP8KV_UNROLL
      for (int q = 0; q < kGroups; ++q) {
        th.template copy_async<16>(stage + ((n * kGroups + q) * 32 + lane) * 16,
                                   key + 32 * n + int64_t(q) * key_group_bytes, bytes & key_chunk_bytes[q]);
      }
    }
    const int value_pos = base + 8 * t;
    const int count = min_int(task.end - value_pos, 8);
    const int value_block = count > 0 && value_pos + 8 > task.lo ? block_at(value_pos > task.lo ? value_pos : task.lo) : -1;
    const int bytes = value_block >= 0 ? count * kE : 0;
    const uint8_t* value = value_lane + int64_t(value_block < 0 ? 0 : value_block) * value_block_bytes +
                           (value_pos & (c.block_size - 1)) * kE;
    uint8_t* values = stage + Cfg::kKeyBytes;
    // All or nothing is a predicate to the copy; a partial group (the sequence's last) zero-fills its tail,
    // which costs address arithmetic per copy: only there.
    const auto copy_values = [&](auto partial) {
      FP8KV_UNROLL
      for (int i = 0; i < kMTiles; ++i) {
        FP8KV_UNROLL
        for (int h = 0; h < 2; ++h) {  // dims 16 i + g + 8 h
          const bool ok = value_dims >> (2 * i + h) & 1;
          const uint8_t* src = value + int64_t(2 * i + h) * value_dims_bytes;
          const int size = decltype(partial)::value ? (ok ? bytes : 0) : (ok && bytes != 0 ? 8 * kE : 0);
          if constexpr (kE == 1) {
            th.template copy_async<8>(values + (i * 32 + lane) * 16 + 8 * h, src, size);
          } else {
            th.template copy_async<16>(values + ((i * 2 + h) * 32 + lane) * 16, src, size);
          }
        }
      }
    };
    if (bytes == 8 * kE || bytes == 0) {
      copy_values(std::false_type{});
    } else {
      copy_values(std::true_type{});
    }
  }

  // A sliding window's first tile: value bytes of positions before the window's first were copied with their
  // group of 8; zero them (this lane's own copies), so that not even a NaN there reaches P.V.
  FP8KV_DEVICE void clear_before_window(int base, uint8_t* stage) const {
    uint8_t* values = stage + Cfg::kKeyBytes;
    const int pos0 = base + 8 * t;
    FP8KV_UNROLL
    for (int i = 0; i < kMTiles; ++i) {
      FP8KV_UNROLL
      for (int h = 0; h < 2; ++h) {
        uint8_t* slot = kE == 1 ? values + (i * 32 + lane) * 16 + 8 * h : values + ((i * 2 + h) * 32 + lane) * 16;
        for (int j = 0; j < 8; ++j) {
          if (pos0 + j < task.lo) {
            FP8KV_UNROLL
            for (int b = 0; b < kE; ++b) slot[j * kE + b] = 0;
          }
        }
      }
    }
  }

  // One tile, from the stage this lane's copies filled.
  // next_tile: this warp's next tile in the split (-1: none), whose scales are loaded now (dynamic scales).
  FP8KV_DEVICE void compute(int tile, uint8_t* stage, int next_tile) {
    const int base = task.start + tile * kTcTile;
    if (base < task.lo) clear_before_window(base, stage);
    const int mine = base + lane;
    const bool mine_ok = mine < task.end && mine >= task.lo && block_at(mine) >= 0;
    const uint32_t valid = th.ballot(mine_ok);
    // This lane's token's dynamic scales (its position is base + lane), loaded before the mma's use them.
    const float k_mine = k_next, v_mine = v_next;  // loaded a tile ahead (1 and 0 where mine_ok is false)
    if (dynamic && next_tile >= 0) load_scales(next_tile);

    // S = Q K^T for the tile's 4 n-tiles of 8 tokens.
    float s[4][4];
    FP8KV_UNROLL
    for (int n = 0; n < 4; ++n) {
      FP8KV_UNROLL
      for (int r = 0; r < 4; ++r) s[n][r] = 0.0f;
    }
    uint32_t key_specials = 0, value_specials = 0;
    FP8KV_UNROLL
    for (int q = 0; q < kGroups; ++q) {
      FP8KV_COMPILER_FENCE();  // one group's keys in registers at a time (hoisting them all spilled at d256)
      U32x4 keys[4];
      FP8KV_UNROLL
      for (int n = 0; n < 4; ++n) keys[n] = load_shared16(stage + ((n * kGroups + q) * 32 + lane) * 16);
      FP8KV_UNROLL
      for (int j = 0; j < Cfg::kStepsPerGroup; ++j) {
        const uint32_t* qf = query + ((q * Cfg::kStepsPerGroup + j) * 32 + lane) * kQRegs;
        FP8KV_UNROLL
        for (int half = 0; half < kQRegs / 4; ++half) {
          // a0 = row g dims lo, a1 = row g + 8 lo, a2 = row g hi, a3 = row g + 8 hi (zero rows with 8 heads)
          const U32x4 quad = load_vec<uint32_t, 4>(qf + 4 * half);
          const uint32_t a[4] = {quad.e[0], quad.e[1], quad.e[2], quad.e[3]};
          FP8KV_UNROLL
          for (int n = 0; n < 4; ++n) {
            uint32_t b[2];
            operand_pairs<Cfg>(keys[n], j, b[0], b[1], key_specials);
            th.template mma<kMma>(s[n], a, b);
          }
        }
      }
    }

    // The scales of this lane's 8 tokens, from their lanes (1 with static scales); the outputs' rescale.
    float k_tok[4][2], v_tok[4][2];
    FP8KV_UNROLL
    for (int n = 0; n < 4; ++n) {
      FP8KV_UNROLL
      for (int cc = 0; cc < 2; ++cc) k_tok[n][cc] = v_tok[n][cc] = 1.0f;
    }
    if (dynamic) {
      FP8KV_UNROLL
      for (int n = 0; n < 4; ++n) {
        FP8KV_UNROLL
        for (int cc = 0; cc < 2; ++cc) {
          const int token = tc_token(n, 2 * t + cc);
          k_tok[n][cc] = th.shfl(k_mine, token);
          v_tok[n][cc] = th.shfl(v_mine, token);
        }
      }
    }

    // Online softmax of each row over the tile (a row's 32 tokens sit in the 4 lanes of its g).
    float prob[kRows][4][2], correction[kRows], o_correction[kRows];
    const int newest = task.seq_len - 1;
    FP8KV_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float x[4][2], tile_max = -INFINITY;
      FP8KV_UNROLL
      for (int n = 0; n < 4; ++n) {
        FP8KV_UNROLL
        for (int cc = 0; cc < 2; ++cc) {
          const int token = tc_token(n, 2 * t + cc);
          float logit = s[n][2 * r + cc] * k_tok[n][cc] * logit_scale +
                        slope[r] * static_cast<float>(base + token - newest);
          // cap * tanh(l / cap) in natural units is this in log2 units, cap_log2 = cap * log2(e)
          if (cap_log2 > 0.0f) logit = cap_log2 * tanhf(logit / cap_log2);
          x[n][cc] = (valid >> token) & 1u ? logit : -INFINITY;
          tile_max = fmaxf(tile_max, x[n][cc]);
        }
      }
      tile_max = fmaxf(tile_max, th.shfl_xor(tile_max, 1));
      tile_max = fmaxf(tile_max, th.shfl_xor(tile_max, 2));
      const float m_new = fmaxf(m[r], tile_max);
      // exp2(-inf - m) is 0 with no branch; a row with nothing yet subtracts 0 instead of -inf.
      const float m_safe = m_new == -INFINITY ? 0.0f : m_new;
      correction[r] = exp2f(m[r] - m_safe);
      float sum = 0.0f;
      FP8KV_UNROLL
      for (int n = 0; n < 4; ++n) {
        FP8KV_UNROLL
        for (int cc = 0; cc < 2; ++cc) {
          prob[r][n][cc] = exp2f(x[n][cc] - m_safe);
          sum += prob[r][n][cc];
        }
      }
      l[r] = l[r] * correction[r] + sum;
      m[r] = m_new;
      o_correction[r] = correction[r];
      if (dynamic) {  // the weights p * vs over the row's unit (see unit)
        float w_max = 0.0f;
        FP8KV_UNROLL
        for (int n = 0; n < 4; ++n) {
          FP8KV_UNROLL
          for (int cc = 0; cc < 2; ++cc) {
            prob[r][n][cc] *= v_tok[n][cc];
            w_max = fmaxf(w_max, prob[r][n][cc]);
          }
        }
        w_max = fmaxf(w_max, th.shfl_xor(w_max, 1));
        w_max = fmaxf(w_max, th.shfl_xor(w_max, 2));
        const float carried = unit[r] * correction[r];
        const float grown = fmaxf(carried, w_max);
        const float inverse = grown > 0.0f ? 1.0f / grown : 0.0f;
        FP8KV_UNROLL
        for (int n = 0; n < 4; ++n) {
          FP8KV_UNROLL
          for (int cc = 0; cc < 2; ++cc) prob[r][n][cc] *= inverse;
        }
        o_correction[r] = grown > 0.0f ? carried / grown : correction[r];
        unit[r] = grown;
      }
    }

    // Rescale the outputs: this lane holds heads 2t and 2t + 1 of each head tile, whose rows live in the
    // lanes of g = 2t and 2t + 1.
    FP8KV_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float even = th.shfl(o_correction[r], 8 * t), odd = th.shfl(o_correction[r], 8 * t + 4);
      FP8KV_UNROLL
      for (int i = 0; i < kMTiles; ++i) {
        o[i][r][0] *= even;
        o[i][r][1] *= odd;
        o[i][r][2] *= even;
        o[i][r][3] *= odd;
      }
    }

    // P as B fragments: k-step j's slots (2t, 2t+1 | 2t+8, 2t+9) are S's n-tiles 2j and 2j + 1.
    constexpr int kHalves = Cfg::kSplitHalves ? 2 : 1;
    uint32_t pb[kRows][2][kHalves][2];
    FP8KV_UNROLL
    for (int r = 0; r < kRows; ++r) {
      FP8KV_UNROLL
      for (int j = 0; j < 2; ++j) {
        FP8KV_UNROLL
        for (int k = 0; k < 2; ++k) {
          const float p0 = prob[r][2 * j + k][0], p1 = prob[r][2 * j + k][1];
          pb[r][j][0][k] = pack_pair<kMma>(p0, p1);
          if constexpr (kHalves == 2) {
            pb[r][j][1][k] = pack_pair<kMma>(p0 - unpack_half<kMma>(pb[r][j][0][k], 0),
                                             p1 - unpack_half<kMma>(pb[r][j][0][k], 1));
          }
        }
      }
    }

    // O^T += V^T P^T, 16 dims at a time.
    const uint8_t* values = stage + Cfg::kKeyBytes;
    FP8KV_UNROLL
    for (int i = 0; i < kMTiles; ++i) {
      FP8KV_COMPILER_FENCE();
      uint32_t a[2][4];  // per k-step j: dim g lo, dim g + 8 lo, dim g hi, dim g + 8 hi
      if constexpr (kE == 1) {
        const U32x4 raw = load_shared16(values + (i * 32 + lane) * 16);  // words 0-1: dim g, 2-3: dim g + 8
        FP8KV_UNROLL
        for (int j = 0; j < 2; ++j) {
          operand_pairs<Cfg>(raw, j, a[j][0], a[j][2], value_specials);
          operand_pairs<Cfg>(raw, 2 + j, a[j][1], a[j][3], value_specials);
        }
      } else {
        const U32x4 low = load_shared16(values + ((i * 2) * 32 + lane) * 16);
        const U32x4 high = load_shared16(values + ((i * 2 + 1) * 32 + lane) * 16);
        FP8KV_UNROLL
        for (int j = 0; j < 2; ++j) {
          operand_pairs<Cfg>(low, j, a[j][0], a[j][2], value_specials);
          operand_pairs<Cfg>(high, j, a[j][1], a[j][3], value_specials);
        }
      }
      FP8KV_UNROLL
      for (int j = 0; j < 2; ++j) {
        FP8KV_UNROLL
        for (int r = 0; r < kRows; ++r) {
          FP8KV_UNROLL
          for (int half = 0; half < kHalves; ++half) th.template mma<kMma>(o[i][r], a[j], pb[r][j][half]);
        }
      }
    }
    if constexpr (Cfg::kQuantized && Cfg::Quads::kChecked) {
      if (th.ballot((key_specials | value_specials) != 0) != 0) fix_specials(key_specials != 0, values);
    }
  }

  // A NaN code the fast decoding read as a number (Fp8Quads): what the reference gives. Everything in a stage
  // is a position the sequence attends to (the rest was zero-filled), so a NaN key makes every row's logits
  // NaN at that position, hence their sums, hence every output; a NaN value makes its dim NaN for every head.
  FP8KV_DEVICE void fix_specials(bool key_special, const uint8_t* values) {
    if (th.ballot(key_special) != 0) {
      FP8KV_UNROLL
      for (int r = 0; r < kRows; ++r) l[r] = NAN;
    }
    // Dims with a NaN value: bit 2i + h for dim 16 i + g + 8 h, gathered over the lanes of this g (the lanes
    // that hold those dims' outputs).
    uint32_t dims = 0;
    FP8KV_UNROLL
    for (int i = 0; i < kMTiles; ++i) {
      FP8KV_UNROLL
      for (int h = 0; h < 2; ++h) {
        const U32x4 raw = kE == 1 ? load_shared16(values + (i * 32 + lane) * 16)
                                  : load_shared16(values + ((i * 2 + h) * 32 + lane) * 16);
        uint32_t special = 0;
        FP8KV_UNROLL
        for (int w = 0; w < 2; ++w) special |= Cfg::Quads::special(raw.e[kE == 1 ? 2 * h + w : w]);
        dims |= (special != 0 ? 1u : 0u) << (2 * i + h);
      }
    }
    dims |= th.shfl_xor_bits(dims, 1);
    dims |= th.shfl_xor_bits(dims, 2);
    FP8KV_UNROLL
    for (int i = 0; i < kMTiles; ++i) {
      FP8KV_UNROLL
      for (int r = 0; r < kRows; ++r) {
        FP8KV_UNROLL
        for (int k = 0; k < 4; ++k) {
          if (dims >> (2 * i + (k >> 1)) & 1u) o[i][r][k] = NAN;
        }
      }
    }
  }
};

// The query fragments of one k-step slot (see the top of the file), scaled by q_mul, in shared memory.
template <class Cfg>
FP8KV_DEVICE void store_query_fragments(const AttentionParams& p, int seq, int first_head, int heads, float q_mul,
                                        uint32_t* out, int slot) {
  constexpr MmaType kMma = Cfg::kMma;
  const int step = slot / 32, lane = slot % 32, g = lane >> 2, t = lane & 3;
  const int q = step / Cfg::kStepsPerGroup, j = step % Cfg::kStepsPerGroup;
  const int d0 = Cfg::kX * (4 * q + t) + 4 * j;
  const auto value = [&](int h, int d) {
    if (h >= heads || d >= p.head_size) return 0.0f;
    return load_model_value(p.query, int64_t(seq) * p.query_seq_stride + int64_t(first_head + h) * p.query_head_stride + d,
                            p.query_dtype) * p.scale * q_mul;
  };
  // Per row in use (g, then g + 8): the lo pair (dims d0, d0 + 1) and the hi pair (d0 + 2, d0 + 3).
  float v[Cfg::kRows][2][2];
  for (int r = 0; r < Cfg::kRows; ++r) {
    for (int k = 0; k < 2; ++k) {
      v[r][k][0] = value(g + 8 * r, d0 + 2 * k);
      v[r][k][1] = value(g + 8 * r, d0 + 2 * k + 1);
    }
  }
  uint32_t* regs = out + int64_t(slot) * Cfg::kQRegs;
  for (int i = 0; i < Cfg::kQRegs; ++i) regs[i] = 0u;  // rows g + 8 of 8 heads stay zero
  for (int r = 0; r < Cfg::kRows; ++r) {
    for (int k = 0; k < 2; ++k) {
      const int at = 2 * k + r;  // a0 (row g, dims lo), a1 (row g + 8, lo), a2 (g, hi), a3 (g + 8, hi)
      const uint32_t high = pack_pair<kMma>(v[r][k][0], v[r][k][1]);
      regs[at] = high;
      if constexpr (Cfg::kSplitHalves) {
        regs[4 + at] = pack_pair<kMma>(v[r][k][0] - unpack_half<kMma>(high, 0),
                                       v[r][k][1] - unpack_half<kMma>(high, 1));
      }
    }
  }
}

template <class Cfg, class Thread>
FP8KV_DEVICE void tc_attention_body(const AttentionParams& p, uint8_t* smem, const Thread& th) {
  using Src = typename Cfg::Src;
  using A = TcAttention<Cfg, Thread>;
  constexpr int kHeads = Cfg::kSlots, kD = Cfg::kDims;
  const int tid = th.index(), lane = tid % 32, warp = tid / 32;
  const BlockWork work = block_work<kHeads>(p, th);
  const int kv_head = work.kv_head, first_head = work.first_head, heads = work.heads, seq = work.seq;
  const int split = work.split;
  const CacheRef& c = p.paged;
  const int head_size = p.head_size;
  const Task task = make_task<Src>(p, seq, kv_head, tid == 0 && split == 0 && th.block_x() == 0);
  const int num_splits = p.paged_splits;
  const int tiles = (task.end - task.start + kTcTile - 1) / kTcTile;
  const int t0 = split * split_tiles(tiles, num_splits), t1 = min_int(t0 + split_tiles(tiles, num_splits), tiles);
  // No reduce: write the output here (sinks join the softmax in the reduce).
  const bool direct = num_splits == 1 && p.window_starts == nullptr && p.sinks == nullptr;
  const int64_t row0 = int64_t(seq) * p.num_heads + first_head;
  const int total_splits = p.paged_splits + (p.window_starts != nullptr ? p.ring_splits : 0);

  if (t0 >= t1) {  // nothing to attend to: an empty output, or a split the merge weighs 0
    write_empty_split<kTcThreads>(p, direct, row0, heads, total_splits, split, tid);
    return;
  }

  int* block_ids = reinterpret_cast<int*>(smem);
  auto* scratch = reinterpret_cast<float*>(smem + kTcScratchOffset);  // the warps' largest |query|
  auto* query = reinterpret_cast<uint32_t*>(smem + kTcBlockIdBytes);
  uint8_t* pipes = smem + kTcBlockIdBytes + Cfg::kQueryBytes;

  // The split's block ids, checked once, from the first attended position on (a sliding window's older blocks
  // may be gone).
  const int pos_first = task.start + t0 * kTcTile > task.lo ? task.start + t0 * kTcTile : task.lo;
  const int pos_last = min_int(task.start + t1 * kTcTile, task.end) - 1;
  const int first_entry = pos_first >> c.block_shift;
  const int entries = (pos_last >> c.block_shift) - first_entry + 1;
  const int* table = c.block_tables + int64_t(seq) * c.table_stride + first_entry;
  for (int i = tid; i < entries && i < kTcMaxSplitBlocks; i += kTcThreads) {
    int block = table[i];
    if (block < 0 || block >= c.num_blocks) {
      report_error(p.error_flag, kErrorBlockOutOfRange);
      block = -1;
    }
    block_ids[i] = block;
  }

  // The queries go into 16-bit fragments scaled by a power of two that puts the largest near 2^14: no
  // overflow, and small queries keep their precision (the factor comes back out of the logits exactly).
  float largest = 0.0f;
  for (int i = tid; i < heads * head_size; i += kTcThreads) {
    const int h = i / head_size, d = i % head_size;
    largest = fmaxf(largest, fabsf(load_model_value(p.query, int64_t(seq) * p.query_seq_stride +
                                                                 int64_t(first_head + h) * p.query_head_stride + d,
                                                    p.query_dtype) * p.scale));
  }
  for (int mask = 16; mask > 0; mask /= 2) largest = fmaxf(largest, th.shfl_xor(largest, mask));
  if (lane == 0) scratch[warp] = largest;
  th.sync();  // block ids and the warps' maxima are read by every warp
  largest = 0.0f;
  for (int w = 0; w < kTcWarps; ++w) largest = fmaxf(largest, scratch[w]);
  int exponent = 0;
  if (largest > 0.0f && std::isfinite(largest)) frexpf(largest, &exponent);
  exponent = exponent < -100 ? -100 : exponent > 100 ? 100 : exponent;
  const float q_mul = largest > 0.0f && std::isfinite(largest) ? ldexpf(1.0f, 14 - exponent) : 1.0f;

  constexpr float kLog2e = 1.4426950408889634f;
  A a{p, c, th, block_ids, query, task, lane, lane >> 2, lane & 3, first_entry,
      kLog2e * Src::k_scale(p, kv_head) * Cfg::kRescale / q_mul, kLog2e * p.softcap};
  a.locate(head_size);
  a.dynamic = Cfg::kQuantized && p.k_scale_cache != nullptr;
  a.k_next = 1.0f;
  a.v_next = 0.0f;
  FP8KV_UNROLL
  for (int r = 0; r < Cfg::kRows; ++r) {
    const int h = (lane >> 2) + 8 * r;
    a.slope[r] = p.alibi_slopes != nullptr && h < heads ? kLog2e * p.alibi_slopes[first_head + h] : 0.0f;
    a.m[r] = -INFINITY;
    a.l[r] = 0.0f;
    a.unit[r] = 0.0f;
    FP8KV_UNROLL
    for (int i = 0; i < Cfg::kMTiles; ++i) {
      FP8KV_UNROLL
      for (int k = 0; k < 4; ++k) a.o[i][r][k] = 0.0f;
    }
  }

  // The pipeline: stage k % stages holds this warp's k-th tile; stages - 1 tiles are in flight while one is
  // computed. Each lane reads back only what it copied, so a lane's own wait is all the ordering needed. The
  // first tiles are on their way before the query fragments are built: that work hides in their latency.
  const int stages = p.tc_stages;
  const int mine = t1 - t0 > warp ? (t1 - t0 - warp + kTcWarps - 1) / kTcWarps : 0;
  if (a.dynamic && mine > 0) a.load_scales(t0 + warp);
  uint8_t* pipe = pipes + warp * stages * Cfg::kStageBytes;
  for (int k = 0; k < stages - 1; ++k) {
    if (k < mine) a.issue(t0 + warp + k * kTcWarps, pipe + k * Cfg::kStageBytes);
    th.copy_commit();
  }
  for (int slot = tid; slot < Cfg::kKSteps * 32; slot += kTcThreads) {
    store_query_fragments<Cfg>(p, seq, first_head, heads, q_mul, query, slot);
  }
  th.sync();  // every warp reads every lane's fragments
  int read = 0, write = stages - 1;
  for (int k = 0; k < mine; ++k) {
    // The stage written now was read in the previous iteration, whose values are already in registers.
    if (k + stages - 1 < mine) a.issue(t0 + warp + (k + stages - 1) * kTcWarps, pipe + write * Cfg::kStageBytes);
    th.copy_commit();
    th.copy_wait(stages - 1);
    const int tile = t0 + warp + k * kTcWarps;
    a.compute(tile, pipe + read * Cfg::kStageBytes, k + 1 < mine ? tile + kTcWarps : -1);
    read = read + 1 == stages ? 0 : read + 1;
    write = write + 1 == stages ? 0 : write + 1;
  }
  FP8KV_UNROLL
  for (int r = 0; r < Cfg::kRows; ++r) {
    a.l[r] += th.shfl_xor(a.l[r], 1);
    a.l[r] += th.shfl_xor(a.l[r], 2);
  }
  if (a.dynamic) {  // the outputs were over their rows' units; this lane holds heads 2t and 2t + 1 (rows of g)
    const int t = lane & 3;
    FP8KV_UNROLL
    for (int r = 0; r < Cfg::kRows; ++r) {
      const float even = th.shfl(a.unit[r], 8 * t), odd = th.shfl(a.unit[r], 8 * t + 4);
      FP8KV_UNROLL
      for (int i = 0; i < Cfg::kMTiles; ++i) {
        a.o[i][r][0] *= even;
        a.o[i][r][1] *= odd;
        a.o[i][r][2] *= even;
        a.o[i][r][3] *= odd;
      }
    }
  }
  th.copy_wait(0);
  th.sync();  // every warp is done with its pipeline, whose memory now holds the merge

  // Merge the warps: outputs [warp][head][dim], maxima and sums [warp][head].
  auto* merged = reinterpret_cast<float*>(pipes);
  float* warp_max = merged + kTcWarps * kHeads * kD;
  float* warp_sum = warp_max + kTcWarps * kHeads;
  const int g = lane >> 2, t = lane & 3;
  FP8KV_UNROLL
  for (int i = 0; i < Cfg::kMTiles; ++i) {
    FP8KV_UNROLL
    for (int r = 0; r < Cfg::kRows; ++r) {
      FP8KV_UNROLL
      for (int k = 0; k < 4; ++k) {
        const int dim = 16 * i + g + 8 * (k >> 1), head = 8 * r + 2 * t + (k & 1);
        merged[(warp * kHeads + head) * kD + dim] = a.o[i][r][k];
      }
    }
  }
  if (t == 0) {
    FP8KV_UNROLL
    for (int r = 0; r < Cfg::kRows; ++r) {
      warp_max[warp * kHeads + g + 8 * r] = a.m[r];
      warp_sum[warp * kHeads + g + 8 * r] = a.l[r];
    }
  }
  th.sync();

  const float v_scale = Src::v_scale(p, kv_head) * Cfg::kRescale;
  for (int i = tid; i < heads * head_size; i += kTcThreads) {
    const int h = i / head_size, d = i % head_size;
    float block_max = -INFINITY;
    for (int w = 0; w < kTcWarps; ++w) block_max = fmaxf(block_max, warp_max[w * kHeads + h]);
    const float max_safe = block_max == -INFINITY ? 0.0f : block_max;
    float block_sum = 0.0f, value = 0.0f;
    for (int w = 0; w < kTcWarps; ++w) {
      const float weight = exp2f(warp_max[w * kHeads + h] - max_safe);
      block_sum += weight * warp_sum[w * kHeads + h];
      value += weight * merged[(w * kHeads + h) * kD + d];
    }
    value *= v_scale;
    if (direct) {
      store_model_value(p.out, (row0 + h) * head_size + d, p.out_dtype, block_sum != 0.0f ? value / block_sum : 0.0f);
    } else {
      p.partial_out[((row0 + h) * total_splits + split) * head_size + d] = value;
      if (d == 0) {  // the splits' merge works in natural-log units, as the CUDA-core kernels write them
        constexpr float kLn2 = 0.6931471805599453f;
        p.partial_max[(row0 + h) * total_splits + split] = block_max * kLn2;
        p.partial_sum[(row0 + h) * total_splits + split] = block_sum;
      }
    }
  }
}

// fn(TcConfig<...>{}) for a call's head size, GQA group and query dtype (float32 queries: split halves).
template <typename cache_t, Fp8Format kFormat, class Fn>
void with_tc_config(int head_size, int group, bool precise, const Fn& fn) {
  const auto by_heads = [&](auto dims, auto split) {
    constexpr int kD = decltype(dims)::value;
    constexpr bool kSplit = decltype(split)::value;
    if constexpr (kD <= 128) {
      if (tc_heads(group, head_size) == 16) return fn(TcConfig<cache_t, kFormat, kD, 16, kSplit>{});
    }
    // tc_plan sends neither 16-bit caches nor float32 queries at 256 dims here (shared memory, registers).
    if constexpr (kD <= 128 || (std::is_same_v<cache_t, uint8_t> && !kSplit)) {
      fn(TcConfig<cache_t, kFormat, kD, 8, kSplit>{});
    }
  };
  const auto by_dims = [&](auto split) {
    if (head_size <= 64) by_heads(std::integral_constant<int, 64>{}, split);
    else if (head_size <= 128) by_heads(std::integral_constant<int, 128>{}, split);
    else by_heads(std::integral_constant<int, 256>{}, split);
  };
  // 16-bit caches have queries of their own dtype; only FP8 caches meet float32 queries.
  if constexpr (std::is_same_v<cache_t, uint8_t>) {
    if (precise) return by_dims(std::true_type{});
  }
  by_dims(std::false_type{});
}

#if !defined(FP8KV_PLATFORM_HOST)
// The blocks an SM tc_plan counts on from the registers (tc_register_blocks) as the occupancy floor: it caps
// registers where they would limit occupancy, and without a floor ptxas once spilled the 64-dim kernel at 96
// registers.
template <class Cfg>
__global__ void __launch_bounds__(kTcThreads, tc_register_blocks(Cfg::kDims, Cfg::kSlots, Cfg::kSplitHalves))
    tc_attention_kernel(const AttentionParams params) {
  extern __shared__ __align__(16) uint8_t tc_smem[];
  tc_attention_body<Cfg>(params, tc_smem, GpuThread{});
}
#endif

}  // namespace fp8kv::gpu
