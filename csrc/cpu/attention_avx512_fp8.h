// The AVX-512 partition kernel over FP8 caches (qk_fp8 / pv_fp8): two VBMI byte-table lookups give each
// code's float bits exactly (NaN, inf and subnormals included), byte/word unpacks spread them into floats
// with 4-lane partial sums, and reduce4 finishes four runs at once. Q.K runs 4-token quads through all head
// dims, P.V 4-row quads through all tiles, with a few accumulators per head and quad so nothing spills;
// operands sit at constant offsets from one pointer. With a bfloat16 query and AVX512-BF16, the decoded
// bfloat16 words go straight into dot-product instructions (Bf16Dot): half the multiply instructions and
// operand loads of the float path, and no widening; four quads then share each operand load. The next
// head's K goes to L2 during Q.K and its V during P.V (SlabPrefetcher), so memory is busy in both passes.
#pragma once

#include "cpu/attention_avx512_common.h"

namespace fp8kv::cpu::avx512 {

// ---- FP8 caches: a layout that suits the table decode -------------------------------------------
// decode_lanes turns 64 codes (four runs of 16) into z[0..3] with z[j] lane group k (128-bit lane k) =
// codes 16k + 4j .. 16k + 4j + 3: byte and word unpacks only, no cross-lane shuffles. A run is one
// token's 16 head dims (K) or one row's 16 tokens (V), so each accumulator holds four runs as four
// 4-lane partial sums, and reduce4 finishes four accumulators with six in-lane shuffles.
//
// Every FP8 value of the three formats is a bfloat16, i.e. a float whose low 16 bits are zero, so two
// 128-entry byte tables (AVX512-VBMI vpermi2b) give a float's two high bytes for the 7 magnitude bits
// and the sign bit is copied: NaN, infinities and subnormals come out exactly, with no rescaling.
template <Fp8Format F>
struct Fp8Tables {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];

  Fp8Tables() {
    for (int c = 0; c < 128; ++c) {
      const uint32_t bits = float_to_bits(fp8_to_float<F>(static_cast<uint8_t>(c)));
      hi[c] = static_cast<uint8_t>(bits >> 24);
      lo[c] = static_cast<uint8_t>(bits >> 16);
    }
  }

  static const Fp8Tables& get() {
    static const Fp8Tables tables;
    return tables;
  }
};

template <KVFormat kFormat>
struct Fp8Lanes {
  static constexpr Fp8Format F = fp8_format_of(kFormat);
  __m512i hi0, hi1, lo0, lo1;

  Fp8Lanes() {
    const Fp8Tables<F>& t = Fp8Tables<F>::get();
    hi0 = _mm512_load_si512(t.hi);
    hi1 = _mm512_load_si512(t.hi + 64);
    lo0 = _mm512_load_si512(t.lo);
    lo1 = _mm512_load_si512(t.lo + 64);
  }

  // 64 codes as bfloat16 words: w0 lane group k = codes 16k .. 16k + 7, w1 = codes 16k + 8 .. 16k + 15.
  FP8KV_INLINE void decode_words(__m512i codes, __m512i& w0, __m512i& w1) const {
    __m512i hi = _mm512_permutex2var_epi8(hi0, codes, hi1);
    __m512i lo = _mm512_permutex2var_epi8(lo0, codes, lo1);
    hi = _mm512_ternarylogic_epi32(hi, codes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // | sign
    if constexpr (F == Fp8Format::E4M3FNUZ) {  // 0x80 is NaN, not -0
      const __mmask64 nan = _mm512_cmpeq_epi8_mask(codes, _mm512_set1_epi8(static_cast<char>(0x80)));
      hi = _mm512_mask_mov_epi8(hi, nan, _mm512_set1_epi8(0x7F));
      lo = _mm512_mask_mov_epi8(lo, nan, _mm512_set1_epi8(static_cast<char>(0xC0)));
    }
    w0 = _mm512_unpacklo_epi8(lo, hi);
    w1 = _mm512_unpackhi_epi8(lo, hi);
  }

  FP8KV_INLINE void decode_lanes(__m512i codes, __m512* z) const {
    __m512i w0, w1;
    decode_words(codes, w0, w1);
    const __m512i zero = _mm512_setzero_si512();
    z[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, w0));
    z[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, w0));
    z[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, w1));
    z[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, w1));
  }
};

