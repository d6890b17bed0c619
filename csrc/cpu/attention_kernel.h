// The unit of work of the CPU paged attention: one (sequence, KV head, partition of <= kPartitionSize
// tokens of one cache). Each ISA path (attention_generic.h, attention_avx512.h) implements run_partition
// for it; the driver (attention.cpp) spreads the units over threads and merges the partitions, as vLLM's
// paged_attention_v2 does. A partition may also be a run of ring slots of the window cache
// (paged_attention_window): token indices are then ring slots, and last_pos shifts ALiBi to true positions.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/dynamic_scale.h"
#include "cpu/isa.h"

namespace fp8kv::cpu {

constexpr int kPartitionSize = 512;

// Dynamic scales: the scale lines of the pass a thread runs next, still to be fetched (blocks [block, end) of its
// block table). The AVX-512 FP8 kernel fetches them a block per Q.K tile of the pass before; the others at once.
// Block ids are random, so no hardware prefetcher finds these lines, and prefetches issued all at once (two per
// block of a 512-token partition) mostly went unserved on the AMD EPYC machine: at head size 64, 8 x 8192, the
// dynamic kernel took 1.5x the static one's time with them, and 1.02-1.07x with them spread over the pass.
struct NextScales {
  const uint16_t* k = nullptr;  // already offset to the KV head, as PartitionWork's
  const uint16_t* v = nullptr;
  const int32_t* table = nullptr;
  int64_t block_stride = 0;  // num_kv_heads * block_size
  int block = 0, end = 0;

  // The next n blocks' K and V scale lines into L1.
  FP8KV_INLINE void fetch(int n) {
    for (const int stop = std::min(end, block + n); block < stop; ++block) {
      const int64_t at = table[block] * block_stride;
      __builtin_prefetch(k + at);
      __builtin_prefetch(v + at);
    }
  }
  void fetch_all() { fetch(end - block); }
};

struct PartitionWork {
  const void* key_cache;       // [num_blocks, num_kv_heads, head_size / x, block_size, x]
  const void* value_cache;     // [num_blocks, num_kv_heads, head_size, block_size]
  const int32_t* block_table;  // this sequence's row of block_tables (ids already validated)
  int64_t num_kv_heads;
  int head_size;
  int block_size;
  int kv_head;
  int group;           // query heads per KV head; they are handled together so K/V are read once
  int start, end;      // token indices [start, end) of this partition in its cache (block_table order)
  int last_pos;        // token index of the newest position: ALiBi adds alibi[h] * (t - last_pos)
  const float* query;  // [group, head_size] float32
  float qk_scale;      // softmax scale * k_scale[kv_head]
  float v_scale;       // v_scale[kv_head]
  const float* alibi;  // [group] slopes or nullptr
  float softcap = 0.f;  // > 0: a logit l (scaled, ALiBi included) becomes softcap * tanh(l / softcap) (Gemma 2)
  float* out;          // [group, head_size]: this partition's softmax-weighted V (normalised)
  float* max_logit;    // [group]
  float* exp_sum;      // [group]: sum of exp(logit - max_logit) over the partition
  // Dynamic scales (common/dynamic_scale.h): this KV head's bfloat16 bits in the scale caches [num_blocks,
  // num_kv_heads, block_size] (already offset by kv_head * block_size), or nullptr for static scales. The kernels fold a
  // token's key scale into its logit (before ALiBi: the AVX-512 FP8 kernel a tile at a time, the others through
  // apply_key_scales) and its value scale into its probability after the softmax's sums: a few operations per
  // token, not per element.
  const uint16_t* k_scales = nullptr;
  const uint16_t* v_scales = nullptr;
  NextScales next_scales;  // the thread's next pass's, whatever its cache (none: nothing to fetch)
  float* scratch;      // scratch_floats(...) floats, 64-byte aligned, owned by the calling thread
  // KV heads kv_head + prefetch_from .. + prefetch_heads - 1 are read by this thread now or next:
  // prefetch their K and V (contiguous within a block) into L2 during this pass, so memory keeps busy
  // while this head computes.
  int prefetch_from;
  int prefetch_heads;
  // FP8 caches: the first head of the unit this thread runs next, prefetched during this (last) head's
  // passes; nullptr otherwise.
  const PartitionWork* then = nullptr;
};

// Logit soft-capping over row[begin, end) (Gemma 2's attn_logit_softcapping), before the softmax's maximum.
// std::tanh, not a vector approximation: a capped logit feeds exp and must stay as exact as the logit was.
inline void soft_cap(float* row, int begin, int end, float cap) {
  if (!(cap > 0.f)) return;
  const float inv = 1.f / cap;
  for (int i = begin; i < end; ++i) row[i] = cap * std::tanh(row[i] * inv);
}

// Scratch size run_partition needs (both paths fit in this).
inline int64_t scratch_floats(int group, int head_size, int block_size) {
  const int64_t padded = kPartitionSize + 32;
  const int64_t lanes = std::max<int64_t>(16 * head_size, kPartitionSize / 16 * 4 * 64);  // AVX-512 FP8
  return group * padded + group * static_cast<int64_t>(head_size) + static_cast<int64_t>(head_size) * block_size +
         static_cast<int64_t>(head_size) * 2 +
         static_cast<int64_t>(block_size) * 2 + group + 16 + lanes + 1024 + kPartitionSize + 32;
}

// The last kPartitionSize + 32 floats of the scratch: the dynamic scales of a partition's tokens.
inline float* token_scale_buffer(const PartitionWork& w) {
  return w.scratch + scratch_floats(w.group, w.head_size, w.block_size) - (kPartitionSize + 32);
}

// The scale lines of a pass (none for static scales or a window ring's partition).
inline NextScales scale_lines(const PartitionWork& w) {
  if (w.k_scales == nullptr) return {};
  const int bs = w.block_size;
  return {w.k_scales, w.v_scales, w.block_table, w.num_kv_heads * bs, w.start / bs, (w.end + bs - 1) / bs};
}

// dst[i] = the scale of token begin + i, i < n, from one of the partition's scale caches.
inline void token_scales(const PartitionWork& w, const uint16_t* scales, int begin, int n, float* dst) {
  const int bs = w.block_size;
  const int64_t block_stride = w.num_kv_heads * bs;
  for (int i = 0; i < n;) {
    const int t = begin + i, offset = t % bs, run = std::min(bs - offset, n - i);
    const uint16_t* src = scales + w.block_table[t / bs] * block_stride + offset;
    int j = 0;
#if defined(FP8KV_ISA_AVX512)
    for (; j < run; j += 16) {  // bfloat16 bits -> float32: zero-extend, shift into the upper half
      const __mmask16 m = run - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (run - j)) - 1);
      const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, src + j));
      _mm512_mask_storeu_ps(dst + i + j, m, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
    }
