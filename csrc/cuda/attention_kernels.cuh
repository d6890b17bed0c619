// Paged decode attention over an FP8 (or auto) cache, dequantizing inside the kernel, and its window variant
// (the newest tokens read from a full-precision ring instead).
//
// One thread block per (group of query heads of one KV head, sequence, partition of at most kPartitionSize
// positions): the group's heads share every K/V load and decode (with_heads_per_block). With one partition
// the block writes the output directly (vLLM's v1); with more, each block writes its unnormalized partial
// output, its max logit and its sum of exponentials, and a reduce kernel merges them (v2). The window
// variant always has more: its window partitions come after the paged ones and the merge is one softmax
// (see "paged_attention_window" below).
//
// A partition's positions are a Span; where their K/V live is a view (PagedView: the block table of the
// paged cache; RingView: the window ring). attend() is the one kernel body, written against a view.
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

// kHeads query heads of one KV head per thread block (see with_heads_per_block).
template <int kHeads>
struct alignas(16) AttentionShared {
  float q[kHeads][kMaxHeadSize];
  float probs[kHeads][kPartitionSize];  // logits, then exp(logit - max)
  float partial[kHeads][kAttentionThreads + kMaxHeadSize];  // P.V partial sums [split][head dim]
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

// v if it lies in [lo, hi], else the nearest bound, reported: the kernels never index past what was checked.
FP8KV_DEVICE int checked_in(int v, int lo, int hi, int* error_flag, int error_bit, bool report) {
  if (v >= lo && v <= hi) return v;
  if (report) report_error(error_flag, error_bit);
  return v < lo ? lo : hi;
}

// Positions [start, end) of one sequence.
struct Span {
  int start, end;
  FP8KV_DEVICE int size() const { return end > start ? end - start : 0; }
};

// The positions paged_attention's partition `part` covers.
FP8KV_DEVICE Span partition_span(int part, int end) {
  const int start = part * kPartitionSize;
  return {start, end < start + kPartitionSize ? end : start + kPartitionSize};
}

// ---- where a partition's K/V live --------------------------------------------------------------------
// A view names the cache of one partition. Its tokens are consecutive in the cache's coordinate c: token i
// (position span.start + i) is at c = first + i, in block table()[c / BLOCK_SIZE] at offset c % BLOCK_SIZE.
// The paged cache's coordinate is the position; the window ring's is the ring slot, p - lap (window
// partitions never cross the ring's wrap). Views hold the kernel parameters by reference and compute
// addresses where they are used: kept in registers across the kernel, ptxas would spill them.

// The paged cache (FP8 codes with scales, or an auto cache).
template <typename scalar_t, typename cache_t, Fp8Format kFormat, int BLOCK_SIZE>
struct PagedView {
  using Codec = CacheCodec<scalar_t, cache_t, kFormat>;
  using Cache = cache_t;
  static constexpr int kBlockSize = BLOCK_SIZE;
  static constexpr int kErrorBit = kErrorBlockOutOfRange;
  static constexpr bool kBlockAligned = true;  // first is a multiple of BLOCK_SIZE (partitions are)

  const PagedAttentionArgs<scalar_t, cache_t>& a;
  int seq, kv_head;
  Span span;
  int first;

  FP8KV_DEVICE const int* table() const { return a.block_tables + seq * a.block_table_stride; }
  FP8KV_DEVICE int num_blocks() const { return a.num_blocks; }
  FP8KV_DEVICE float k_scale() const { return Codec::scale_of(a.k_scale, a.k_scale_per_head, kv_head); }
  FP8KV_DEVICE float v_scale() const { return Codec::scale_of(a.v_scale, a.v_scale_per_head, kv_head); }
  // The key's x-element chunks of the token at `offset` of `block`, BLOCK_SIZE * x elements apart.
  FP8KV_DEVICE const cache_t* key(int block, int offset) const {
    return a.key_cache + block * a.key_cache_block_stride + kv_head * a.key_cache_head_stride +
           offset * Codec::kX;
  }
  // Head dim d of the block's BLOCK_SIZE tokens.
  FP8KV_DEVICE const cache_t* value_row(int block, int d) const {
    return a.value_cache + block * a.value_cache_block_stride + kv_head * a.value_cache_head_stride +
           int64_t(d) * BLOCK_SIZE;
  }
};

// The window ring: window_t values without scales, laid out as an auto cache.
template <typename window_t, int BLOCK_SIZE>
struct RingView {
  using Codec = CacheCodec<window_t, window_t, Fp8Format::E4M3FN>;
  using Cache = window_t;
  static constexpr int kBlockSize = BLOCK_SIZE;
  static constexpr int kErrorBit = kErrorWindowBlockOutOfRange;
  static constexpr bool kBlockAligned = false;  // a run of ring slots starts anywhere