// Lane group k, element e of the result = sum of a[e]'s lane group k.
FP8KV_INLINE __m512 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_ps(c, d, 0x44), _mm512_shuffle_ps(c, d, 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x88), _mm512_shuffle_ps(ab, cd, 0xDD));
}

// reduce4 of accumulators for runs 4e + k (e = accumulator, k = lane group) back into run order.
FP8KV_INLINE __m512 runs_in_order(__m512 r) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// dst[j] = src[4j .. 4j+3] repeated in all four lane groups, j < n: the operand of z[j].
FP8KV_INLINE void lanes4(const float* src, float* dst, int n) {
  for (int j = 0; j < n; ++j) _mm512_store_ps(dst + 16 * j, _mm512_broadcast_f32x4(_mm_loadu_ps(src + 4 * j)));
}

// Walks the slabs of KV heads [kv_head + from, kv_head + from + heads) of the partition's blocks in
// one FP8 cache (K or V), a few cache lines per call, prefetching them into L2: blocks are scattered,
// so the hardware prefetchers cannot guess them, and the heads of one block are contiguous. Called
// with `heads` lines per line the kernel itself reads, it finishes with the pass that drives it.
struct SlabPrefetcher {
  const uint8_t* cache;
  const int32_t* table;
  int64_t block_bytes;
  int block, last_block;
  int run_bytes, skip_bytes;
  int heads;
  const char* next = nullptr;     // the next line to prefetch; nullptr when done (or idle)
  const char* run_end = nullptr;  // end of the current block's run of slabs

  SlabPrefetcher(const PartitionWork& w, const View<uint8_t>& view, bool values, int from, int n_heads)
      : cache(values ? view.vcache : view.kcache), table(view.table), block_bytes(view.block_elems),
        block(w.start / w.block_size - 1), last_block(n_heads > 0 ? (w.end - 1) / w.block_size : -1),
        run_bytes(n_heads * view.block_elems_head), skip_bytes(from * view.block_elems_head),
        heads(std::max(0, n_heads)) {
    next_block();
  }

  // The common call stays inside one block's run: a compare, the prefetches and a pointer bump (the
  // block-walking version of this, called as often, cost about a tenth of the FP8 kernel's time).
  FP8KV_INLINE void lines(int n) {
    if (next == nullptr) return;
    if (next + 64 * n < run_end) {
      for (int i = 0; i < n; ++i) _mm_prefetch(next + 64 * i, _MM_HINT_T1);
      next += 64 * n;
      return;
    }
    lines_across(n);
  }

 private:
  void next_block() {
    ++block;
    next = block <= last_block ? reinterpret_cast<const char*>(cache + table[block] * block_bytes) + skip_bytes
                               : nullptr;
    run_end = next != nullptr ? next + run_bytes : nullptr;
  }

  // Lines that reach the end of the current block's run: finish it, then go on in the next blocks. Kept out
  // of line: inlined into the Q.K and P.V loops (gcc 12 did), its loop cost the FP8 kernel 10-15% of its time.
  // Hidden: called directly, not through the library's PLT (1% of the kernel's time at head size 64).
  __attribute__((noinline, visibility("hidden"))) void lines_across(int n) {
    while (n > 0 && next != nullptr) {
      const int m = static_cast<int>(std::min<int64_t>(n, (run_end - next) >> 6));
      for (int i = 0; i < m; ++i) _mm_prefetch(next + 64 * i, _MM_HINT_T1);
      n -= m;
      next += 64 * m;
      if (next >= run_end) next_block();
    }
  }
};

