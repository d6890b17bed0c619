// Runs the GPU kernel bodies of cache_kernels.cuh and attention_kernels.cuh on the host, so their logic can
// be tested against the pure-torch reference on machines without a GPU (tests/ops/test_cuda_host_emulation.py,
// tests/ops/test_cuda_window_emulation.py).
//
// Every GPU thread of a block is a fiber (host_fibers.h); __syncthreads is a barrier of the block's threads and
// a warp shuffle is an exchange through memory between two barriers of the warp's threads. So a thread that
// skips a barrier its block reaches stops the emulation with a deadlock report, as it would misbehave on a GPU.
// Blocks run one after another.
//
// Not part of the op library (the build compiles csrc/cuda/*.cu only). Built by the test with
//   g++ -std=c++20 -O0 -shared -fPIC -pthread -DFP8KV_HOST_EMULATION host_emulation.cpp
// (-O1 took three times as long to build, for tests that run a few seconds either way.)
// and called through ctypes with pointers to contiguous tensors; each entry returns the kernels' error bits.
#ifndef FP8KV_HOST_EMULATION
#define FP8KV_HOST_EMULATION
#endif

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "../common/cache_format.h"
#include "host_fibers.h"
#include "attention_kernels.cuh"
#include "attention_tc_kernels.cuh"
#include "cache_kernels.cuh"

namespace fp8kv::gpu {
namespace {

struct BlockState {
  explicit BlockState(int threads) : block_barrier(threads), exchange(threads) {
    for (int w = 0; w < threads / kWarpSize; ++w) {
      warp_barriers.push_back(std::make_unique<host::FiberBarrier>(kWarpSize));
    }
  }
  host::FiberBarrier block_barrier;
  std::vector<std::unique_ptr<host::FiberBarrier>> warp_barriers;
  std::vector<float> exchange;  // one slot per thread, for shuffles
  std::vector<uint32_t> operands = std::vector<uint32_t>(exchange.size() * 6);  // a tensor core's A and B
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
  void sync_warp() const { block->warp_barriers[tid / kWarpSize]->arrive_and_wait(); }
  float shfl_xor(float v, int lane_mask) const { return shfl(v, (tid % kWarpSize) ^ lane_mask); }
  float shfl(float v, int src_lane) const {
    const int warp = tid / kWarpSize, lane = tid % kWarpSize;
    float* lanes = &block->exchange[warp * kWarpSize];
    host::FiberBarrier& barrier = *block->warp_barriers[warp];
    lanes[lane] = v;
    barrier.arrive_and_wait();
    const float other = lanes[src_lane];
    barrier.arrive_and_wait();
    return other;
  }
  uint32_t shfl_xor_bits(uint32_t v, int lane_mask) const {
    const int warp = tid / kWarpSize, lane = tid % kWarpSize;
    uint32_t* lanes = &block->operands[warp * kWarpSize * 6];  // free between mma calls
    host::FiberBarrier& barrier = *block->warp_barriers[warp];
    lanes[lane] = v;
    barrier.arrive_and_wait();
    const uint32_t other = lanes[lane ^ lane_mask];
    barrier.arrive_and_wait();
    return other;
  }
  uint32_t ballot(bool pred) const {
    const int warp = tid / kWarpSize, lane = tid % kWarpSize;
    float* lanes = &block->exchange[warp * kWarpSize];
    host::FiberBarrier& barrier = *block->warp_barriers[warp];
    lanes[lane] = pred ? 1.0f : 0.0f;
    barrier.arrive_and_wait();
    uint32_t mask = 0;
    for (int other = 0; other < kWarpSize; ++other) mask |= lanes[other] != 0.0f ? 1u << other : 0u;
    barrier.arrive_and_wait();
    return mask;
  }