  const WindowCache<window_t>& w;
  int seq, kv_head;
  Span span;
  int first;

  FP8KV_DEVICE const int* table() const { return w.block_tables + seq * w.block_table_stride; }
  FP8KV_DEVICE int num_blocks() const { return w.num_blocks; }
  FP8KV_DEVICE float k_scale() const { return 1.0f; }
  FP8KV_DEVICE float v_scale() const { return 1.0f; }
  FP8KV_DEVICE const window_t* key(int block, int offset) const {
    return w.key_cache + block * w.key_block_stride + kv_head * w.key_head_stride + offset * Codec::kX;
  }
  FP8KV_DEVICE const window_t* value_row(int block, int d) const {
    return w.value_cache + block * w.value_block_stride + kv_head * w.value_head_stride +
           int64_t(d) * BLOCK_SIZE;
  }
};

// ---- one thread block's work ---------------------------------------------------------------------------

// One (sequence, kHeads heads of one KV head, partition): the queries, what the softmax needs, and where the
// results go. Output addresses are computed where they are written, from the kernel parameters: kept in
// registers across the kernel, ptxas would spill them.
template <typename scalar_t, typename cache_t, int kHeadsPerTask>
struct HeadTask {
  static constexpr int kHeads = kHeadsPerTask;
  const PagedAttentionArgs<scalar_t, cache_t>& a;
  int head0, seq, part;
  int seq_len;  // ALiBi biases position p by slope * (p - (seq_len - 1))