// How 64 decoded codes meet their operands (16 values of q or of the probabilities, per head):
// FloatDot: four float vectors z[j] (lane group k = codes 16k + 4j .. + 3), float FMAs; any query.
// Bf16Dot: two vectors of bfloat16 pairs (lane group k = codes 16k + 8j .. + 7) and AVX512-BF16 dot
//   products, which do twice the multiply-adds per instruction. Only for bfloat16 queries: their values
//   and the FP8 values are bfloat16, so each product is exact in float32 and Q.K loses nothing; the
//   probabilities are rounded to bfloat16 for P.V, as vLLM's GPU kernels round them to the model dtype.
// Operand layout: kParts vectors of 16 floats' width, part j is the operand of z[j].
// kQuads: 64-code vectors (quads) decoded per step, each operand load feeding that many products.
template <KVFormat kFormat>
struct FloatDot {
  static constexpr int kParts = 4;
  static constexpr int kQuads = 1;  // its four parts per quad already fill the registers (two measured slower)
  using Part = __m512;
  static FP8KV_INLINE void decode(const Fp8Lanes<kFormat>& c, __m512i codes, Part* z) { c.decode_lanes(codes, z); }
  static FP8KV_INLINE __m512 madd(Part z, const float* operand, __m512 acc) {
    return _mm512_fmadd_ps(z, _mm512_load_ps(operand), acc);
  }
  static FP8KV_INLINE void operands(const float* src, float* dst) { lanes4(src, dst, 4); }
  static FP8KV_INLINE void operands(__m512 v, float* dst) {  // lanes4 of a register
    _mm512_store_ps(dst, _mm512_shuffle_f32x4(v, v, 0x00));
    _mm512_store_ps(dst + 16, _mm512_shuffle_f32x4(v, v, 0x55));
    _mm512_store_ps(dst + 32, _mm512_shuffle_f32x4(v, v, 0xAA));
    _mm512_store_ps(dst + 48, _mm512_shuffle_f32x4(v, v, 0xFF));
  }
  // Zeroes the codes of tokens >= valid in z[j] of a V tile (lane (k, e) holds token 4j + e).
  static FP8KV_INLINE Part keep_tokens(Part z, int j, int valid) {
    const int n = std::clamp(valid - 4 * j, 0, 4);
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(0x1111u * ((1u << n) - 1u)), z);
  }
};

#if defined(__AVX512BF16__)
template <KVFormat kFormat>
struct Bf16Dot {
  static constexpr int kParts = 2;
  static constexpr int kQuads = 4;
  using Part = __m512i;
  static FP8KV_INLINE void decode(const Fp8Lanes<kFormat>& c, __m512i codes, Part* z) {
    c.decode_words(codes, z[0], z[1]);
  }
  static FP8KV_INLINE __m512 madd(Part z, const float* operand, __m512 acc) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(z), reinterpret_cast<__m512bh>(_mm512_load_si512(operand)));
  }
  static FP8KV_INLINE void operands(const float* src, float* dst) { operands(_mm512_loadu_ps(src), dst); }
  static FP8KV_INLINE void operands(__m512 v, float* dst) {
    const __m256i words = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));  // round to nearest even
    _mm512_store_si512(dst, _mm512_broadcast_i32x4(_mm256_castsi256_si128(words)));
    _mm512_store_si512(dst + 16, _mm512_broadcast_i32x4(_mm256_extracti128_si256(words, 1)));
  }
  static FP8KV_INLINE Part keep_tokens(Part z, int j, int valid) {  // lane group k words e: token 8j + e
    const int n = std::clamp(valid - 8 * j, 0, 8);
    return _mm512_maskz_mov_epi16(static_cast<__mmask32>(0x01010101u * ((1u << n) - 1u)), z);
  }
};
#else
template <KVFormat kFormat>
using Bf16Dot = FloatDot<kFormat>;
#endif

// Accumulators per head and quad in the FP8 kernels (sets): enough independent chains to hide the FMA /
// dot-product latency (on Zen 5: 6 cycles, 2 a cycle, so 12 chains) without spilling. FloatDot: two
// consecutive steps (groups or tiles) feed their z vectors into four sets, for one head. Bf16Dot (four quads
// a step): one set from three heads up (4 quads x 3 heads = 12 chains), two below.
template <typename Dot, int kG>
constexpr int fp8_sets() {
  if constexpr (Dot::kQuads == 1) return 4;
  else return kG >= 3 ? 1 : 2;
}

// The sum of kSets (1, 2 or 4) accumulators, pairwise.
template <int kSets>
FP8KV_INLINE __m512 sum_sets(const __m512* a) {
  static_assert(kSets == 1 || kSets == 2 || kSets == 4);
  if constexpr (kSets == 1) return a[0];
  else if constexpr (kSets == 2) return _mm512_add_ps(a[0], a[1]);
  else return _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
}

// The accumulator of part j of a step of this parity, among kSets.
template <typename Dot, int kSets>
constexpr int fp8_set(int parity, int j) {
  return (parity * Dot::kParts + j) % kSets;
}

