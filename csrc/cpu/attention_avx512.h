// AVX-512 partition kernel. The cache is never copied or dequantized up front: each K/V vector is
// decoded in registers where it is used, once per KV head for all query heads of its GQA group. One path per
// kind of cache: attention_avx512_fp8.h (FP8 codes, table decode) and attention_avx512_auto.h (the model's
// own dtype); this file splits a partition's heads into subgroups, runs the softmax and picks the path.
#pragma once

#include "cpu/attention_avx512_auto.h"
#include "cpu/attention_avx512_common.h"
#include "cpu/attention_avx512_fp8.h"
#include "cpu/vector_exp.h"

namespace fp8kv::cpu::avx512 {

// Tiles of 16 or 32 tokens start at block boundaries: a partition that starts inside a block runs from the
// block's start with the tokens before its own start masked out of the softmax (run_partition).
inline bool supports(const PartitionWork& w) {
  return w.head_size % 16 == 0 && (w.block_size == 8 || w.block_size == 16 || w.block_size == 32) &&
         w.end - w.start / w.block_size * w.block_size <= kPartitionSize;
}

// Calls fn(std::integral_constant<int, kG>, first_head) for subgroups of at most 4 heads.
template <typename Fn>
FP8KV_INLINE void for_head_quads(int group, Fn&& fn) {
  for (int h0 = 0; h0 < group; h0 += 4) {
    switch (std::min(4, group - h0)) {
      case 1: fn(std::integral_constant<int, 1>{}, h0); break;
      case 2: fn(std::integral_constant<int, 2>{}, h0); break;
      case 3: fn(std::integral_constant<int, 3>{}, h0); break;
      default: fn(std::integral_constant<int, 4>{}, h0); break;
    }
  }
}

// Softmax numerators in place over n logits; the row is zero-padded up to `padded` on return. The first
// `skip` logits (tokens before an unaligned partition start) are left out: their numerators are 0.
FP8KV_INLINE void softmax_numerators(float* row, int n, int padded, float* max_logit, float* exp_sum, int skip = 0) {
  for (int i = 0; i < skip; ++i) row[i] = -INFINITY;
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int i = 0; i < n; i += 16) m = _mm512_mask_max_ps(m, first_lanes(n - i), m, _mm512_loadu_ps(row + i));
  const float mx = _mm512_reduce_max_ps(m);
  const __m512 mxv = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) {
    const __m512 e = _mm512_maskz_mov_ps(first_lanes(n - i), exp512(_mm512_sub_ps(_mm512_loadu_ps(row + i), mxv)));
    _mm512_storeu_ps(row + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  for (int i = (n + 15) / 16 * 16; i < padded; i += 16) _mm512_storeu_ps(row + i, _mm512_setzero_ps());
  *max_logit = mx;
  *exp_sum = _mm512_reduce_add_ps(sum);
}

// Calls fn(std::integral_constant<int, kG>) for head subgroups of sizes 8, 4, 3, 2, 1 covering `group`.
template <typename Fn>
FP8KV_INLINE void for_head_subgroups(int group, Fn&& fn) {
  int h0 = 0;
  while (h0 < group) {
    const int left = group - h0;
    if (left >= 8) {
      fn(std::integral_constant<int, 8>{}, h0);
      h0 += 8;
    } else if (left >= 4) {
      fn(std::integral_constant<int, 4>{}, h0);
      h0 += 4;
    } else if (left == 3) {
      fn(std::integral_constant<int, 3>{}, h0);
      h0 += 3;
    } else if (left == 2) {
      fn(std::integral_constant<int, 2>{}, h0);
      h0 += 2;
    } else {
      fn(std::integral_constant<int, 1>{}, h0);
      h0 += 1;
    }
  }
}

template <typename cache_t, KVFormat kFormat, int kBs>
void pv_all_heads(const PartitionWork& w, const View<cache_t>& view, const float* probs, int stride,
                  const float* norm, int skip) {
  for_head_subgroups(w.group, [&](auto kG, int h0) {
    pv_heads<cache_t, kFormat, decltype(kG)::value, kBs>(w, view, probs + h0 * stride, stride, norm + h0,
                                                          w.out + h0 * w.head_size, skip);
  });
}

// The FP8 half of run_partition. The first subgroup's Q.K pass takes the prefetched heads' K to L2 and
// their V too, except the V of a head after this one, which its P.V pass takes: so memory stays busy
// during both passes. q is the unscaled query (qk_fp8 scales the logits).
template <typename Dot, KVFormat kFormat, bool kDynamic>
void run_fp8_partition(const PartitionWork& w, const View<uint8_t>& view, const float* q, float* logits,
                       int stride, float* norm, float* ops, int skip) {
  const int G = w.group, D = w.head_size, P = w.end - w.start;
  const int pf_from = w.prefetch_from, pf_heads = w.prefetch_heads;
  const bool last_is_next = pf_heads > 0 && pf_from + pf_heads - 1 > 0;
  // w.then (set only when pf_heads is 0): its K goes to L2 during Q.K and its V during P.V instead.
  const View<uint8_t> then_view(w.then ? *w.then : w);
  SlabPrefetcher k_ahead = w.then ? SlabPrefetcher(*w.then, then_view, false, 0, 1)
                                  : SlabPrefetcher(w, view, false, pf_from, pf_heads);
  SlabPrefetcher v_ahead_qk(w, view, true, pf_from, pf_heads - (last_is_next ? 1 : 0));
  SlabPrefetcher v_ahead_pv = w.then ? SlabPrefetcher(*w.then, then_view, true, 0, 1)
                                     : SlabPrefetcher(w, view, true, pf_from + pf_heads - 1, last_is_next ? 1 : 0);
  SlabPrefetcher idle(w, view, false, 0, 0);
  NextScales next_scales = w.next_scales;
  constexpr int kOps = Dot::kParts * 16;
  for_head_quads(G, [&](auto kG, int h0) {
    constexpr int g = decltype(kG)::value;
    for (int d = 0; d < D; d += 16) {  // [D / 16][g][kOps] (see qk_fp8)
      for (int h = 0; h < g; ++h) Dot::operands(q + (h0 + h) * D + d, ops + (d / 16 * g + h) * kOps);
    }
    qk_fp8<Dot, kFormat, g, kDynamic>(w, view, ops, w.alibi ? w.alibi + h0 : nullptr, logits + h0 * stride, stride,
                            h0 == 0 ? k_ahead : idle, h0 == 0 ? v_ahead_qk : idle, next_scales);  // key scales folded in
  });
  if constexpr (kDynamic) next_scales.fetch_all();  // a short partition's leftovers
  for (int h = 0; h < G; ++h) {
    soft_cap(logits + h * stride, skip, P, w.softcap);
    softmax_numerators(logits + h * stride, P, stride, w.max_logit + h, w.exp_sum + h, skip);
    norm[h] = w.v_scale / w.exp_sum[h];
  }
  for_head_quads(G, [&](auto kG, int h0) {
    constexpr int g = decltype(kG)::value;
    const float* p = logits + h0 * stride;
    SlabPrefetcher& pf = h0 == 0 ? v_ahead_pv : idle;
    switch (w.block_size) {
      case 8: pv_fp8<Dot, kFormat, g, 8, kDynamic>(w, view, p, stride, norm + h0, w.out + h0 * D, ops, pf); break;
      case 16: pv_fp8<Dot, kFormat, g, 16, kDynamic>(w, view, p, stride, norm + h0, w.out + h0 * D, ops, pf); break;
      default: pv_fp8<Dot, kFormat, g, 32, kDynamic>(w, view, p, stride, norm + h0, w.out + h0 * D, ops, pf); break;
    }
  });
}

// kBf16Query: the query was bfloat16 (w.query holds its exact values), so FP8 caches may use Bf16Dot.
template <typename cache_t, KVFormat kFormat, bool kBf16Query>
void run_partition(const PartitionWork& unaligned) {
  PartitionWork w = unaligned;
  const int skip = w.start % w.block_size;
  w.start -= skip;
  const int G = w.group, D = w.head_size, P = w.end - w.start;
  const int stride = (P + 31) / 32 * 32;          // tiles of up to 32 read whole rows of zero-padded probs
  float* logits = w.scratch;                      // [G][stride]
  float* q = logits + G * (kPartitionSize + 32);  // [G][D]
  float* norm = q + G * D;                        // [G], then 64-byte aligned scratch (see ops)
  const View<cache_t> view(w);
  if constexpr (kFormat != KVFormat::AUTO) {
    float* ops = norm + (G + 15) / 16 * 16;  // FP8 operands (64-byte aligned)
    using Dot = std::conditional_t<kBf16Query, Bf16Dot<kFormat>, FloatDot<kFormat>>;
    if (w.k_scales) run_fp8_partition<Dot, kFormat, true>(w, view, w.query, logits, stride, norm, ops, skip);
    else run_fp8_partition<Dot, kFormat, false>(w, view, w.query, logits, stride, norm, ops, skip);
  } else {
    NextScales(w.next_scales).fetch_all();  // dynamic scales of an FP8 pass after this window ring's, at once
    const __m512 qs = _mm512_set1_ps(w.qk_scale);
    for (int i = 0; i < G * D; i += 16) _mm512_storeu_ps(q + i, _mm512_mul_ps(_mm512_loadu_ps(w.query + i), qs));
    for_head_subgroups(G, [&](auto kG, int h0) {  // K/V go to L2 during the first subgroup's pass
      qk_heads<cache_t, kFormat, decltype(kG)::value>(w, view, q + h0 * D, w.alibi ? w.alibi + h0 : nullptr,
                                                      logits + h0 * stride, stride, w.prefetch_from, h0 == 0 ? w.prefetch_heads : 0);
    });
    for (int h = 0; h < G; ++h) {
      soft_cap(logits + h * stride, skip, P, w.softcap);
      softmax_numerators(logits + h * stride, P, stride, w.max_logit + h, w.exp_sum + h, skip);
      norm[h] = w.v_scale / w.exp_sum[h];
    }
    switch (w.block_size) {
      case 8: pv_all_heads<cache_t, kFormat, 8>(w, view, logits, stride, norm, skip); break;
      case 16: pv_all_heads<cache_t, kFormat, 16>(w, view, logits, stride, norm, skip); break;
      default: pv_all_heads<cache_t, kFormat, 32>(w, view, logits, stride, norm, skip); break;
    }
  }
}

}  // namespace fp8kv::cpu::avx512