  // mma.m16n8k16.row.col with f32 accumulators, from the fragment layouts PTX defines: lane 4 g + t holds
  // A (row g | g + 8, cols 2t, 2t + 1 | 2t + 8, 2t + 9) in a0..a3, B (rows 2t, 2t + 1 | 2t + 8, 2t + 9, col g)
  // in b0, b1, C (row g | g + 8, cols 2t, 2t + 1) in c0..c3; the lower index in a register's low half.
  template <MmaType kType>
  void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) const {
    const int warp = tid / kWarpSize, lane = tid % kWarpSize;
    uint32_t* regs = &block->operands[warp * kWarpSize * 6];
    host::FiberBarrier& barrier = *block->warp_barriers[warp];
    for (int i = 0; i < 4; ++i) regs[lane * 6 + i] = a[i];
    regs[lane * 6 + 4] = b[0];
    regs[lane * 6 + 5] = b[1];
    barrier.arrive_and_wait();
    const auto at = [&](int row, int k) {
      const int owner = (row % 8) * 4 + (k % 8) / 2, reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
      return static_cast<double>(unpack_half<kType>(regs[owner * 6 + reg], k % 2));
    };
    const auto bt = [&](int k, int col) {
      const int owner = col * 4 + (k % 8) / 2, reg = 4 + (k >= 8 ? 1 : 0);
      return static_cast<double>(unpack_half<kType>(regs[owner * 6 + reg], k % 2));
    };
    const int g = lane / 4, t = lane % 4;
    for (int r = 0; r < 4; ++r) {
      const int row = g + 8 * (r / 2), col = 2 * t + r % 2;
      double sum = d[r];
      for (int k = 0; k < 16; ++k) sum += at(row, k) * bt(k, col);
      d[r] = static_cast<float>(sum);
    }
    barrier.arrive_and_wait();
  }