  FP8KV_DEVICE int64_t row(int h) const { return int64_t(seq) * a.num_heads + head0 + h; }
  FP8KV_DEVICE int64_t part_row(int h) const { return row(h) * a.num_partitions + part; }
  FP8KV_DEVICE const scalar_t* query(int h) const {
    return a.query + seq * a.query_seq_stride + (head0 + h) * a.query_head_stride;
  }
  FP8KV_DEVICE float alibi_slope(int h) const { return a.alibi_slopes ? a.alibi_slopes[head0 + h] : 0.0f; }
  // With one partition the block writes the normalized output; with more, partials for the reduce kernel.
  FP8KV_DEVICE bool writes_output() const { return a.num_partitions == 1; }
  FP8KV_DEVICE void write_output(int h, int d, float v) const {
    a.out[row(h) * a.head_size + d] = from_float<scalar_t>(v);
  }
  FP8KV_DEVICE void write_partial(int h, int d, float acc) const {
    a.partial_out[part_row(h) * a.head_size + d] = acc;
  }
  FP8KV_DEVICE void write_stats(int h, float max_logit, float sum) const {
    a.partial_max[part_row(h)] = max_logit;
    a.partial_sum[part_row(h)] = sum;
  }
};

// Softmax-weighted sum of V over the view's span for the task's heads. Each K/V element is loaded and
// decoded once for all of them.
template <class View, class Task, class Thread>
FP8KV_DEVICE void attend(const View& view, const Task& task, AttentionShared<Task::kHeads>& sm,
                         const Thread& th) {
  using Codec = typename View::Codec;
  using cache_t = typename View::Cache;
  constexpr int H = Task::kHeads;
  constexpr int X = Codec::kX;
  constexpr int BLOCK_SIZE = View::kBlockSize;
  constexpr int NT = kAttentionThreads;
  const int tid = th.index();
  const int head_size = task.a.head_size;
  const int n = view.span.size();
  if (n == 0) {  // nothing to attend to: an empty sequence, or a partition past its end
    for (int h = 0; h < H; ++h) {
      if (task.writes_output()) {
        for (int d = tid; d < head_size; d += NT) task.write_output(h, d, 0.0f);
      } else if (tid == 0) {
        task.write_stats(h, -INFINITY, 0.0f);
      }
    }
    return;
  }

  for (int i = tid; i < H * head_size; i += NT) sm.q[i / head_size][i % head_size] = to_float(task.query(i / head_size)[i % head_size]);
  th.sync();

  // Q.K, one token per thread.
  const int* table = view.table();
  const float logit_scale = task.a.scale * view.k_scale();
  const int newest = task.seq_len - 1 - view.span.start;  // token index of position seq_len - 1 (ALiBi)
  float local_max[H], slope[H];  // slopes read once, not per token (a global load each with ALiBi)
  FP8KV_UNROLL
  for (int h = 0; h < H; ++h) {
    local_max[h] = -INFINITY;
    slope[h] = task.alibi_slope(h);
  }
  for (int i = tid; i < n; i += NT) {
    const int coord = view.first + i;
    const int block = table[coord / BLOCK_SIZE];
    const bool valid = block >= 0 && block < view.num_blocks();
    float dot[H] = {};
    if (valid) {
      const cache_t* k = view.key(block, coord % BLOCK_SIZE);
      for (int c = 0; c < head_size / X; ++c) {
        float kv[X];
        Codec::template decode_vec<X>(load_vec<cache_t, X>(k + c * BLOCK_SIZE * X), kv);
        FP8KV_UNROLL
        for (int h = 0; h < H; ++h) {
          FP8KV_UNROLL
          for (int j = 0; j < X; j += 4) {  // 16-byte shared-memory loads: waits on them bound the kernel
            const Vec<float, 4> qv = load_vec<float, 4>(sm.q[h] + c * X + j);
            FP8KV_UNROLL
            for (int e = 0; e < 4; ++e) dot[h] += qv.e[e] * kv[j + e];
          }
        }
      }
    } else {
      report_error(task.a.error_flag, View::kErrorBit);
    }
    FP8KV_UNROLL
    for (int h = 0; h < H; ++h) {
      const float logit = valid ? dot[h] * logit_scale + slope[h] * static_cast<float>(i - newest)
                                : -INFINITY;
      sm.probs[h][i] = logit;
      local_max[h] = fmaxf(local_max[h], logit);
    }
  }
  float max_logit[H], sum[H];
  FP8KV_UNROLL
  for (int h = 0; h < H; ++h) max_logit[h] = block_reduce<true>(local_max[h], sm.reduce, th);

  float local_sum[H] = {};
  for (int i = tid; i < n; i += NT) {
    FP8KV_UNROLL
    for (int h = 0; h < H; ++h) {
      const float p = softmax_weight(sm.probs[h][i], max_logit[h]);
      sm.probs[h][i] = p;
      local_sum[h] += p;
    }
  }
  FP8KV_UNROLL
  for (int h = 0; h < H; ++h) sum[h] = block_reduce<false>(local_sum[h], sm.reduce, th);  // publishes probs

  // P.V: thread (d, split) sums table entries first_entry + split, + 2 * split, ... for head dim d.
  const int splits = NT / head_size > 1 ? NT / head_size : 1;
  const int first_entry = view.first / BLOCK_SIZE;
  const int last_entry = (view.first + n - 1) / BLOCK_SIZE;
  for (int item = tid; item < head_size * splits; item += NT) {
    const int d = item % head_size;
    const int split = item / head_size;
    float acc[H] = {};
    for (int b = first_entry + split; b <= last_entry; b += splits) {
      const int block = table[b];
      if (block < 0 || block >= view.num_blocks()) continue;  // reported by Q.K
      float values[BLOCK_SIZE];
      Codec::template decode_vec<BLOCK_SIZE>(load_vec<cache_t, BLOCK_SIZE>(view.value_row(block, d)), values);
      const int t0 = b * BLOCK_SIZE - view.first;  // token at offset 0 of the block
      FP8KV_UNROLL
      for (int h = 0; h < H; ++h) {
        if constexpr (View::kBlockAligned) {  // t0 is a multiple of BLOCK_SIZE: 16-byte loads of probs
          FP8KV_UNROLL
          for (int j = 0; j < BLOCK_SIZE; j += 4) {
            const Vec<float, 4> p = load_vec<float, 4>(sm.probs[h] + t0 + j);
            FP8KV_UNROLL
            for (int e = 0; e < 4; ++e) {
              if (t0 + j + e < n) acc[h] += p.e[e] * values[j + e];
            }
          }
        } else {
          FP8KV_UNROLL
          for (int j = 0; j < BLOCK_SIZE; ++j) {
            const int t = t0 + j;
            if (t >= 0 && t < n) acc[h] += sm.probs[h][t] * values[j];
          }
        }
      }
    }
    FP8KV_UNROLL
    for (int h = 0; h < H; ++h) sm.partial[h][split * head_size + d] = acc[h];
  }
  th.sync();

  FP8KV_UNROLL
  for (int h = 0; h < H; ++h) {  // h a constant: sum[h] stays in a register
    for (int d = tid; d < head_size; d += NT) {
      float acc = 0.0f;
      for (int s = 0; s < splits; ++s) acc += sm.partial[h][s * head_size + d];
      acc *= view.v_scale();
      if (task.writes_output()) {
        task.write_output(h, d, sum[h] != 0.0f ? acc / sum[h] : 0.0f);
      } else {
        task.write_partial(h, d, acc);
      }
    }
  }
  if (!task.writes_output() && tid == 0) {
    for (int h = 0; h < H; ++h) task.write_stats(h, max_logit[h], sum[h]);
  }
}

// Merge the partitions of one (head, sequence) that cover positions (span_of(p) non-empty):
// out = sum_p w_p * partial_out_p / sum_p w_p * sum_p with w_p = exp(max_p - max over p).
template <typename scalar_t, typename cache_t, class Thread, class SpanOf>
FP8KV_DEVICE void merge_partitions(const PagedAttentionArgs<scalar_t, cache_t>& a, const SpanOf& span_of,
                                   const Thread& th) {
  const int head = th.block_x(), seq = th.block_y();
  const int64_t row = int64_t(seq) * a.num_heads + head;
  const float* part_max = a.partial_max + row * a.num_partitions;
  const float* part_sum = a.partial_sum + row * a.num_partitions;
  const float* part_out = a.partial_out + row * a.num_partitions * a.head_size;

  float max_logit = -INFINITY;
  for (int p = 0; p < a.num_partitions; ++p) {
    if (span_of(p).size() > 0) max_logit = fmaxf(max_logit, part_max[p]);
  }
  float denom = 0.0f;
  for (int p = 0; p < a.num_partitions; ++p) {
    if (span_of(p).size() > 0) denom += softmax_weight(part_max[p], max_logit) * part_sum[p];
  }

  for (int d = th.index(); d < a.head_size; d += kAttentionThreads) {
    float acc = 0.0f;
    for (int p = 0; p < a.num_partitions; ++p) {
      if (span_of(p).size() == 0) continue;
      acc += softmax_weight(part_max[p], max_logit) * part_out[p * a.head_size + d];
    }
    a.out[row * a.head_size + d] = from_float<scalar_t>(denom != 0.0f ? acc / denom : 0.0f);
  }
}

// ---- paged_attention -----------------------------------------------------------------------------------

// The sequence length, clamped so that nothing past max_seq_len (the partition count) or the block table
// row is touched; an out-of-range length is reported.
template <typename scalar_t, typename cache_t>
FP8KV_DEVICE int checked_seq_len(const PagedAttentionArgs<scalar_t, cache_t>& a, int seq, bool report) {
  const int64_t table_capacity = int64_t(a.max_blocks_per_seq) * a.block_size;
  const int capacity = static_cast<int>(table_capacity < a.max_seq_len ? table_capacity : a.max_seq_len);
  return checked_in(a.seq_lens[seq], 0, capacity, a.error_flag, kErrorSeqLenOutOfRange, report);
}

template <typename scalar_t, typename cache_t, Fp8Format kFormat, int BLOCK_SIZE, int kHeads, class Thread>
FP8KV_DEVICE void paged_attention_body(const PagedAttentionArgs<scalar_t, cache_t>& a,
                                       AttentionShared<kHeads>& sm, const Thread& th) {
  const int head = th.block_x() * kHeads, seq = th.block_y(), part = th.block_z();
  const int kv_head = head / (a.num_heads / a.num_kv_heads);
  const int seq_len = checked_seq_len(a, seq, th.index() == 0 && part == 0);
  const Span span = partition_span(part, seq_len);
  const PagedView<scalar_t, cache_t, kFormat, BLOCK_SIZE> view{a, seq, kv_head, span, span.start};
  attend(view, HeadTask<scalar_t, cache_t, kHeads>{a, head, seq, part, seq_len}, sm, th);
}

template <typename scalar_t, typename cache_t, class Thread>
FP8KV_DEVICE void paged_attention_reduce_body(const PagedAttentionArgs<scalar_t, cache_t>& a,
                                              const Thread& th) {
  const int seq_len = checked_seq_len(a, th.block_y(), false);
  merge_partitions(a, [&](int p) { return partition_span(p, seq_len); }, th);
}

// ---- paged_attention_window ----------------------------------------------------------------------------
// Grid partitions [0, num_fp8_partitions) split the paged positions [0, window_start) as paged_attention
// does; one kernel attends to them. The window's positions [window_start, seq_len) are at most two runs of
// consecutive ring slots: run A up to the first position whose slot is 0 again (a multiple of window_size),
// run B after it. The window partitions split run A, then run B, so that none crosses the wrap; a second
// kernel attends to them, and the merge takes both kinds. (Two kernels, not one with a branch: holding both
// paths, one kernel needs more registers, so fewer of its blocks fit on a GPU core.)

// One sequence's split, checked: paged positions [0, paged_end), window positions [window_start, seq_len),
// run A ending at wrap.
struct WindowSplit {
  int seq_len, window_start, paged_end, wrap;
  int run_a_partitions;
};

template <typename scalar_t, typename cache_t>
FP8KV_DEVICE WindowSplit checked_window_split(const PagedAttentionArgs<scalar_t, cache_t>& a,
                                              const WindowPositions& w, int seq, bool report) {
  WindowSplit s;
  s.seq_len = checked_in(a.seq_lens[seq], 0, a.max_seq_len, a.error_flag, kErrorSeqLenOutOfRange, report);
  const int oldest = s.seq_len > w.window_size ? s.seq_len - w.window_size : 0;
  s.window_start = checked_in(w.window_starts[seq], oldest, s.seq_len, a.error_flag,
                              kErrorWindowStartOutOfRange, report);
  const int64_t table_capacity = int64_t(a.max_blocks_per_seq) * a.block_size;
  const int capacity = static_cast<int>(table_capacity < s.window_start ? table_capacity : s.window_start);
  s.paged_end = checked_in(s.window_start, 0, capacity, a.error_flag, kErrorSeqLenOutOfRange, report);
  const int64_t wrap = (int64_t(s.window_start) / w.window_size + 1) * w.window_size;
  s.wrap = static_cast<int>(wrap < s.seq_len ? wrap : s.seq_len);
  s.run_a_partitions = (s.wrap - s.window_start + kPartitionSize - 1) / kPartitionSize;
  return s;
}

// Window partition k (counted from the first window partition) and the position its ring slots start at.
struct RingSpan {
  Span span;
  int lap;  // the position ring slot 0 holds: span.start - lap is span.start's ring slot
};

FP8KV_DEVICE RingSpan window_ring_span(const WindowSplit& s, int k, int window_size) {
  const bool run_a = k < s.run_a_partitions;
  const int run_start = run_a ? s.window_start : s.wrap;
  const int run_end = run_a ? s.wrap : s.seq_len;
  const int start = run_start + (run_a ? k : k - s.run_a_partitions) * kPartitionSize;
  const int end = run_end < start + kPartitionSize ? run_end : start + kPartitionSize;
  return {{start, end}, run_a ? s.window_start - s.window_start % window_size : s.wrap};
}

// Grid z of the first kernel: paged partition `part`. Only the first partition reports bad arguments.
template <typename scalar_t, typename cache_t, Fp8Format kFormat, int BLOCK_SIZE, int kHeads, class Thread>
FP8KV_DEVICE void window_paged_part_body(const PagedAttentionArgs<scalar_t, cache_t>& a,
                                         const WindowPositions& w, AttentionShared<kHeads>& sm,
                                         const Thread& th) {
  const int head = th.block_x() * kHeads, seq = th.block_y(), part = th.block_z();
  const int kv_head = head / (a.num_heads / a.num_kv_heads);
  const WindowSplit split = checked_window_split(a, w, seq, th.index() == 0 && part == 0);
  const Span span = partition_span(part, split.paged_end);
  const PagedView<scalar_t, cache_t, kFormat, BLOCK_SIZE> view{a, seq, kv_head, span, span.start};
  attend(view, HeadTask<scalar_t, cache_t, kHeads>{a, head, seq, part, split.seq_len}, sm, th);
}

// Grid z of the second kernel: window partition k, partition num_fp8_partitions + k of the merge.
template <typename scalar_t, typename cache_t, typename window_t, int BLOCK_SIZE, int kHeads, class Thread>
FP8KV_DEVICE void window_ring_part_body(const PagedAttentionArgs<scalar_t, cache_t>& a,
                                        const WindowPositions& w, const WindowCache<window_t>& ring,
                                        AttentionShared<kHeads>& sm, const Thread& th) {
  const int head = th.block_x() * kHeads, seq = th.block_y(), k = th.block_z();
  const int kv_head = head / (a.num_heads / a.num_kv_heads);
  const WindowSplit split = checked_window_split(a, w, seq, false);
  const RingSpan r = window_ring_span(split, k, w.window_size);
  const RingView<window_t, BLOCK_SIZE> view{ring, seq, kv_head, r.span, r.span.start - r.lap};
  attend(view, HeadTask<scalar_t, cache_t, kHeads>{a, head, seq, w.num_fp8_partitions + k, split.seq_len}, sm,
         th);
}

template <typename scalar_t, typename cache_t, class Thread>
FP8KV_DEVICE void paged_attention_window_reduce_body(const PagedAttentionArgs<scalar_t, cache_t>& a,
                                                     const WindowPositions& w, const Thread& th) {
  const WindowSplit split = checked_window_split(a, w, th.block_y(), false);
  const auto span_of = [&](int p) {
    return p < w.num_fp8_partitions ? partition_span(p, split.paged_end)
                                    : window_ring_span(split, p - w.num_fp8_partitions, w.window_size).span;
  };
  merge_partitions(a, span_of, th);
}

#if !defined(FP8KV_PLATFORM_HOST)
// The kernels name an occupancy floor of 4 blocks per SM (up to 128 registers a thread). Without one, ptxas
// (CUDA 13) trades a few spilled registers for more resident blocks, kernel by kernel and arch by arch, and
// the compile check (-warn-spills) rejects any spill; with it, nothing spills on sm_80/89/90 and the
// attention kernels use 48-61 registers for FP8 caches, 56-80 for 16-bit ones and up to 116 for float32
// (was 32-47 for FP8 without the floor). Which occupancy decodes faster is for a GPU run to tell. HIP
// reads a second argument as waves per execution unit, so it gets the thread count only.
#if defined(FP8KV_PLATFORM_CUDA)
#define FP8KV_ATTENTION_LAUNCH_BOUNDS __launch_bounds__(kAttentionThreads, 4)
#else
#define FP8KV_ATTENTION_LAUNCH_BOUNDS __launch_bounds__(kAttentionThreads)
#endif

template <typename scalar_t, typename cache_t, Fp8Format kFormat, int BLOCK_SIZE, int kHeads>
__global__ void FP8KV_ATTENTION_LAUNCH_BOUNDS
    paged_attention_kernel(const PagedAttentionArgs<scalar_t, cache_t> args) {
  __shared__ AttentionShared<kHeads> smem;
  paged_attention_body<scalar_t, cache_t, kFormat, BLOCK_SIZE, kHeads>(args, smem, GpuThread{});
}

template <typename scalar_t, typename cache_t>
__global__ void FP8KV_ATTENTION_LAUNCH_BOUNDS
    paged_attention_reduce_kernel(const PagedAttentionArgs<scalar_t, cache_t> args) {
  paged_attention_reduce_body(args, GpuThread{});
}


template <typename scalar_t, typename cache_t, Fp8Format kFormat, int BLOCK_SIZE, int kHeads>
__global__ void FP8KV_ATTENTION_LAUNCH_BOUNDS
    window_paged_part_kernel(const PagedAttentionArgs<scalar_t, cache_t> args, const WindowPositions window) {
  __shared__ AttentionShared<kHeads> smem;
  window_paged_part_body<scalar_t, cache_t, kFormat, BLOCK_SIZE, kHeads>(args, window, smem, GpuThread{});
}

template <typename scalar_t, typename cache_t, typename window_t, int BLOCK_SIZE, int kHeads>
__global__ void FP8KV_ATTENTION_LAUNCH_BOUNDS
    window_ring_part_kernel(const PagedAttentionArgs<scalar_t, cache_t> args, const WindowPositions window,
                            const WindowCache<window_t> ring) {
  __shared__ AttentionShared<kHeads> smem;
  window_ring_part_body<scalar_t, cache_t, window_t, BLOCK_SIZE, kHeads>(args, window, ring, smem, GpuThread{});
}

template <typename scalar_t, typename cache_t>
__global__ void FP8KV_ATTENTION_LAUNCH_BOUNDS
    paged_attention_window_reduce_kernel(const PagedAttentionArgs<scalar_t, cache_t> args,
                                         const WindowPositions window) {
  paged_attention_window_reduce_body(args, window, GpuThread{});
}

#endif

}  // namespace fp8kv::gpu
