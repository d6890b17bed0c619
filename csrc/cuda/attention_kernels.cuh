// Paged decode attention over an FP8 (or auto) cache, dequantizing inside the kernel.
//
// One thread block per (head, sequence, partition of kPartitionSize tokens). With one partition the block
// writes the output directly (vLLM's v1); with more, each block writes its unnormalized partial output, its
// max logit and its sum of exponentials, and a reduce kernel merges them (v2).
//
// Q.K: one thread per token. The key cache keeps each token's 16-byte chunks next to those of the other
// tokens of its block ([.., head_size / x, block_size, x]), so neighbouring threads read neighbouring
// 16 bytes and a warp's loads coalesce. The query sits in shared memory, read by all threads at once
// (a broadcast).
// P.V: one thread per (head dim, block subset); a value cache row [head dim, block_size] is one wide load.
// Scales are folded in: logit = (q . codes) * scale * k_scale, out = (p . codes) * v_scale / sum p.
#pragma once

#include <cmath>

#include "cache_codec.cuh"
#include "launch.h"

namespace fp8kv::gpu {

constexpr int kAttentionThreads = 128;
constexpr int kMaxWarps = kAttentionThreads / 32;  // room for warps of 32 (CUDA) or 64 (AMD) lanes

struct AttentionShared {
  float q[kMaxHeadSize];
  float probs[kPartitionSize];  // logits, then exp(logit - max)
  float partial[kAttentionThreads + kMaxHeadSize];  // P.V partial sums [split][head dim]
  float reduce[kMaxWarps];
};

template <bool kMax, class Thread>
FP8KV_DEVICE float block_reduce(float v, float* scratch, const Thread& th) {
  for (int mask = kWarpSize / 2; mask > 0; mask /= 2) {
    const float other = th.shfl_xor(v, mask);
    v = kMax ? fmaxf(v, other) : v + other;
  }
  if (th.index() % kWarpSize == 0) scratch[th.index() / kWarpSize] = v;
  th.sync();
  float r = scratch[0];
  for (int w = 1; w < kAttentionThreads / kWarpSize; ++w) r = kMax ? fmaxf(r, scratch[w]) : r + scratch[w];
  th.sync();  // scratch is reused by the next reduction
  return r;
}

// exp(x - max) that is 0 for a masked (-inf) entry even when every entry is masked.
FP8KV_DEVICE float softmax_weight(float x, float max) { return x == -INFINITY ? 0.0f : expf(x - max); }

// The sequence length, clamped so that nothing past max_seq_len (the partition count) or the block table
// row is touched; an out-of-range length is reported.
template <typename scalar_t, typename cache_t>
FP8KV_DEVICE int checked_seq_len(const PagedAttentionArgs<scalar_t, cache_t>& a, int seq, bool report) {
  const int len = a.seq_lens[seq];
  const int64_t table_capacity = int64_t(a.max_blocks_per_seq) * a.block_size;
  const int capacity = static_cast<int>(table_capacity < a.max_seq_len ? table_capacity : a.max_seq_len);
  if (len >= 0 && len <= capacity) return len;
  if (report) report_error(a.error_flag, kErrorSeqLenOutOfRange);
  return len < 0 ? 0 : capacity;
}

template <typename scalar_t, typename cache_t, Fp8Format kFormat, int BLOCK_SIZE, class Thread>
FP8KV_DEVICE void paged_attention_body(const PagedAttentionArgs<scalar_t, cache_t>& a, AttentionShared& sm,
                                       const Thread& th) {
  using Codec = CacheCodec<scalar_t, cache_t, kFormat>;
  constexpr int X = Codec::kX;
  constexpr int NT = kAttentionThreads;
  const int head = th.block_x(), seq = th.block_y(), part = th.block_z();
  const int tid = th.index();
  const int head_size = a.head_size;
  const int kv_head = head / (a.num_heads / a.num_kv_heads);
  const int64_t row = int64_t(seq) * a.num_heads + head;  // (seq, head)
  const int64_t part_row = row * a.num_partitions + part;
  const bool single = a.num_partitions == 1;

  const int seq_len = checked_seq_len(a, seq, tid == 0 && part == 0);
  const int start = part * kPartitionSize;
  const int end = seq_len < start + kPartitionSize ? seq_len : start + kPartitionSize;
  if (start >= end) {  // nothing to attend to: an empty sequence, or a partition past its end
    if (single) {
      for (int d = tid; d < head_size; d += NT) a.out[row * head_size + d] = from_float<scalar_t>(0.0f);
    } else if (tid == 0) {
      a.partial_max[part_row] = -INFINITY;
      a.partial_sum[part_row] = 0.0f;
    }
    return;
  }
  const int n = end - start;

  const scalar_t* q = a.query + seq * a.query_seq_stride + head * a.query_head_stride;
  for (int d = tid; d < head_size; d += NT) sm.q[d] = to_float(q[d]);
  th.sync();

  // Q.K, one token per thread.
  const int* block_table = a.block_tables + seq * a.block_table_stride;
  const float logit_scale = a.scale * Codec::scale_of(a.k_scale, a.k_scale_per_head, kv_head);
  const float slope = a.alibi_slopes ? a.alibi_slopes[head] : 0.0f;
  const cache_t* k_head = a.key_cache + kv_head * a.key_cache_head_stride;
  float local_max = -INFINITY;
  for (int i = tid; i < n; i += NT) {
    const int pos = start + i;
    const int block = block_table[pos / BLOCK_SIZE];
    float logit = -INFINITY;
    if (block >= 0 && block < a.num_blocks) {
      const cache_t* k = k_head + block * a.key_cache_block_stride + (pos % BLOCK_SIZE) * X;
      float dot = 0.0f;
      for (int c = 0; c < head_size / X; ++c) {
        const Vec<cache_t, X> chunk = load_vec<cache_t, X>(k + c * BLOCK_SIZE * X);
        FP8KV_UNROLL
        for (int j = 0; j < X; ++j) dot += sm.q[c * X + j] * Codec::decode(chunk.e[j]);
      }
      logit = dot * logit_scale + slope * static_cast<float>(pos - (seq_len - 1));
    } else {
      report_error(a.error_flag, kErrorBlockOutOfRange);
    }
    sm.probs[i] = logit;
    local_max = fmaxf(local_max, logit);
  }
  const float max_logit = block_reduce<true>(local_max, sm.reduce, th);

  float local_sum = 0.0f;
  for (int i = tid; i < n; i += NT) {
    const float p = softmax_weight(sm.probs[i], max_logit);
    sm.probs[i] = p;
    local_sum += p;
  }
  const float sum = block_reduce<false>(local_sum, sm.reduce, th);  // its barrier also publishes probs

  // P.V: thread (d, split) sums blocks split, split + splits, ... of this partition for head dim d.
  const int splits = NT / head_size > 1 ? NT / head_size : 1;
  const int first_block = start / BLOCK_SIZE;  // kPartitionSize is a multiple of BLOCK_SIZE
  const int last_block = (end - 1) / BLOCK_SIZE;
  const cache_t* v_head = a.value_cache + kv_head * a.value_cache_head_stride;
  for (int item = tid; item < head_size * splits; item += NT) {
    const int d = item % head_size;
    const int split = item / head_size;
    float acc = 0.0f;
    for (int b = first_block + split; b <= last_block; b += splits) {
      const int block = block_table[b];
      if (block < 0 || block >= a.num_blocks) continue;  // reported by Q.K
      const cache_t* row = v_head + block * a.value_cache_block_stride + int64_t(d) * BLOCK_SIZE;
      const Vec<cache_t, BLOCK_SIZE> values = load_vec<cache_t, BLOCK_SIZE>(row);
      const int t0 = b * BLOCK_SIZE - start;
      FP8KV_UNROLL
      for (int j = 0; j < BLOCK_SIZE; ++j) {
        if (t0 + j < n) acc += sm.probs[t0 + j] * Codec::decode(values.e[j]);
      }
    }
    sm.partial[split * head_size + d] = acc;
  }
  th.sync();

  const float v_scale = Codec::scale_of(a.v_scale, a.v_scale_per_head, kv_head);
  for (int d = tid; d < head_size; d += NT) {
    float acc = 0.0f;
    for (int s = 0; s < splits; ++s) acc += sm.partial[s * head_size + d];
    acc *= v_scale;
    if (single) {
      a.out[row * head_size + d] = from_float<scalar_t>(sum != 0.0f ? acc / sum : 0.0f);
    } else {
      a.partial_out[part_row * head_size + d] = acc;
    }
  }
  if (!single && tid == 0) {
    a.partial_max[part_row] = max_logit;
    a.partial_sum[part_row] = sum;
  }
}

// Merge the partitions of one (head, sequence): out = sum_p w_p * partial_out_p / sum_p w_p * sum_p with
// w_p = exp(max_p - max over p).
template <typename scalar_t, typename cache_t, class Thread>
FP8KV_DEVICE void paged_attention_reduce_body(const PagedAttentionArgs<scalar_t, cache_t>& a,
                                              const Thread& th) {
  const int head = th.block_x(), seq = th.block_y();
  const int64_t row = int64_t(seq) * a.num_heads + head;
  const int parts = (checked_seq_len(a, seq, false) + kPartitionSize - 1) / kPartitionSize;
  const float* part_max = a.partial_max + row * a.num_partitions;
  const float* part_sum = a.partial_sum + row * a.num_partitions;
  const float* part_out = a.partial_out + row * a.num_partitions * a.head_size;

  float max_logit = -INFINITY;
  for (int p = 0; p < parts; ++p) max_logit = fmaxf(max_logit, part_max[p]);
  float denom = 0.0f;
  for (int p = 0; p < parts; ++p) denom += softmax_weight(part_max[p], max_logit) * part_sum[p];

  for (int d = th.index(); d < a.head_size; d += kAttentionThreads) {
    float acc = 0.0f;
    for (int p = 0; p < parts; ++p) {
      acc += softmax_weight(part_max[p], max_logit) * part_out[p * a.head_size + d];
    }
    a.out[row * a.head_size + d] = from_float<scalar_t>(denom != 0.0f ? acc / denom : 0.0f);
  }
}

#if !defined(FP8KV_PLATFORM_HOST)
template <typename scalar_t, typename cache_t, Fp8Format kFormat, int BLOCK_SIZE>
__global__ void __launch_bounds__(kAttentionThreads)
    paged_attention_kernel(const PagedAttentionArgs<scalar_t, cache_t> args) {
  __shared__ AttentionShared smem;
  paged_attention_body<scalar_t, cache_t, kFormat, BLOCK_SIZE>(args, smem, GpuThread{});
}

template <typename scalar_t, typename cache_t>
__global__ void __launch_bounds__(kAttentionThreads)
    paged_attention_reduce_kernel(const PagedAttentionArgs<scalar_t, cache_t> args) {
  paged_attention_reduce_body(args, GpuThread{});
}
#endif

}  // namespace fp8kv::gpu
