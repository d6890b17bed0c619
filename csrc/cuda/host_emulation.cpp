// Runs the GPU kernel bodies of cache_kernels.cuh and attention_kernels.cuh on the host, so their logic can
// be tested against the pure-torch reference on machines without a GPU (tests/test_cuda_host_emulation.py,
// tests/test_cuda_window_emulation.py).
//
// Every GPU thread of a block is a std::thread; __syncthreads is a barrier of the block's threads and a warp
// shuffle is an exchange through memory between two barriers of the warp's threads. So a thread that skips
// a barrier its block reaches deadlocks here as it would misbehave on a GPU. Blocks run one after another.
//
// Not part of the op library (the build compiles csrc/cuda/*.cu only). Built by the test with
//   g++ -std=c++20 -O1 -shared -fPIC -pthread -DFP8KV_HOST_EMULATION host_emulation.cpp
// and called through ctypes with pointers to contiguous tensors; each entry returns the kernels' error bits.
#ifndef FP8KV_HOST_EMULATION
#define FP8KV_HOST_EMULATION
#endif

#include <algorithm>
#include <barrier>
#include <memory>
#include <thread>
#include <vector>

#include "attention_kernels.cuh"
#include "cache_kernels.cuh"

namespace fp8kv::gpu {
namespace {

struct BlockState {
  explicit BlockState(int threads) : block_barrier(threads), exchange(threads) {
    for (int w = 0; w < threads / kWarpSize; ++w) {
      warp_barriers.push_back(std::make_unique<std::barrier<>>(kWarpSize));
    }
  }
  std::barrier<> block_barrier;
  std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
  std::vector<float> exchange;  // one slot per thread, for shuffles
};

// Stands in for GpuThread (platform.cuh).
struct HostThread {
  int tid, bx, by, bz;
  BlockState* block;

  int index() const { return tid; }
  int block_x() const { return bx; }
  int block_y() const { return by; }
  int block_z() const { return bz; }
  void sync() const { block->block_barrier.arrive_and_wait(); }
  float shfl_xor(float v, int lane_mask) const {
    const int warp = tid / kWarpSize, lane = tid % kWarpSize;
    float* lanes = &block->exchange[warp * kWarpSize];
    std::barrier<>& barrier = *block->warp_barriers[warp];
    lanes[lane] = v;
    barrier.arrive_and_wait();
    const float other = lanes[lane ^ lane_mask];
    barrier.arrive_and_wait();
    return other;
  }
};

// body(const HostThread&) for every thread of a gx * gy * gz grid; block_start() before each block.
template <class Body, class BlockStart>
void run_grid(int gx, int gy, int gz, int threads, const Body& body, const BlockStart& block_start) {
  for (int z = 0; z < gz; ++z) {
    for (int y = 0; y < gy; ++y) {
      for (int x = 0; x < gx; ++x) {
        block_start();
        BlockState state(threads);
        std::vector<std::thread> pool;
        pool.reserve(threads);
        for (int t = 0; t < threads; ++t) {
          pool.emplace_back([&, t] { body(HostThread{t, x, y, z, &state}); });
        }
        for (auto& th : pool) th.join();
      }
    }
  }
}

template <class Body>
void run_grid(int gx, int gy, int gz, int threads, const Body& body) {
  run_grid(gx, gy, gz, threads, body, [] {});
}

// A block's shared memory as a GPU hands it over: not zeroed, whatever the previous block left. NaN here, so
// that a block reading shared memory it did not write shows it in its output.
template <int kHeads>
void fill_with_nan(AttentionShared<kHeads>& sm) {
  static_assert(sizeof(AttentionShared<kHeads>) % sizeof(float) == 0);
  std::fill_n(reinterpret_cast<float*>(&sm), sizeof(sm) / sizeof(float), NAN);
}

template <typename scalar_t, typename cache_t, Fp8Format kFormat>
int reshape_and_cache(const void* key, const void* value, void* key_cache, void* value_cache,
                      const int64_t* slots, const float* k_scale, const float* v_scale, int64_t num_tokens,
                      int num_kv_heads, int head_size, int num_blocks, int block_size, bool k_per_head,
                      bool v_per_head) {
  int flag = 0;
  ReshapeAndCacheArgs<scalar_t, cache_t> a{};
  a.key = static_cast<const scalar_t*>(key);
  a.value = static_cast<const scalar_t*>(value);
  a.key_cache = static_cast<cache_t*>(key_cache);
  a.value_cache = static_cast<cache_t*>(value_cache);
  a.slot_mapping = slots;
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  a.error_flag = &flag;
  a.num_tokens = num_tokens;
  a.num_kv_heads = num_kv_heads;
  a.head_size = head_size;
  a.block_size = block_size;
  a.num_slots = int64_t(num_blocks) * block_size;
  a.key_token_stride = a.value_token_stride = int64_t(num_kv_heads) * head_size;
  a.key_head_stride = a.value_head_stride = head_size;
  a.key_cache_head_stride = a.value_cache_head_stride = int64_t(head_size) * block_size;
  a.key_cache_block_stride = a.value_cache_block_stride = a.key_cache_head_stride * num_kv_heads;
  a.k_scale_per_head = k_per_head;
  a.v_scale_per_head = v_per_head;
  run_grid(static_cast<int>(num_tokens), 1, 1, kCacheThreads, [&](const HostThread& th) {
    reshape_and_cache_body<scalar_t, cache_t, kFormat>(a, th);
  });
  return flag;
}

// Dense buffers of a paged_attention call (the test passes contiguous tensors), and room for partials.
template <typename scalar_t, typename cache_t>
struct PagedAttentionCall {
  PagedAttentionArgs<scalar_t, cache_t> args{};
  std::vector<float> partial_out, partial_max, partial_sum;
  int flag = 0;

