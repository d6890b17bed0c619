// AVX2 partition kernel, for CPUs with AVX2, F16C and FMA but not the AVX-512 path (AMD Zen 2 and 3; Intel
// Haswell to Comet Lake, and Skylake-SP to Cascade Lake, whose AVX-512 lacks VBMI), over FP8 and 16- and 32-bit
// caches alike. FP8 codes become floats through F16C (fp8_f16c.h), the format's power of two folded into the
// scales. Q.K decodes 8 tokens' K once into an L1 buffer that every query head of the KV head reads, with one
// accumulator per token; P.V runs a few rows of V through the whole partition with two accumulators per head and
// row, so each decoded V vector feeds every head and a lane sum happens once per row. At 8 x 2048 (32 / 8 heads,
// d128, 2 threads, Zen 5 built for AVX2) the portable kernel AVX2 CPUs used to run (attention_generic.h, which
// then summed lanes for every dot product) took 8.7 ms over FP8, 9.7 over bfloat16 and 12.2 over float32; this
// one 2.5, 4.0 and 6.2 ms.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu/attention_kernel.h"
#include "cpu/fp8_f16c.h"
#include "cpu/vector_exp.h"
#include "dispatch.h"

namespace fp8kv::cpu::avx2 {

// Tokens of a tile: 16 where a block row holds them contiguously, else 8 (8-token blocks). Tiles start at
// multiples of their size, so a tile never straddles blocks; a partition that starts inside a tile runs from
// the tile's start with the tokens before its own start left out of the softmax.
inline int tile_tokens(int block_size) { return block_size >= 16 ? 16 : 8; }

inline bool supports(const PartitionWork& w) {
  return w.head_size % 16 == 0 && (w.block_size == 8 || w.block_size == 16 || w.block_size == 32) &&
         w.end - w.start / 16 * 16 <= kPartitionSize;
}

FP8KV_INLINE float sum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

FP8KV_INLINE float max8(__m256 a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// Lane i = the sum of a[i]'s lanes.
FP8KV_INLINE __m256 sums8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// v with lanes [lo, hi) kept, the others zero.
FP8KV_INLINE __m256 lanes_between(__m256 v, int lo, int hi) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i keep = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(lo), lane),
                                           _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), lane));
  return _mm256_and_ps(v, _mm256_castsi256_ps(keep));
}

// Softmax numerators in place over row[0, n): the first `skip` are 0 (tokens before the partition's start),
// and the row is zero up to `padded` (a multiple of 8) on return.
inline void softmax_numerators(float* row, int n, int padded, float* max_logit, float* exp_sum, int skip) {
  for (int i = 0; i < skip; ++i) row[i] = -INFINITY;
  for (int i = n; i < padded; ++i) row[i] = -INFINITY;
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int i = 0; i < padded; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(row + i));
  const float mx = max8(m);
  const __m256 mxv = _mm256_set1_ps(mx), minus_inf = _mm256_set1_ps(-INFINITY);
  __m256 sum = _mm256_setzero_ps();
  for (int i = 0; i < padded; i += 8) {
    const __m256 x = _mm256_loadu_ps(row + i);
    const __m256 keep = _mm256_cmp_ps(x, minus_inf, _CMP_NEQ_UQ);  // NaN logits stay NaN
    const __m256 e = _mm256_and_ps(keep, exp256(_mm256_sub_ps(x, mxv)));
    _mm256_storeu_ps(row + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  *max_logit = mx;
  *exp_sum = sum8(sum);
}

// A cache's values as floats: FP8 codes divided by the format's kHalfRescale (kRescale), others as they are.
template <typename cache_t, KVFormat kFormat>
struct Values {
  static constexpr float kRescale = kFormat == KVFormat::AUTO ? 1.f : Fp8Traits<fp8_format_of(kFormat)>::kHalfRescale;

  static FP8KV_INLINE __m256 load8(const cache_t* src) {
    if constexpr (kFormat != KVFormat::AUTO) {
      return fp8x8_scaled_floats<kFormat>(src);
    } else {
      return model_dtype_x8_floats(src);
    }
  }

  static FP8KV_INLINE void load16(const cache_t* src, __m256& lo, __m256& hi) {
    if constexpr (kFormat != KVFormat::AUTO) {
      fp8x16_scaled_floats<kFormat>(src, lo, hi);
    } else {
      lo = load8(src);
      hi = load8(src + 8);
    }
  }
};

// Tokens [t0, t0 + 8) of one KV head's K (all in one block, at `k`: chunks of x = 16 bytes a token) decoded
// into kbuf[8][D], as Values gives them.
template <typename cache_t, KVFormat kFormat>
FP8KV_INLINE void decode_keys(const cache_t* k, int bs, int D, float* kbuf) {
  constexpr int x = 16 / static_cast<int>(sizeof(cache_t));
  using V = Values<cache_t, kFormat>;
  for (int c = 0; c < D / x; ++c) {
    for (int i = 0; i < 8; ++i) {
      const cache_t* src = k + (c * bs + i) * x;
      float* dst = kbuf + i * D + c * x;
      if constexpr (x == 16) {
        __m256 lo, hi;
        V::load16(src, lo, hi);
        _mm256_store_ps(dst, lo);
        _mm256_store_ps(dst + 8, hi);
      } else if constexpr (x == 8) {
        _mm256_store_ps(dst, V::load8(src));
      } else {
        _mm_store_ps(dst, _mm_loadu_ps(reinterpret_cast<const float*>(src)));
      }
    }
  }
}

// The 8 tokens' q . k from their decoded K: one accumulator per token, lanes summed at the end.
FP8KV_INLINE __m256 dots8(const float* kbuf, const float* q, int D) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(_mm256_load_ps(kbuf + i * D + d), qv, acc[i]);
  }
  return sums8(acc);
}