// The accumulators of one pass of qk_fp8 or pv_fp8: Dot::kQuads quads x kG heads x kSets.
template <typename Dot, int kG>
struct QuadAccumulators {
  static constexpr int kQuads = Dot::kQuads, kSets = fp8_sets<Dot, kG>();
  static constexpr int kOps = Dot::kParts * 16;  // floats of one head's operands per step
  __m512 acc[kQuads][kG][kSets];

  QuadAccumulators() {
    for (int u = 0; u < kQuads; ++u) {
      for (int h = 0; h < kG; ++h) {
        for (int s = 0; s < kSets; ++s) acc[u][h][s] = _mm512_setzero_ps();
      }
    }
  }

  // Quad u's accumulators of head h += its z . the head's operands (at ops + h * kOps); a step of the other
  // parity feeds the other sets.
  template <int kParity>
  FP8KV_INLINE void add(const typename Dot::Part (&z)[kQuads][Dot::kParts], const float* ops) {
#pragma GCC unroll 4
    for (int h = 0; h < kG; ++h) {
#pragma GCC unroll 4
      for (int j = 0; j < Dot::kParts; ++j) {
        const int set = fp8_set<Dot, kSets>(kParity, j);
        const float* operand = ops + h * kOps + 16 * j;
        for (int u = 0; u < kQuads; ++u) acc[u][h][set] = Dot::madd(z[u][j], operand, acc[u][h][set]);
      }
    }
  }

  FP8KV_INLINE __m512 sum(int u, int h) const { return sum_sets<kSets>(acc[u][h]); }
};

// qb: [head_size / 16][kG][kParts][16]: the operands of group g for head h (Dot::operands of
// q[h][16g .. 16g + 15]), at constant offsets from group g's row. Logits are the sums times qk_scale.
// Dot::kQuads quads (4 tokens each) run through all their head dims together, each with kG * kSets
// accumulators, few enough to stay in registers; four quads' sums then finish together in reduce4.
// kDynamic: dynamic scales (w.k_scales and w.v_scales set); a template parameter, so the static kernel is compiled
// as if they did not exist. Never inlined: inlined into run_fp8_partition (gcc 12 did, once the static kernel
// lost its scale code) it ran 6% slower at head size 64.
template <typename Dot, KVFormat kFormat, int kG, bool kDynamic>
__attribute__((noinline)) void qk_fp8(const PartitionWork& w, const View<uint8_t>& view, const float* qb, const float* alibi,
            float* logits, int logit_stride, SlabPrefetcher k_ahead, SlabPrefetcher v_ahead, NextScales& next_scales) {
  const Fp8Lanes<kFormat> codec;
  constexpr int kAhead = 32;  // tokens between a K prefetch and its use
  constexpr int kOps = Dot::kParts * 16;  // floats of one head's operands per group
  // Bf16Dot: a whole tile (four quads) a pass, so each operand load feeds four products and the chains
  // restart once a tile, not once per two quads: on Zen 5, one core, L2-resident, 512 tokens, d128, 4 heads,
  // 2.33 us over two quads at a time, 1.56 us over four.
  constexpr int kQuads = Dot::kQuads;
  const int D = w.head_size, bs = w.block_size, groups = D / 16;
  const int bs_shift = __builtin_ctz(bs);
  const int64_t group_stride = 16 * static_cast<int64_t>(bs);
  auto token_ptr = [&](int t) { return view.k_block(t >> bs_shift) + (t & (bs - 1)) * 16; };
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 qk_scale = _mm512_set1_ps(w.qk_scale);
  const TileScales scales(w);
  const int tile_blocks = bs < 16 ? 16 / bs : 1;  // the next pass's scale lines: a tile's worth of blocks per tile
  alignas(64) float quad_sums[kG][4][16] = {};  // [head][quad of the tile]: 4-lane partial sums
  for (int ts = w.start; ts < w.end; ts += 16) {
    if constexpr (kDynamic) next_scales.fetch(tile_blocks);
    for (int qi = 0; qi < 4 && ts + 4 * qi < w.end; qi += kQuads) {
      const int t = ts + 4 * qi;
      const uint8_t* p[kQuads];
      for (int u = 0; u < kQuads; ++u) p[u] = t + 4 * u < w.end ? token_ptr(t + 4 * u) : token_ptr(t);
      const uint8_t* ahead = t + kAhead < w.end ? token_ptr(t + kAhead) : p[0];
      QuadAccumulators<Dot, kG> acc;
      const float* qg = qb;
      auto step = [&](auto parity) {  // one group of 16 head dims
        for (int u = 0; u < kQuads; ++u) _mm_prefetch(reinterpret_cast<const char*>(ahead) + 64 * u, _MM_HINT_T0);
        typename Dot::Part z[kQuads][Dot::kParts];
        for (int u = 0; u < kQuads; ++u) Dot::decode(codec, _mm512_loadu_si512(p[u]), z[u]);
        acc.template add<decltype(parity)::value>(z, qg);
        for (int u = 0; u < kQuads; ++u) p[u] += group_stride;
        ahead += group_stride;
        qg += kG * kOps;
      };
      int g = 0;
      for (; g + 2 <= groups; g += 2) {
        step(std::integral_constant<int, 0>{});
        step(std::integral_constant<int, 1>{});
        k_ahead.lines(2 * kQuads * k_ahead.heads);  // as many lines per head as these steps read
        v_ahead.lines(2 * kQuads * v_ahead.heads);
      }
      if (g < groups) {
        step(std::integral_constant<int, 0>{});
        k_ahead.lines(kQuads * k_ahead.heads);
        v_ahead.lines(kQuads * v_ahead.heads);
      }
      for (int u = 0; u < kQuads; ++u) {  // a quad past the end (it re-read the first) is never stored below
        for (int h = 0; h < kG; ++h) _mm512_store_ps(quad_sums[h][qi + u], acc.sum(u, h));
      }
    }
    const int n = std::min(16, w.end - ts);
    // Dynamic scales: each token's key scale joins the softmax scale, before ALiBi
    __m512 tile_scale = qk_scale;
    if constexpr (kDynamic) tile_scale = _mm512_mul_ps(qk_scale, scales.load(w.k_scales, ts));
    for (int h = 0; h < kG; ++h) {
      const __m512* a = reinterpret_cast<const __m512*>(quad_sums[h]);
      __m512 out = _mm512_mul_ps(runs_in_order(reduce4(a[0], a[1], a[2], a[3])), tile_scale);  // tokens ts + 0..15
      if (alibi) {
        const __m512 pos = _mm512_add_ps(lane, _mm512_set1_ps(static_cast<float>(ts - w.last_pos)));
        out = _mm512_fmadd_ps(_mm512_set1_ps(alibi[h]), pos, out);
      }
      _mm512_mask_storeu_ps(logits + h * logit_stride + (ts - w.start), first_lanes(n), out);
    }
  }
}