  // cp.async done at once: the bytes land before the call returns, the rest zero-filled.
  template <int kBytes>
  void copy_async(void* dst, const void* src, int src_bytes) const {
    std::memcpy(dst, src, src_bytes);
    std::memset(static_cast<char*>(dst) + src_bytes, 0, kBytes - src_bytes);
  }
  void copy_commit() const {}
  void copy_wait(int) const {}
};

// body(const HostThread&) for every thread of a gx * gy * gz grid; block_start() before each block.
template <class Body, class BlockStart>
void run_grid(int gx, int gy, int gz, int threads, const Body& body, const BlockStart& block_start) {
  for (int z = 0; z < gz; ++z) {
    for (int y = 0; y < gy; ++y) {
      for (int x = 0; x < gx; ++x) {
        block_start();
        BlockState state(threads);
        host::FiberBlock::run(threads, [&](int t) { body(HostThread{t, x, y, z, &state}); });
      }
    }
  }
}

template <class Body>
void run_grid(int gx, int gy, int gz, int threads, const Body& body) {
  run_grid(gx, gy, gz, threads, body, [] {});
}

// A block's shared memory as a GPU hands it over: not zeroed, whatever the previous block left. All bits set
// here (NaN floats, -1 ints), so that a block reading shared memory it did not write shows it in its output.
template <class Smem>
void poison(Smem& sm) {
  std::memset(static_cast<void*>(&sm), 0xFF, sizeof(sm));
}

// The streaming multiprocessors the splits are chosen for (attention_splits, tc_splits); tests may change it to
// get more or fewer splits for the same shapes.
int emulated_sm_count = 132;
// Whether paged FP8 and 16-bit caches run the tensor-core kernel, as on sm_80+ GPUs (else the CUDA-core one, as
// under HIP), and the shared memory the plan may use (an H100's).
bool emulated_tensor_cores = true;
constexpr int kEmulatedSmemPerSm = 228 * 1024, kEmulatedSmemPerBlock = 227 * 1024;

template <typename scalar_t, typename cache_t, Fp8Format kFormat>
int reshape_and_cache(const void* key, const void* value, void* key_cache, void* value_cache,
                      const int64_t* slots, const float* k_scale, const float* v_scale, int64_t num_tokens,
                      int num_kv_heads, int head_size, int num_blocks, int block_size, bool k_per_head,
                      bool v_per_head, uint16_t* k_scale_cache, uint16_t* v_scale_cache) {
  int flag = 0;
  ReshapeAndCacheArgs<scalar_t, cache_t> a{};
  a.key = static_cast<const scalar_t*>(key);
  a.value = static_cast<const scalar_t*>(value);
  a.key_cache = static_cast<cache_t*>(key_cache);
  a.value_cache = static_cast<cache_t*>(value_cache);
  a.slot_mapping = slots;
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  a.k_scale_cache = k_scale_cache;
  a.v_scale_cache = v_scale_cache;
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

// A paged_attention call on dense buffers (the test passes contiguous tensors), as the binding builds it, with
// room for the partials.
struct AttentionCall {
  AttentionParams params{};
  std::vector<float> partial_out, partial_max, partial_sum;
  int flag = 0;

  AttentionCall(DType dtype, DType cache, void* out, const void* query, const void* key_cache,
                const void* value_cache, const int* block_tables, const int* seq_lens, const float* alibi,
                const float* k_scale, const float* v_scale, int num_seqs, int num_heads, int num_kv_heads,
                int head_size, int num_blocks, int block_size, int max_blocks_per_seq, int max_seq_len,
                float scale, bool k_per_head, bool v_per_head, int sliding_window, float softcap,
                const float* sinks, const uint16_t* k_scale_cache, const uint16_t* v_scale_cache) {
    AttentionParams& p = params;
    p.k_scale_cache = k_scale_cache;
    p.v_scale_cache = v_scale_cache;
    p.sliding_window = sliding_window;
    p.softcap = softcap;
    p.sinks = sinks;
    // As the binding plans: a sliding window's positions at most.
    const int plan_len = sliding_window > 0 ? std::min(max_seq_len, sliding_window + kWindowAlign) : max_seq_len;
    p.out = out;
    p.out_dtype = p.query_dtype = dtype;
    p.query = query;
    p.query_seq_stride = int64_t(num_heads) * head_size;
    p.query_head_stride = head_size;
    p.seq_lens = seq_lens;
    p.alibi_slopes = alibi;
    p.k_scale = k_scale;
    p.v_scale = v_scale;
    p.k_scale_per_head = k_per_head;
    p.v_scale_per_head = v_per_head;
    p.error_flag = &flag;
    p.num_seqs = num_seqs;
    p.num_heads = num_heads;
    p.num_kv_heads = num_kv_heads;
    p.head_size = head_size;
    p.max_seq_len = max_seq_len;
    p.scale = scale;
    p.paged = cache_ref(key_cache, value_cache, cache, block_tables, max_blocks_per_seq, num_blocks, block_size,
                        num_kv_heads, head_size);
    const int group = num_heads / num_kv_heads;
    const TcPlan tc = tc_plan(cache, head_size, group, dtype == DType::kF32, kEmulatedSmemPerSm, kEmulatedSmemPerBlock);
    p.tensor_cores = emulated_tensor_cores && tc.stages > 0;
    if (p.tensor_cores) {  // as the binding plans it (torch_bindings_cuda.cu)
      p.tc_stages = tc.stages;
      p.tc_smem_bytes = tc.smem_bytes;
      p.paged_splits = tc_splits(num_seqs, num_kv_heads * tc_head_blocks(group, head_size), plan_len,
                                 emulated_sm_count, tc.blocks_per_sm);
    } else {
      p.paged_splits = attention_splits(num_seqs, kv_blocks(), plan_len, emulated_sm_count);
    }
  }

  int kv_blocks() const {
    return params.num_kv_heads * head_blocks_for(params.num_heads / params.num_kv_heads, params.head_size);
  }

  static CacheRef cache_ref(const void* key, const void* value, DType dtype, const int* tables, int width,
                            int num_blocks, int block_size, int num_kv_heads, int head_size) {
    CacheRef c{};
    c.key = key;
    c.value = value;
    c.dtype = dtype;
    c.block_tables = tables;
    c.table_stride = c.table_width = width;
    c.num_blocks = num_blocks;
    c.block_size = block_size;
    while ((1 << c.block_shift) < block_size) ++c.block_shift;
    c.key_head_stride = c.value_head_stride = int64_t(head_size) * block_size;
    c.key_block_stride = c.value_block_stride = c.key_head_stride * num_kv_heads;
    return c;
  }

  void allocate_partials(int splits) {
    AttentionParams& p = params;
    const size_t rows = size_t(p.num_seqs) * p.num_heads * splits;
    // NaN, as uninitialized GPU memory may hold: the merge must not read partials nobody wrote.
    partial_out.assign(rows * p.head_size, NAN);
    partial_max.assign(rows, NAN);
    partial_sum.assign(rows, NAN);
    p.partial_out = partial_out.data();
    p.partial_max = partial_max.data();
    p.partial_sum = partial_sum.data();
  }
};

// As launch_source in attention_launch.cuh: the kernel body over (KV head blocks, sequences, splits).
template <class Src>
void run_source(const AttentionParams& p, int splits) {
  const int group = p.num_heads / p.num_kv_heads;
  with_attention_shape(p.head_size, group, [&](auto chunks, auto heads) {
    constexpr int kChunks = decltype(chunks)::value, kHeads = decltype(heads)::value;
    auto shared = std::make_unique<AttentionSmem<kHeads, kChunks * 16>>();
    run_grid(
        p.num_kv_heads * head_blocks_for(group, p.head_size), p.num_seqs, splits, kAttentionThreads,
        [&](const HostThread& th) { attention_body<Src, kChunks, kHeads>(p, *shared, th); },
        [&] { poison(*shared); });
  });
}

// As launch_tc: the tensor-core kernel body over (KV head blocks, sequences, splits).
template <typename cache_t, Fp8Format kFormat>
void run_tc(const AttentionParams& p, int splits) {
  const int group = p.num_heads / p.num_kv_heads;
  with_tc_config<cache_t, kFormat>(p.head_size, group, p.query_dtype == DType::kF32, [&](auto config) {
    using Cfg = decltype(config);
    std::vector<uint8_t> shared(static_cast<size_t>(p.tc_smem_bytes));
    run_grid(
        p.num_kv_heads * tc_head_blocks(group, p.head_size), p.num_seqs, splits, kTcThreads,
        [&](const HostThread& th) { tc_attention_body<Cfg>(p, shared.data(), th); },
        [&] { std::memset(shared.data(), 0xFF, shared.size()); });
  });
}

// The paged source's kernel: tensor cores where the call was planned for them.
template <class Src>
void run_paged(const AttentionParams& p, int splits) {
  using cache_t = typename Src::Cache;
  if constexpr (!std::is_same_v<cache_t, float>) {
    if (p.tensor_cores) return run_tc<cache_t, Src::kFmt>(p, splits);
  }
  run_source<Src>(p, splits);
}

void run_reduce(const AttentionParams& p) {
  auto shared = std::make_unique<ReduceSmem>();
  run_grid(
      p.num_heads, p.num_seqs, 1, kAttentionThreads,
      [&](const HostThread& th) { attention_reduce_body(p, *shared, th); }, [&] { poison(*shared); });
}

template <class Fn>
void with_paged(DType dtype, const Fn& fn) {
  switch (dtype) {
    case DType::kF32: return fn(PagedSource<float, Fp8Format::E4M3FN>{});
    case DType::kF16: return fn(PagedSource<half_t, Fp8Format::E4M3FN>{});
    case DType::kBF16: return fn(PagedSource<bf16_t, Fp8Format::E4M3FN>{});
    case DType::kE4M3FN: return fn(PagedSource<uint8_t, Fp8Format::E4M3FN>{});
    case DType::kE5M2: return fn(PagedSource<uint8_t, Fp8Format::E5M2>{});
    case DType::kE4M3FNUZ: return fn(PagedSource<uint8_t, Fp8Format::E4M3FNUZ>{});
  }
}

template <class Fn>
void with_ring(DType dtype, const Fn& fn) {
  switch (dtype) {
    case DType::kF32: return fn(RingSource<float>{});
    case DType::kF16: return fn(RingSource<half_t>{});
    default: return fn(RingSource<bf16_t>{});
  }
}

int paged_attention(DType dtype, DType cache, void* out, const void* query, const void* key_cache,
                    const void* value_cache, const int* block_tables, const int* seq_lens, const float* alibi,
                    const float* k_scale, const float* v_scale, int num_seqs, int num_heads, int num_kv_heads,
                    int head_size, int num_blocks, int block_size, int max_blocks_per_seq, int max_seq_len,
                    float scale, bool k_per_head, bool v_per_head, int sliding_window, float softcap,
                    const float* sinks, const uint16_t* k_scale_cache, const uint16_t* v_scale_cache) {
  AttentionCall call(dtype, cache, out, query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale,
                     v_scale, num_seqs, num_heads, num_kv_heads, head_size, num_blocks, block_size,
                     max_blocks_per_seq, max_seq_len, scale, k_per_head, v_per_head, sliding_window, softcap, sinks,
                     k_scale_cache, v_scale_cache);
  const AttentionParams& p = call.params;
  const bool reduce = p.paged_splits > 1 || p.sinks != nullptr;  // as launch_paged_attention
  if (reduce) call.allocate_partials(p.paged_splits);
  with_paged(cache, [&](auto src) { run_paged<decltype(src)>(p, p.paged_splits); });
  if (reduce) run_reduce(p);
  return call.flag;
}

int paged_attention_window(DType dtype, DType cache, DType window, void* out, const void* query,
                           const void* key_cache, const void* value_cache, const void* window_key_cache,
                           const void* window_value_cache, const int* block_tables, const int* window_block_tables,
                           const int* seq_lens, const int* window_starts, const float* alibi, const float* k_scale,
                           const float* v_scale, int num_seqs, int num_heads, int num_kv_heads, int head_size,
                           int num_blocks, int num_window_blocks, int block_size, int max_blocks_per_seq,
                           int max_window_blocks_per_seq, int window_size, int max_seq_len, float scale,
                           bool k_per_head, bool v_per_head, int sliding_window, float softcap,
                           const float* sinks, const uint16_t* k_scale_cache, const uint16_t* v_scale_cache,
                           int window_sinks) {
  AttentionCall call(dtype, cache, out, query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale,
                     v_scale, num_seqs, num_heads, num_kv_heads, head_size, num_blocks, block_size,
                     max_blocks_per_seq, max_seq_len, scale, k_per_head, v_per_head, sliding_window, softcap, sinks,
                     k_scale_cache, v_scale_cache);
  AttentionParams& p = call.params;
  p.window_starts = window_starts;
  p.window_size = window_size;
  p.window_sinks = window_sinks;
  p.ring = AttentionCall::cache_ref(window_key_cache, window_value_cache, window, window_block_tables,
                                    max_window_blocks_per_seq, num_window_blocks, block_size, num_kv_heads,
                                    head_size);
  // As the binding plans: the ring's splits cover its sinks and recent positions.
  p.ring_splits = attention_splits(num_seqs, call.kv_blocks(),
                                   std::max(1, std::min(window_sinks + window_size, max_seq_len)), emulated_sm_count);
  call.allocate_partials(p.paged_splits + p.ring_splits);
  with_paged(cache, [&](auto src) { run_paged<decltype(src)>(p, p.paged_splits); });
  with_ring(window, [&](auto src) { run_source<decltype(src)>(p, p.ring_splits); });
  run_reduce(p);
  return call.flag;
}

DType model_dtype_code(int dtype) {
  return dtype == 0 ? DType::kF32 : dtype == 1 ? DType::kF16 : DType::kBF16;
}

// format: a fp8kv::KVFormat code, as the ops take it (AUTO: the model dtype).
DType cache_dtype_code(int dtype, int format) {
  switch (static_cast<KVFormat>(format)) {
    case KVFormat::E4M3FN: return DType::kE4M3FN;
    case KVFormat::E5M2: return DType::kE5M2;
    case KVFormat::E4M3FNUZ: return DType::kE4M3FNUZ;
    default: return model_dtype_code(dtype);
  }
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

// dtype as above, format a KVFormat code; fn(scalar, cache element, Fp8Format constant).
template <class Fn>
int with_types(int dtype, int format, const Fn& fn) {
  const auto by_format = [&](auto scalar) {
    using S = decltype(scalar);
    if (!fp8kv::is_kv_format_code(format)) return -1;
    switch (static_cast<KVFormat>(format)) {
      case KVFormat::AUTO: return fn(S{}, S{}, std::integral_constant<Fp8Format, Fp8Format::E4M3FN>{});
      case KVFormat::E4M3FN: return fn(S{}, uint8_t{}, std::integral_constant<Fp8Format, Fp8Format::E4M3FN>{});
      case KVFormat::E5M2: return fn(S{}, uint8_t{}, std::integral_constant<Fp8Format, Fp8Format::E5M2>{});
      case KVFormat::E4M3FNUZ: return fn(S{}, uint8_t{}, std::integral_constant<Fp8Format, Fp8Format::E4M3FNUZ>{});
    }
    return -1;
  };
  return with_dtype(dtype, by_format);
}

}  // namespace
}  // namespace fp8kv::gpu

extern "C" {

int fp8kv_emu_reshape_and_cache(int dtype, int format, const void* key, const void* value, void* key_cache,
                                void* value_cache, const int64_t* slots, const float* k_scale,
                                const float* v_scale, int64_t num_tokens, int num_kv_heads, int head_size,
                                int num_blocks, int block_size, int k_per_head, int v_per_head,
                                uint16_t* k_scale_cache, uint16_t* v_scale_cache) {
  using namespace fp8kv::gpu;
  return with_types(dtype, format, [&](auto scalar, auto cache, auto fmt) {
    return reshape_and_cache<decltype(scalar), decltype(cache), decltype(fmt)::value>(
        key, value, key_cache, value_cache, slots, k_scale, v_scale, num_tokens, num_kv_heads, head_size,
        num_blocks, block_size, k_per_head != 0, v_per_head != 0, k_scale_cache, v_scale_cache);
  });
}

int fp8kv_emu_paged_attention(int dtype, int format, void* out, const void* query, const void* key_cache,
                              const void* value_cache, const int* block_tables, const int* seq_lens,
                              const float* alibi, const float* k_scale, const float* v_scale, int num_seqs,
                              int num_heads, int num_kv_heads, int head_size, int num_blocks, int block_size,
                              int max_blocks_per_seq, int max_seq_len, float scale, int k_per_head,
                              int v_per_head, int sliding_window, float softcap, const float* sinks,
                              const uint16_t* k_scale_cache, const uint16_t* v_scale_cache) {
  using namespace fp8kv::gpu;
  if (dtype < 0 || dtype > 2 || !fp8kv::is_kv_format_code(format)) return -1;
  return paged_attention(model_dtype_code(dtype), cache_dtype_code(dtype, format), out, query, key_cache,
                         value_cache, block_tables, seq_lens, alibi, k_scale, v_scale, num_seqs, num_heads,
                         num_kv_heads, head_size, num_blocks, block_size, max_blocks_per_seq, max_seq_len, scale,
                         k_per_head != 0, v_per_head != 0, sliding_window, softcap, sinks, k_scale_cache,
                         v_scale_cache);
}

// window_dtype: the window cache's, coded as dtype; window_sinks: the ring's seats for positions [0, S), as the op
// takes it (-1 when negative, which the binding refuses).
int fp8kv_emu_paged_attention_window(int dtype, int format, int window_dtype, void* out, const void* query,
                                     const void* key_cache, const void* value_cache,
                                     const void* window_key_cache, const void* window_value_cache,
                                     const int* block_tables, const int* window_block_tables,
                                     const int* seq_lens, const int* window_starts, const float* alibi,
                                     const float* k_scale, const float* v_scale, int num_seqs, int num_heads,
                                     int num_kv_heads, int head_size, int num_blocks, int num_window_blocks,
                                     int block_size, int max_blocks_per_seq, int max_window_blocks_per_seq,
                                     int window_size, int max_seq_len, float scale, int k_per_head,
                                     int v_per_head, int sliding_window, float softcap, const float* sinks,
                                     const uint16_t* k_scale_cache, const uint16_t* v_scale_cache,
                                     int window_sinks) {
  using namespace fp8kv::gpu;
  if (dtype < 0 || dtype > 2 || !fp8kv::is_kv_format_code(format) || window_dtype < 0 || window_dtype > 2) return -1;
  if (window_sinks < 0) return -1;
  return paged_attention_window(model_dtype_code(dtype), cache_dtype_code(dtype, format),
                                model_dtype_code(window_dtype), out, query, key_cache, value_cache,
                                window_key_cache, window_value_cache, block_tables, window_block_tables, seq_lens,
                                window_starts, alibi, k_scale, v_scale, num_seqs, num_heads, num_kv_heads,
                                head_size, num_blocks, num_window_blocks, block_size, max_blocks_per_seq,
                                max_window_blocks_per_seq, window_size, max_seq_len, scale, k_per_head != 0,
                                v_per_head != 0, sliding_window, softcap, sinks, k_scale_cache, v_scale_cache,
                                window_sinks);
}

// Whether the emulated calls run paged FP8 and 16-bit caches on the tensor-core kernel (1, the default) or the
// CUDA-core one (0); returns the previous setting.
int fp8kv_emu_set_tensor_cores(int on) {
  const bool previous = fp8kv::gpu::emulated_tensor_cores;
  fp8kv::gpu::emulated_tensor_cores = on != 0;
  return previous ? 1 : 0;
}

// The tensor-core plan of a call's shapes on the emulated GPU (at a pipeline depth asked for, 0: the plan's
// own): out = {stages (0: not possible), shared memory bytes, blocks per SM, splits, bytes a warp's stage holds}.
void fp8kv_emu_tc_plan(int dtype, int format, int head_size, int group, int num_seqs, int num_kv_heads,
                       int max_seq_len, int stages_wanted, int* out) {
  using namespace fp8kv::gpu;
  const DType cache = cache_dtype_code(dtype, format);
  const TcPlan plan = tc_plan(cache, head_size, group, dtype == 0, kEmulatedSmemPerSm, kEmulatedSmemPerBlock,
                              stages_wanted);
  out[0] = plan.stages;
  out[1] = plan.smem_bytes;
  out[2] = plan.blocks_per_sm;
  out[3] = plan.stages > 0 ? tc_splits(num_seqs, num_kv_heads * tc_head_blocks(group, head_size), max_seq_len,
                                       emulated_sm_count, plan.blocks_per_sm)
                           : 0;
  const int elem = cache == DType::kF16 || cache == DType::kBF16 ? 2 : 1;
  out[4] = plan.stages > 0 ? tc_stage_bytes(elem, tc_dims(head_size)) : 0;
}

// The multiprocessor count the emulated calls choose their splits for; returns the previous one.
int fp8kv_emu_set_sm_count(int count) {
  const int previous = fp8kv::gpu::emulated_sm_count;
  fp8kv::gpu::emulated_sm_count = count > 0 ? count : 1;
  return previous;
}

// The emulated block itself: `threads` GPU threads each write their index, pass the block's barrier (all but
// `skipping`, which returns before it: on a GPU, undefined behaviour; here a deadlock report and abort), then add
// up what every thread wrote. Returns the number of threads whose sum was the full one.
int fp8kv_emu_barrier_check(int threads, int skipping) {
  using namespace fp8kv::gpu;
  std::vector<int> written(threads, -1);
  int full = 0;
  run_grid(1, 1, 1, threads, [&](const HostThread& th) {
    written[th.index()] = th.index();
    if (th.index() == skipping) return;
    th.sync();
    long sum = 0;
    for (int v : written) sum += v;
    if (sum == static_cast<long>(threads) * (threads - 1) / 2) ++full;  // fibers share one OS thread
  });
  return full;
}

}  // extern "C"