// out[h][d] += norm[h] * sum over tokens of probs[h][t] * V[d][t] for kG heads. Rows go kR at a time through
// all tiles (kR * kG * 2 accumulators, at most 8: with AVX2's 16 registers, the decoded V and constants must
// fit beside them); probs rows are zero past the partition and before its start, and so are the values there
// (stale slots past the sequence, a ring's seats not yet written before the start: anything, even NaN).
template <typename cache_t, KVFormat kFormat, int kG, int kTile>
void pv_heads(const PartitionWork& w, const cache_t* vcache, int64_t block_elems, int begin, const float* probs,
              int stride, const float* norm, float* out) {
  using V = Values<cache_t, kFormat>;
  constexpr int kR = kG == 1 ? 4 : kG == 2 ? 2 : 1;
  const int D = w.head_size, bs = w.block_size;
  const int tiles = (w.end - begin + kTile - 1) / kTile;
  const int tail = w.end - (begin + (tiles - 1) * kTile);  // valid tokens of the last tile
  const int skip = w.start - begin;                         // tokens of the first tile before the start
  for (int d0 = 0; d0 < D; d0 += kR) {
    __m256 acc[kG][kR][2];
    for (int h = 0; h < kG; ++h) {
      for (int r = 0; r < kR; ++r) acc[h][r][0] = acc[h][r][1] = _mm256_setzero_ps();
    }
    // Tile i into accumulator set `set` (8-token tiles alternate sets; 16-token ones use both), reading its
    // tokens [lo, hi) (constants in the loop over the middle tiles: no masking there).
    auto tile = [&](int i, int set, int lo, int hi) {
      const int t0 = begin + i * kTile;
      const cache_t* rows = vcache + w.block_table[t0 / bs] * block_elems + t0 % bs + d0 * bs;
      const float* p = probs + i * kTile;
#pragma GCC unroll 4
      for (int r = 0; r < kR; ++r) {
        __m256 v0, v1 = _mm256_setzero_ps();
        if constexpr (kTile == 16) V::load16(rows + r * bs, v0, v1);
        else v0 = V::load8(rows + r * bs);
        if (lo > 0 || hi < kTile) {
          v0 = lanes_between(v0, lo, hi);
          if constexpr (kTile == 16) v1 = lanes_between(v1, lo - 8, hi - 8);
        }
#pragma GCC unroll 4
        for (int h = 0; h < kG; ++h) {
          const float* ph = p + h * stride;
          acc[h][r][set] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(ph), acc[h][r][set]);
          if constexpr (kTile == 16) acc[h][r][1] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(ph + 8), acc[h][r][1]);
        }
      }
    };
    int i = 0;
    if (skip > 0) tile(i++, 0, skip, tiles == 1 ? tail : kTile);
    for (; i + 2 < tiles; i += 2) {
      tile(i, 0, 0, kTile);
      tile(i + 1, kTile == 16 ? 0 : 1, 0, kTile);
    }
    for (; i < tiles; ++i) tile(i, 0, 0, i == tiles - 1 ? tail : kTile);
    for (int h = 0; h < kG; ++h) {
      for (int r = 0; r < kR; ++r) out[h * D + d0 + r] = norm[h] * sum8(_mm256_add_ps(acc[h][r][0], acc[h][r][1]));
    }
  }
}