#endif
    for (; j < run; ++j) dst[i + j] = scale_value(src[j]);
    i += run;
  }
}

// row[i] *= scale[i], i < n.
inline void scale_row(float* row, const float* scale, int n) {
  int i = 0;
#if defined(FP8KV_ISA_AVX512)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(row + i, _mm512_mul_ps(_mm512_loadu_ps(row + i), _mm512_loadu_ps(scale + i)));
#endif
  for (; i < n; ++i) row[i] *= scale[i];
}

// Logit rows logits[h * stride + i] of tokens begin + i, i < n: times each token's key scale, then ALiBi.
inline void apply_key_scales(const PartitionWork& w, float* logits, int stride, int begin, int n) {
  float* scale = token_scale_buffer(w);
  token_scales(w, w.k_scales, begin, n, scale);
  for (int h = 0; h < w.group; ++h) {
    float* row = logits + static_cast<int64_t>(h) * stride;
    scale_row(row, scale, n);
    if (w.alibi) {
      for (int i = 0; i < n; ++i) row[i] += w.alibi[h] * static_cast<float>(begin + i - w.last_pos);
    }
  }
}

// Softmax numerators probs[h * stride + i] (their sums taken already) times each token's value scale.
inline void apply_value_scales(const PartitionWork& w, float* probs, int stride, int begin, int n) {
  float* scale = token_scale_buffer(w);
  token_scales(w, w.v_scales, begin, n, scale);
  for (int h = 0; h < w.group; ++h) {
    scale_row(probs + static_cast<int64_t>(h) * stride, scale, n);
  }
}

}  // namespace fp8kv::cpu