// out[h][d] = norm[h] * sum over the partition of probs[h][t] * V[t][d]. Tiles of 16 tokens gathered
// into 64 bytes = rows r..r+3 x 16 tokens; Dot::kQuads such row quads run through all tiles together, each
// with kG * kSets accumulators, and four row quads (16 rows) finish together in reduce4. With Bf16Dot all four
// go at once, so each probability operand is loaded once per four products (one row quad a pass: 2.06 us
// on the Q.K note's case, four: 1.30 us).
template <typename Dot, KVFormat kFormat, int kG, int kBs, bool kDynamic>
void pv_fp8(const PartitionWork& w, const View<uint8_t>& view, const float* probs, int prob_stride,
            const float* norm, float* out, float* prob_ops, SlabPrefetcher v_ahead) {
  const Fp8Lanes<kFormat> codec;
  constexpr int kOps = Dot::kParts * 16;  // floats of one head's operands per tile
  const int D = w.head_size, P = w.end - w.start;
  const int tiles = (P + 15) / 16;
  const int tail = P - 16 * (tiles - 1);
  const int full_tiles = tail < 16 ? tiles - 1 : tiles;
  const uint8_t* pa[kPartitionSize / 16];  // the tile's block (block size 8: its first block)
  const uint8_t* pb[kPartitionSize / 16];  // block size 8: the tile's second block
  for (int i = 0; i < tiles; ++i) {
    const int t = w.start + 16 * i;
    pa[i] = view.v_block(t / kBs);
    pb[i] = (kBs == 8 && t + 8 < w.end) ? view.v_block((t + 8) / kBs) : pa[i];
  }
  // 64 codes: rows r..r+3 x the tile's 16 tokens
  auto gather = [&](int i, int r) -> __m512i {
    if constexpr (kBs == 16) {
      return _mm512_loadu_si512(pa[i] + r * 16);
    } else if constexpr (kBs == 32) {  // rows are 32 tokens: take the tile's half of four rows
      const uint8_t* rows = pa[i] + r * 32;
      const __m512i idx = (w.start / 16 + i) % 2 ? _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15)
                                                 : _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13);
      return _mm512_permutex2var_epi64(_mm512_loadu_si512(rows), idx, _mm512_loadu_si512(rows + 64));
    } else {  // two blocks of 8 tokens: interleave their 8-byte row pieces
      const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(load256(pa[i] + r * 8)), load256(pb[i] + r * 8), 1);
      return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), ab);
    }
  };
  if constexpr (kDynamic) {  // dynamic scales: each token's probability times its value scale (zeros past the end stay 0)
    const TileScales scales(w);
    for (int i = 0; i < tiles; ++i) {
      const __m512 s = _mm512_maskz_mov_ps(first_lanes(P - 16 * i), scales.load(w.v_scales, w.start + 16 * i));
      for (int h = 0; h < kG; ++h) {
        Dot::operands(_mm512_mul_ps(_mm512_loadu_ps(probs + h * prob_stride + 16 * i), s),
                      prob_ops + (i * kG + h) * kOps);
      }
    }
  } else {
    for (int i = 0; i < tiles; ++i) {  // [tile][kG][kOps]: each tile's probs as operands
      for (int h = 0; h < kG; ++h) Dot::operands(probs + h * prob_stride + 16 * i, prob_ops + (i * kG + h) * kOps);
    }
  }
  alignas(64) float row_sums[kG][4][16];  // [head][row quad]: 4-lane partial sums
  constexpr int kQuads = Dot::kQuads;
  for (int d0 = 0; d0 < D; d0 += 16) {
    for (int rq0 = 0; rq0 < 4; rq0 += kQuads) {
      QuadAccumulators<Dot, kG> acc;
      auto tile = [&](auto parity, int i) {
        typename Dot::Part z[kQuads][Dot::kParts];
        for (int u = 0; u < kQuads; ++u) Dot::decode(codec, gather(i, d0 + 4 * (rq0 + u)), z[u]);
        acc.template add<decltype(parity)::value>(z, prob_ops + i * kG * kOps);
      };
      int i = 0;
      for (; i + 4 <= full_tiles; i += 4) {
        tile(std::integral_constant<int, 0>{}, i);
        tile(std::integral_constant<int, 1>{}, i + 1);
        tile(std::integral_constant<int, 0>{}, i + 2);
        tile(std::integral_constant<int, 1>{}, i + 3);
        v_ahead.lines(4 * kQuads * v_ahead.heads);  // as many lines per head as these tiles read
      }
      for (; i < full_tiles; ++i) tile(std::integral_constant<int, 0>{}, i);
      v_ahead.lines((tiles - full_tiles / 4 * 4) * kQuads * v_ahead.heads);
      if (full_tiles < tiles) {  // stale slots past the sequence may hold anything, even NaN: zero them
        typename Dot::Part z[kQuads][Dot::kParts];
        for (int u = 0; u < kQuads; ++u) {
          Dot::decode(codec, gather(full_tiles, d0 + 4 * (rq0 + u)), z[u]);
          for (int j = 0; j < Dot::kParts; ++j) z[u][j] = Dot::keep_tokens(z[u][j], j, tail);
        }
        acc.template add<1>(z, prob_ops + full_tiles * kG * kOps);
      }
      for (int u = 0; u < kQuads; ++u) {
        for (int h = 0; h < kG; ++h) _mm512_store_ps(row_sums[h][rq0 + u], acc.sum(u, h));
      }
    }
    for (int h = 0; h < kG; ++h) {
      const __m512* a = reinterpret_cast<const __m512*>(row_sums[h]);
      const __m512 rows = runs_in_order(reduce4(a[0], a[1], a[2], a[3]));
      _mm512_storeu_ps(out + h * D + d0, _mm512_mul_ps(rows, _mm512_set1_ps(norm[h])));
    }
  }
}

}  // namespace fp8kv::cpu::avx512