  PagedAttentionCall(void* out, const void* query, const void* key_cache, const void* value_cache,
                     const int* block_tables, const int* seq_lens, const float* alibi, const float* k_scale,
                     const float* v_scale, int num_seqs, int num_heads, int num_kv_heads, int head_size,
                     int num_blocks, int block_size, int max_blocks_per_seq, int max_seq_len, float scale,
                     bool k_per_head, bool v_per_head, int num_partitions) {
    PagedAttentionArgs<scalar_t, cache_t>& a = args;
    a.num_seqs = num_seqs;
    a.num_heads = num_heads;
    a.num_kv_heads = num_kv_heads;
    a.head_size = head_size;
    a.block_size = block_size;
    a.num_blocks = num_blocks;
    a.max_blocks_per_seq = max_blocks_per_seq;
    a.max_seq_len = max_seq_len;
    a.num_partitions = num_partitions;
    a.scale = scale;
    const size_t rows = size_t(num_seqs) * num_heads * num_partitions;
    // NaN, as uninitialized GPU memory may hold: the merge must not read partials nobody wrote.
    partial_out.assign(rows * head_size, NAN);
    partial_max.assign(rows, NAN);
    partial_sum.assign(rows, NAN);
    a.partial_out = partial_out.data();
    a.partial_max = partial_max.data();
    a.partial_sum = partial_sum.data();
    a.out = static_cast<scalar_t*>(out);
    a.query = static_cast<const scalar_t*>(query);
    a.key_cache = static_cast<const cache_t*>(key_cache);
    a.value_cache = static_cast<const cache_t*>(value_cache);
    a.block_tables = block_tables;
    a.seq_lens = seq_lens;
    a.alibi_slopes = alibi;
    a.k_scale = k_scale;
    a.v_scale = v_scale;
    a.error_flag = &flag;
    a.query_seq_stride = int64_t(num_heads) * head_size;
    a.query_head_stride = head_size;
    a.block_table_stride = max_blocks_per_seq;
    a.key_cache_head_stride = a.value_cache_head_stride = int64_t(head_size) * block_size;
    a.key_cache_block_stride = a.value_cache_block_stride = a.key_cache_head_stride * num_kv_heads;
    a.k_scale_per_head = k_per_head;
    a.v_scale_per_head = v_per_head;
  }
};

// As the launchers of kernels_instantiate.cu: body(th, block size constant) over the (head, seq, partition)
// grid, then merge(th) over (head, seq) when there are partitions. Blocks run one at a time, so they can
// share one AttentionShared as consecutive blocks on one GPU core would.
template <class Body, class Merge>
int run_attention(int num_heads, int num_kv_heads, int num_seqs, int num_partitions, int block_size,
                  const Body& body, const Merge& merge) {
  bool supported = false;
  with_heads_per_block(num_heads, num_kv_heads, [&](auto heads) {
    constexpr int kHeads = decltype(heads)::value;
    AttentionShared<kHeads> shared;
    supported = with_block_size(block_size, [&](auto bs) {
      run_grid(
          num_heads / kHeads, num_seqs, num_partitions, kAttentionThreads,
          [&](const HostThread& th) { body(th, shared, bs); }, [&] { fill_with_nan(shared); });
    });
  });
  if (!supported) return -1;
  if (num_partitions > 1) run_grid(num_heads, num_seqs, 1, kAttentionThreads, merge);
  return 0;
}

template <typename scalar_t, typename cache_t, Fp8Format kFormat>
int paged_attention(void* out, const void* query, const void* key_cache, const void* value_cache,
                    const int* block_tables, const int* seq_lens, const float* alibi, const float* k_scale,
                    const float* v_scale, int num_seqs, int num_heads, int num_kv_heads, int head_size,
                    int num_blocks, int block_size, int max_blocks_per_seq, int max_seq_len, float scale,
                    bool k_per_head, bool v_per_head) {
  PagedAttentionCall<scalar_t, cache_t> call(out, query, key_cache, value_cache, block_tables, seq_lens,
                                             alibi, k_scale, v_scale, num_seqs, num_heads, num_kv_heads,
                                             head_size, num_blocks, block_size, max_blocks_per_seq,
                                             max_seq_len, scale, k_per_head, v_per_head,
                                             num_partitions_for(max_seq_len));
  const auto& a = call.args;
  const int status = run_attention(
      num_heads, num_kv_heads, num_seqs, a.num_partitions, block_size,
      [&](const HostThread& th, auto& shared, auto bs) {
        paged_attention_body<scalar_t, cache_t, kFormat, decltype(bs)::value>(a, shared, th);
      },
      [&](const HostThread& th) { paged_attention_reduce_body(a, th); });
  return status < 0 ? status : call.flag;
}

template <typename scalar_t, typename cache_t, Fp8Format kFormat, typename window_t>
int paged_attention_window(void* out, const void* query, const void* key_cache, const void* value_cache,
                           const void* window_key_cache, const void* window_value_cache,
                           const int* block_tables, const int* window_block_tables, const int* seq_lens,
                           const int* window_starts, const float* alibi, const float* k_scale,
                           const float* v_scale, int num_seqs, int num_heads, int num_kv_heads, int head_size,
                           int num_blocks, int num_window_blocks, int block_size, int max_blocks_per_seq,
                           int max_window_blocks_per_seq, int window_size, int max_seq_len, float scale,
                           bool k_per_head, bool v_per_head) {
  // As the binding: paged partitions for max_seq_len, then the window's.
  WindowPositions w{};
  w.window_starts = window_starts;
  w.window_size = window_size;
  w.num_fp8_partitions = num_partitions_for(max_seq_len);
  w.num_window_partitions = num_window_partitions_for(window_size, max_seq_len);
  PagedAttentionCall<scalar_t, cache_t> call(out, query, key_cache, value_cache, block_tables, seq_lens,
                                             alibi, k_scale, v_scale, num_seqs, num_heads, num_kv_heads,
                                             head_size, num_blocks, block_size, max_blocks_per_seq,
                                             max_seq_len, scale, k_per_head, v_per_head,
                                             w.num_fp8_partitions + w.num_window_partitions);
  WindowCache<window_t> ring{};
  ring.key_cache = static_cast<const window_t*>(window_key_cache);
  ring.value_cache = static_cast<const window_t*>(window_value_cache);
  ring.block_tables = window_block_tables;
  ring.num_blocks = num_window_blocks;
  ring.block_table_stride = max_window_blocks_per_seq;
  ring.key_head_stride = ring.value_head_stride = int64_t(head_size) * block_size;
  ring.key_block_stride = ring.value_block_stride = ring.key_head_stride * num_kv_heads;
  const auto& a = call.args;

  // As launch_paged_attention_window: the paged part, the window part, then the merge.
  bool supported = false;
  with_heads_per_block(num_heads, num_kv_heads, [&](auto heads) {
    constexpr int kHeads = decltype(heads)::value;
    AttentionShared<kHeads> shared;
    supported = with_block_size(block_size, [&](auto bs) {
      constexpr int kBlockSize = decltype(bs)::value;
      const auto poison = [&] { fill_with_nan(shared); };
      run_grid(
          num_heads / kHeads, num_seqs, w.num_fp8_partitions, kAttentionThreads,
          [&](const HostThread& th) {
            window_paged_part_body<scalar_t, cache_t, kFormat, kBlockSize>(a, w, shared, th);
          },
          poison);
      run_grid(
          num_heads / kHeads, num_seqs, w.num_window_partitions, kAttentionThreads,
          [&](const HostThread& th) {
            window_ring_part_body<scalar_t, cache_t, window_t, kBlockSize>(a, w, ring, shared, th);
          },
          poison);
    });
  });
  if (!supported) return -1;
  run_grid(num_heads, num_seqs, 1, kAttentionThreads,
           [&](const HostThread& th) { paged_attention_window_reduce_body(a, w, th); });
  return call.flag;
}

// dtype: 0 float32, 1 float16, 2 bfloat16; fn(a value of that type).
template <class Fn>
int with_dtype(int dtype, const Fn& fn) {
  switch (dtype) {
    case 0: return fn(float{});
    case 1: return fn(half_t{});
    case 2: return fn(bf16_t{});
    default: return -1;
  }
}

// dtype as above, format: -1 auto, else fp8kv::Fp8Format; fn(scalar, cache element, format constant).
template <class Fn>
int with_types(int dtype, int format, const Fn& fn) {
  const auto by_format = [&](auto scalar) {
    using S = decltype(scalar);
    switch (format) {
      case -1: return fn(S{}, S{}, std::integral_constant<Fp8Format, Fp8Format::E4M3FN>{});
      case 0: return fn(S{}, uint8_t{}, std::integral_constant<Fp8Format, Fp8Format::E4M3FN>{});
      case 1: return fn(S{}, uint8_t{}, std::integral_constant<Fp8Format, Fp8Format::E5M2>{});
      case 2: return fn(S{}, uint8_t{}, std::integral_constant<Fp8Format, Fp8Format::E4M3FNUZ>{});
      default: return -1;
    }
  };
  return with_dtype(dtype, by_format);
}

}  // namespace
}  // namespace fp8kv::gpu

