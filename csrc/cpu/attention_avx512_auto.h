// The AVX-512 partition kernel over "auto" caches (the model's float32 / bfloat16 / float16): natural-order
// widening, 16 accumulators of (head, token) or (head, row) pairs, summed by one transpose-and-add tree
// (reduce16). V is prefetched into L2 while Q.K runs (L2Prefetcher), K into L1 a few tiles ahead (blocks are
// scattered, so the hardware prefetchers cannot guess them).
#pragma once

#include <type_traits>

#include "cpu/attention_avx512_common.h"

namespace fp8kv::cpu::avx512 {

// Decoding of 32 elements of an "auto" (float32 / bfloat16 / float16) cache into two vectors of 16
// floats, in the cache's two layouts:
//   k_pair: 16 head dims of tokens t and t+1, starting at token t's first element of a 16-dim group
//           (x-sized pieces chunk_stride apart when x < 16);
//   v_rows: rows d and d+1 of a 16-token tile (block size kBs; for kBs = 8 the tile's second half is
//           the next block, pb).
template <typename cache_t, KVFormat kFormat>
struct Codec;

template <typename half_t>
struct Codec16 {  // bfloat16 / float16 caches (x = 8)
  static FP8KV_INLINE __m512 widen(__m256i w) {
    if constexpr (std::is_same_v<half_t, c10::BFloat16>) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
    } else {
      return _mm512_cvtph_ps(w);
    }
  }

  FP8KV_INLINE void k_pair(const half_t* p, int64_t chunk_stride, __m512& z0, __m512& z1) const {
    z0 = widen(join128(load128(p), load128(p + chunk_stride)));
    z1 = widen(join128(load128(p + 8), load128(p + 8 + chunk_stride)));
  }

  FP8KV_INLINE void k_quad(const half_t* p, int64_t chunk_stride, __m512* z) const {
    k_pair(p, chunk_stride, z[0], z[1]);
    k_pair(p + 16, chunk_stride, z[2], z[3]);
  }

  FP8KV_INLINE void v_64(const half_t* p, __m512* z) const {
    for (int j = 0; j < 4; ++j) z[j] = widen(load256(p + 16 * j));
  }

  template <int kBs>
  FP8KV_INLINE void v_rows(const half_t* pa, const half_t* pb, __m512& z0, __m512& z1) const {
    if constexpr (kBs == 8) {
      z0 = widen(join128(load128(pa), load128(pb)));
      z1 = widen(join128(load128(pa + 8), load128(pb + 8)));
    } else {
      z0 = widen(load256(pa));
      z1 = widen(load256(pa + kBs));
    }
  }
};

template <>
struct Codec<c10::BFloat16, KVFormat::AUTO> : Codec16<c10::BFloat16> {};
template <>
struct Codec<c10::Half, KVFormat::AUTO> : Codec16<c10::Half> {};

template <>
struct Codec<float, KVFormat::AUTO> {  // x = 4
  static FP8KV_INLINE __m512 gather4(const float* p, int64_t stride) {
    __m512 z = _mm512_castps128_ps512(_mm_loadu_ps(p));
    z = _mm512_insertf32x4(z, _mm_loadu_ps(p + stride), 1);
    z = _mm512_insertf32x4(z, _mm_loadu_ps(p + 2 * stride), 2);
    return _mm512_insertf32x4(z, _mm_loadu_ps(p + 3 * stride), 3);
  }

  FP8KV_INLINE void k_pair(const float* p, int64_t chunk_stride, __m512& z0, __m512& z1) const {
    z0 = gather4(p, chunk_stride);
    z1 = gather4(p + 4, chunk_stride);
  }

  FP8KV_INLINE void k_quad(const float* p, int64_t chunk_stride, __m512* z) const {
    k_pair(p, chunk_stride, z[0], z[1]);
    k_pair(p + 8, chunk_stride, z[2], z[3]);
  }

  FP8KV_INLINE void v_64(const float* p, __m512* z) const {
    for (int j = 0; j < 4; ++j) z[j] = _mm512_loadu_ps(p + 16 * j);
  }