template <typename cache_t, KVFormat kFormat, int kTile>
void pv_all_heads(const PartitionWork& w, const cache_t* vcache, int64_t block_elems, int begin, const float* probs,
                  int stride, const float* norm) {
  for (int h0 = 0; h0 < w.group; h0 += 4) {
    const float* p = probs + h0 * stride;
    float* out = w.out + h0 * w.head_size;
    switch (std::min(4, w.group - h0)) {
      case 1: pv_heads<cache_t, kFormat, 1, kTile>(w, vcache, block_elems, begin, p, stride, norm + h0, out); break;
      case 2: pv_heads<cache_t, kFormat, 2, kTile>(w, vcache, block_elems, begin, p, stride, norm + h0, out); break;
      case 3: pv_heads<cache_t, kFormat, 3, kTile>(w, vcache, block_elems, begin, p, stride, norm + h0, out); break;
      default: pv_heads<cache_t, kFormat, 4, kTile>(w, vcache, block_elems, begin, p, stride, norm + h0, out); break;
    }
  }
}

template <typename cache_t, KVFormat kFormat>
void run_partition(const PartitionWork& w) {
  NextScales(w.next_scales).fetch_all();  // dynamic scales: the next pass's lines, at once
  constexpr float kRescale = Values<cache_t, kFormat>::kRescale;
  constexpr int x = 16 / static_cast<int>(sizeof(cache_t));
  const int G = w.group, D = w.head_size, bs = w.block_size, kTile = tile_tokens(bs);
  const int begin = w.start / kTile * kTile, skip = w.start - begin, n = w.end - begin;
  const int stride = (n + 15) / 16 * 16;
  const int64_t block_elems = w.num_kv_heads * D * bs;
  const cache_t* kcache = static_cast<const cache_t*>(w.key_cache) + static_cast<int64_t>(w.kv_head) * D * bs;
  const cache_t* vcache = static_cast<const cache_t*>(w.value_cache) + static_cast<int64_t>(w.kv_head) * D * bs;
  float* logits = w.scratch;                      // [G][stride]
  float* q = logits + G * (kPartitionSize + 32);  // [G][D], scaled (32-byte aligned: D % 16 == 0)
  float* kbuf = q + G * D;                        // [8][D]
  float* norm = kbuf + 8 * D;                     // [G]
  const float q_scale = w.qk_scale * kRescale;
  for (int i = 0; i < G * D; ++i) q[i] = w.query[i] * q_scale;

  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const float* alibi = w.k_scales ? nullptr : w.alibi;  // dynamic scales: ALiBi after them
  for (int t0 = begin; t0 < w.end; t0 += 8) {
    decode_keys<cache_t, kFormat>(kcache + w.block_table[t0 / bs] * block_elems + (t0 % bs) * x, bs, D, kbuf);
    for (int h = 0; h < G; ++h) {
      __m256 out = dots8(kbuf, q + h * D, D);
      if (alibi) {
        const __m256 pos = _mm256_add_ps(lane, _mm256_set1_ps(static_cast<float>(t0 - w.last_pos)));
        out = _mm256_fmadd_ps(_mm256_set1_ps(alibi[h]), pos, out);
      }
      _mm256_storeu_ps(logits + h * stride + (t0 - begin), out);
    }
  }
  if (w.k_scales) apply_key_scales(w, logits, stride, begin, n);
  for (int h = 0; h < G; ++h) {
    soft_cap(logits + h * stride, skip, n, w.softcap);
    softmax_numerators(logits + h * stride, n, stride, w.max_logit + h, w.exp_sum + h, skip);
    norm[h] = w.v_scale * kRescale / w.exp_sum[h];
  }
  if (w.v_scales) apply_value_scales(w, logits, stride, begin, n);
  if (kTile == 16) pv_all_heads<cache_t, kFormat, 16>(w, vcache, block_elems, begin, logits, stride, norm);
  else pv_all_heads<cache_t, kFormat, 8>(w, vcache, block_elems, begin, logits, stride, norm);
}

}  // namespace fp8kv::cpu::avx2