extern "C" {

int fp8kv_emu_reshape_and_cache(int dtype, int format, const void* key, const void* value, void* key_cache,
                                void* value_cache, const int64_t* slots, const float* k_scale,
                                const float* v_scale, int64_t num_tokens, int num_kv_heads, int head_size,
                                int num_blocks, int block_size, int k_per_head, int v_per_head) {
  using namespace fp8kv::gpu;
  return with_types(dtype, format, [&](auto scalar, auto cache, auto fmt) {
    return reshape_and_cache<decltype(scalar), decltype(cache), decltype(fmt)::value>(
        key, value, key_cache, value_cache, slots, k_scale, v_scale, num_tokens, num_kv_heads, head_size,
        num_blocks, block_size, k_per_head != 0, v_per_head != 0);
  });
}

int fp8kv_emu_paged_attention(int dtype, int format, void* out, const void* query, const void* key_cache,
                              const void* value_cache, const int* block_tables, const int* seq_lens,
                              const float* alibi, const float* k_scale, const float* v_scale, int num_seqs,
                              int num_heads, int num_kv_heads, int head_size, int num_blocks, int block_size,
                              int max_blocks_per_seq, int max_seq_len, float scale, int k_per_head,
                              int v_per_head) {
  using namespace fp8kv::gpu;
  return with_types(dtype, format, [&](auto scalar, auto cache, auto fmt) {
    return paged_attention<decltype(scalar), decltype(cache), decltype(fmt)::value>(
        out, query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale, v_scale, num_seqs,
        num_heads, num_kv_heads, head_size, num_blocks, block_size, max_blocks_per_seq, max_seq_len, scale,
        k_per_head != 0, v_per_head != 0);
  });
}

// window_dtype: the window cache's, coded as dtype.
int fp8kv_emu_paged_attention_window(int dtype, int format, int window_dtype, void* out, const void* query,
                                     const void* key_cache, const void* value_cache,
                                     const void* window_key_cache, const void* window_value_cache,
                                     const int* block_tables, const int* window_block_tables,
                                     const int* seq_lens, const int* window_starts, const float* alibi,
                                     const float* k_scale, const float* v_scale, int num_seqs, int num_heads,
                                     int num_kv_heads, int head_size, int num_blocks, int num_window_blocks,
                                     int block_size, int max_blocks_per_seq, int max_window_blocks_per_seq,
                                     int window_size, int max_seq_len, float scale, int k_per_head,
                                     int v_per_head) {
  using namespace fp8kv::gpu;
  return with_types(dtype, format, [&](auto scalar, auto cache, auto fmt) {
    return with_dtype(window_dtype, [&](auto window) {
      using W = decltype(window);
      return paged_attention_window<decltype(scalar), decltype(cache), decltype(fmt)::value, W>(
          out, query, key_cache, value_cache, window_key_cache, window_value_cache, block_tables,
          window_block_tables, seq_lens, window_starts, alibi, k_scale, v_scale, num_seqs, num_heads,
          num_kv_heads, head_size, num_blocks, num_window_blocks, block_size, max_blocks_per_seq,
          max_window_blocks_per_seq, window_size, max_seq_len, scale, k_per_head != 0, v_per_head != 0);
    });
  });
}

}  // extern "C"