  template <int kBs>
  FP8KV_INLINE void v_rows(const float* pa, const float* pb, __m512& z0, __m512& z1) const {
    if constexpr (kBs == 8) {
      z0 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(pa)), _mm256_loadu_ps(pb), 1);
      z1 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(pa + 8)), _mm256_loadu_ps(pb + 8), 1);
    } else {
      z0 = _mm512_loadu_ps(pa);
      z1 = _mm512_loadu_ps(pa + kBs);
    }
  }
};

// Sums of 16 vectors, one per lane. Lane L is the sum of acc[kSlot[L]] (a transpose-and-add tree).
constexpr int kSlot[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

FP8KV_INLINE __m512 reduce16(const __m512* a) {
  __m512 s[8], u[4], v[2];
  for (int i = 0; i < 8; ++i) {
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[i], s[i + 4], 0x88), _mm512_shuffle_f32x4(s[i], s[i + 4], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(u[i], u[i + 2], 0x44), _mm512_shuffle_ps(u[i], u[i + 2], 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
}


// Walks the K and V slabs of KV heads [kv_head + from, kv_head + from + heads) of the partition's
// blocks, one cache line per call, to prefetch them into L2 while Q.K runs: blocks are scattered, so
// the hardware prefetchers cannot guess them, and the heads of one block are contiguous.
template <typename cache_t>
struct L2Prefetcher {
  const View<cache_t>& view;
  int block, last_block;
  int offset = 0;  // bytes into the current block's run of slabs; K lines on even calls, V on odd
  int run_bytes;
  bool v_turn = false;

  int skip_bytes;

  L2Prefetcher(const View<cache_t>& v, int first, int last, int from, int heads)
      : view(v), block(heads > 0 ? first : last + 1), last_block(last),
        run_bytes(heads * v.block_elems_head * static_cast<int>(sizeof(cache_t))),
        skip_bytes(from * v.block_elems_head * static_cast<int>(sizeof(cache_t))) {}

  FP8KV_INLINE void step() {
    if (block > last_block) return;
    const cache_t* base = v_turn ? view.v_block(block) : view.k_block(block);
    _mm_prefetch(reinterpret_cast<const char*>(base) + skip_bytes + offset, _MM_HINT_T1);
    if (v_turn && (offset += 64) >= run_bytes) {
      offset = 0;
      ++block;
    }
    v_turn = !v_turn;
  }
};

// Logits of kG query heads (q pre-scaled) for the partition's tokens, in tiles of kT tokens.
template <typename cache_t, KVFormat kFormat, int kG>
void qk_heads(const PartitionWork& w, const View<cache_t>& view, const float* q, const float* alibi,
              float* logits, int logit_stride, int prefetch_from, int prefetch_heads) {
  const Codec<cache_t, kFormat> codec{};
  constexpr int kT = kG == 1 ? 16 : kG == 2 ? 8 : kG <= 4 ? 4 : 2;
  constexpr int kStep = kT >= 4 ? 4 : 2;  // tokens decoded together
  static_assert(kT * kG <= 16, "16 accumulators at most");
  constexpr int x = 16 / sizeof(cache_t);
  constexpr int kAhead = 32;  // tokens between a K prefetch and its use
  constexpr int kLinesPerGroup = std::max<int>(1, kT * sizeof(cache_t) / 2);  // K+V of one head per K group
  const int D = w.head_size, bs = w.block_size;
  const int bs_shift = __builtin_ctz(bs);  // block sizes are powers of two
  const int64_t chunk_stride = static_cast<int64_t>(bs) * x, group_stride = 16 * static_cast<int64_t>(bs);
  const int last_block = (w.end - 1) >> bs_shift;
  L2Prefetcher<cache_t> l2pf(view, w.start >> bs_shift, last_block, prefetch_from, prefetch_heads);
  const int l2_lines = kLinesPerGroup * prefetch_heads;  // keeps pace with this pass over K
  auto token_ptr = [&](int t) { return view.k_block(t >> bs_shift) + (t & (bs - 1)) * x; };
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int ts = w.start; ts < w.end; ts += kT) {
    const cache_t* step_ptr[kT / kStep];
    const cache_t* ahead_ptr[kT / kStep];
    for (int i = 0; i < kT / kStep; ++i) {
      // Steps past the end re-read a valid step; tokens of one step share a block (bs % 4 == 0).
      const int t = ts + kStep * i < w.end ? ts + kStep * i : ts;
      step_ptr[i] = token_ptr(t);
      const int ta = t + kAhead;
      ahead_ptr[i] = ta < w.end ? token_ptr(ta) : step_ptr[i];
    }
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int g = 0; g < D / 16; ++g) {
#pragma GCC unroll 8
      for (int i = 0; i < kT / kStep; ++i) {
        for (int c = 0; c < 16 / x; ++c) {
          _mm_prefetch(reinterpret_cast<const char*>(ahead_ptr[i] + g * group_stride + c * chunk_stride), _MM_HINT_T0);
        }
        __m512 z[kStep];
        if constexpr (kStep == 4) {
          codec.k_quad(step_ptr[i] + g * group_stride, chunk_stride, z);
        } else {
          codec.k_pair(step_ptr[i] + g * group_stride, chunk_stride, z[0], z[1]);
        }
#pragma GCC unroll 8
        for (int h = 0; h < kG; ++h) {
          const __m512 qv = _mm512_loadu_ps(q + h * D + g * 16);
#pragma GCC unroll 4
          for (int k = 0; k < kStep; ++k) {
            const int slot = kSlot[h * kT + kStep * i + k];
            acc[slot] = _mm512_fmadd_ps(z[k], qv, acc[slot]);
          }
        }
      }
      for (int i = 0; i < l2_lines; ++i) l2pf.step();
    }
    __m512 sums = reduce16(acc);  // lane h * kT + j: head h, token ts + j
    const int n = std::min(kT, w.end - ts);
    for (int h = 0; h < kG; ++h) {
      const __mmask16 lanes = static_cast<__mmask16>(((1u << n) - 1u) << (h * kT));
      __m512 out = sums;
      if (alibi) {  // slope * (position - newest position)
        const __m512 pos = _mm512_add_ps(lane, _mm512_set1_ps(static_cast<float>(ts - h * kT - w.last_pos)));
        out = _mm512_fmadd_ps(_mm512_set1_ps(alibi[h]), pos, sums);
      }
      _mm512_mask_storeu_ps(logits + h * logit_stride + (ts - w.start) - h * kT, lanes, out);
    }
  }
}

// out[h][d] = norm[h] * sum over the partition of probs[h][t] * V[t][d].
// Tiles are 16 tokens (block size 8: two blocks; 16: one block) or 32 (block size 32: one block).
template <typename cache_t, KVFormat kFormat, int kG, int kBs>
void pv_heads(const PartitionWork& w, const View<cache_t>& view, const float* probs, int prob_stride,
              const float* norm, float* out, int skip) {
  const Codec<cache_t, kFormat> codec{};
  constexpr int kRows = kG == 1 ? 16 : kG == 2 ? 8 : kG <= 4 ? 4 : 2;
  static_assert(kRows * kG <= 16, "16 accumulators at most");
  constexpr int kTile = kBs == 32 ? 32 : 16;
  const int D = w.head_size, P = w.end - w.start;
  const int tiles = (P + kTile - 1) / kTile;
  const int tail = P - kTile * (tiles - 1);  // valid tokens of the last tile
  const __mmask16 tail_lo = first_lanes(tail), tail_hi = first_lanes(std::max(0, tail - 16));
  // The first tile's `skip` tokens before the partition's start (block-aligned tiles)
  const __mmask16 head_lo = static_cast<__mmask16>(~first_lanes(skip));
  const __mmask16 head_hi = static_cast<__mmask16>(~first_lanes(std::max(0, skip - 16)));
  const cache_t* pa[kPartitionSize / 16];
  const cache_t* pb[kPartitionSize / 16];
  for (int i = 0; i < tiles; ++i) {
    const int t = w.start + kTile * i;
    pa[i] = view.v_block(t / kBs) + t % kBs;
    pb[i] = (kBs == 8 && t + 8 < w.end) ? view.v_block((t + 8) / kBs) : pa[i];
  }
  for (int d0 = 0; d0 < D; d0 += kRows) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    auto add = [&](int row, __m512 v, const float* p, int h) {
      const int slot = kSlot[h * kRows + row];
      acc[slot] = _mm512_fmadd_ps(v, _mm512_loadu_ps(p), acc[slot]);
    };
    // Tile i; kMasked: only the lanes of keep_lo / keep_hi (tokens 0-15 / 16-31 of the tile) are read.
    auto tile = [&](auto masked, int i, __mmask16 keep_lo, [[maybe_unused]] __mmask16 keep_hi) {
      constexpr bool kMasked = decltype(masked)::value;
      const float* pt = probs + kTile * i;
      if constexpr (kBs == 32) {  // 64 codes = rows r, r+1 x 32 tokens
#pragma GCC unroll 8
        for (int j = 0; j < kRows / 2; ++j) {
          __m512 z[4];
          codec.v_64(pa[i] + (d0 + 2 * j) * kBs, z);
          if constexpr (kMasked) {
            z[0] = _mm512_maskz_mov_ps(keep_lo, z[0]);
            z[1] = _mm512_maskz_mov_ps(keep_hi, z[1]);
            z[2] = _mm512_maskz_mov_ps(keep_lo, z[2]);
            z[3] = _mm512_maskz_mov_ps(keep_hi, z[3]);
          }
#pragma GCC unroll 8
          for (int h = 0; h < kG; ++h) {
            const float* ph = pt + h * prob_stride;
            add(2 * j, z[0], ph, h);
            add(2 * j, z[1], ph + 16, h);
            add(2 * j + 1, z[2], ph, h);
            add(2 * j + 1, z[3], ph + 16, h);
          }
        }
      } else if constexpr (kBs == 16 && kRows % 4 == 0) {  // 64 codes = rows r..r+3 x 16 tokens
#pragma GCC unroll 4
        for (int j = 0; j < kRows / 4; ++j) {
          __m512 z[4];
          codec.v_64(pa[i] + (d0 + 4 * j) * kBs, z);
          if constexpr (kMasked) {
            for (int k = 0; k < 4; ++k) z[k] = _mm512_maskz_mov_ps(keep_lo, z[k]);
          }
#pragma GCC unroll 8
          for (int h = 0; h < kG; ++h) {
            for (int k = 0; k < 4; ++k) add(4 * j + k, z[k], pt + h * prob_stride, h);
          }
        }
      } else {  // two rows x 16 tokens
#pragma GCC unroll 8
        for (int j = 0; j < kRows / 2; ++j) {
          __m512 z0, z1;
          const int row = (d0 + 2 * j) * kBs;
          codec.template v_rows<kBs>(pa[i] + row, pb[i] + row, z0, z1);
          if constexpr (kMasked) {
            z0 = _mm512_maskz_mov_ps(keep_lo, z0);
            z1 = _mm512_maskz_mov_ps(keep_lo, z1);
          }
#pragma GCC unroll 8
          for (int h = 0; h < kG; ++h) {
            add(2 * j, z0, pt + h * prob_stride, h);
            add(2 * j + 1, z1, pt + h * prob_stride, h);
          }
        }
      }
    };
    // Slots past the sequence, and a ring's seats before the partition's start (not yet written in a young
    // sequence with sinks), may hold anything, even NaN: their values are zeroed, not only their weights. Only
    // the first and last tiles can have such lanes; the tiles between read all of theirs.
    const bool head = skip > 0, partial = tail < kTile;
    const int middle_end = partial ? tiles - 1 : tiles;
    if (head) {
      const bool also_tail = partial && tiles == 1;
      tile(std::true_type{}, 0, head_lo & (also_tail ? tail_lo : __mmask16(0xFFFF)),
           head_hi & (also_tail ? tail_hi : __mmask16(0xFFFF)));
    }
    for (int i = head ? 1 : 0; i < middle_end; ++i) tile(std::false_type{}, i, 0, 0);
    if (partial && !(head && tiles == 1)) tile(std::true_type{}, tiles - 1, tail_lo, tail_hi);
    alignas(64) float sums[16];
    _mm512_store_ps(sums, reduce16(acc));
    for (int h = 0; h < kG; ++h) {
      for (int j = 0; j < kRows; ++j) out[h * D + d0 + j] = sums[h * kRows + j] * norm[h];
    }
  }
}

}  // namespace fp8kv::cpu::avx512
