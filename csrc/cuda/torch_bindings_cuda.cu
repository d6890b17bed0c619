// CUDA (and, through torch's hipify, ROCm) kernels of torch.ops.fp8kv: argument checks, then a launch of the
// torch-free kernels of kernels_*.cu. Schemas: ../torch_bindings.cpp.
//
// quantize_fp8 / dequantize_fp8 have no GPU kernels here (they are tools for tests and scale files).
//
// Out-of-range slots and block ids: the kernels skip them and set a bit in a device flag. By default the flag
// is a fresh tensor read back and raised as an error after the launch (a host sync). An engine that must not
// wait on every call (a decode step, a CUDA graph) hands the ops its own flag with
// torch.ops.fp8kv.set_gpu_error_flag(flag): the kernels then set bits in it and nothing is read; the engine
// reads it at a sync it has anyway (fp8cache/model/runner.py).
#include "launch.h"  // first: under hipcc the HIP runtime must come before common/fp8.h
#include "layer_kernels.cuh"
#include "../op_signatures.h"
#include "../scale_cache_checks.h"

#include <algorithm>
#include <cstdlib>
#include <array>
#include <mutex>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../dispatch.h"
#include "torch_types.cuh"

namespace fp8kv::gpu {
namespace {

void check_model_dtype(const at::Tensor& t, const char* name) {
  const auto d = t.scalar_type();
  TORCH_CHECK(d == at::kFloat || d == at::kBFloat16 || d == at::kHalf, name,
              " must be float32, bfloat16 or float16, got ", d);
}

void check_on(const at::Tensor& t, const at::Device& device, const char* name) {
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), " but the caches are on ", device,
              "; move it with .to(", device, ")");
}

void check_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must start on a 16-byte boundary (the kernels load 16 bytes at a time); allocate it with "
              "ops.allocate_kv_cache");
}

struct Geometry {
  int64_t num_blocks, num_kv_heads, head_size, block_size;
};

// `what` names the pair in messages: "" for key_cache / value_cache, "window_" for the window caches.
Geometry check_caches(const at::Tensor& key_cache, const at::Tensor& value_cache, KVFormat format,
                      const std::string& what = "") {
  const std::string k = what + "key_cache", v = what + "value_cache";
  TORCH_CHECK(key_cache.dim() == 5, k, " must be [num_blocks, num_kv_heads, head_size // x, block_size, x], ",
              "got shape ", key_cache.sizes());
  TORCH_CHECK(value_cache.dim() == 4, v, " must be [num_blocks, num_kv_heads, head_size, block_size], ",
              "got shape ", value_cache.sizes());
  TORCH_CHECK(key_cache.is_cuda(), k, " is on ", key_cache.device(), "; the CUDA ops need GPU caches");
  check_on(value_cache, key_cache.device(), v.c_str());
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), k, " and ", v,
              " must be contiguous (allocate them with ops.allocate_kv_cache)");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), k, " and ", v, " dtypes differ: ",
              key_cache.scalar_type(), " vs ", value_cache.scalar_type());
  if (format == KVFormat::AUTO) {
    check_model_dtype(key_cache, ("an 'auto' " + k).c_str());
  } else {
    TORCH_CHECK(key_cache.scalar_type() == at::kByte, "kv_cache_dtype '", kv_format_name(format),
                "' stores uint8 caches, got ", key_cache.scalar_type(),
                "; allocate them with ops.allocate_kv_cache(..., kv_cache_dtype, ...)");
  }
  const int64_t x = 16 / static_cast<int64_t>(key_cache.element_size());
  const Geometry g{key_cache.size(0), key_cache.size(1), value_cache.size(2), key_cache.size(3)};
  TORCH_CHECK(key_cache.size(4) == x, k, "'s last dimension must be x = 16 // element_size = ", x, ", got ",
              key_cache.size(4));
  TORCH_CHECK(key_cache.size(2) * x == g.head_size, k, " head_size // x = ", key_cache.size(2),
              " does not match ", v, " head_size ", g.head_size);
  TORCH_CHECK(value_cache.size(0) == g.num_blocks && value_cache.size(1) == g.num_kv_heads &&
                  value_cache.size(3) == g.block_size,
              k, " ", key_cache.sizes(), " and ", v, " ", value_cache.sizes(), " do not match");
  check_aligned(key_cache, k.c_str());
  check_aligned(value_cache, v.c_str());
  return g;
}

at::Tensor check_scale(const at::Tensor& scale, const Geometry& g, const at::Device& device,
                       const char* name) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat, name, " must be a float32 tensor, got ",
              scale.scalar_type());
  TORCH_CHECK(scale.numel() == 1 || scale.numel() == g.num_kv_heads, name, " must have 1 or ", g.num_kv_heads,
              " (one per KV head) elements, got shape ", scale.sizes());
  check_on(scale, device, name);
  return scale.contiguous();
}

// Flags handed over with set_gpu_error_flag, per device index (see the top of this file).
constexpr int kMaxDevices = 64;
std::mutex deferred_mutex;
std::array<at::Tensor, kMaxDevices> deferred_flags;

at::Tensor deferred_flag(const at::Device& device) {
  const std::lock_guard<std::mutex> lock(deferred_mutex);
  const int index = device.has_index() ? device.index() : 0;
  return index < kMaxDevices ? deferred_flags[index] : at::Tensor();
}

void set_gpu_error_flag(const std::optional<at::Tensor>& flag) {
  const std::lock_guard<std::mutex> lock(deferred_mutex);
  if (!flag.has_value()) {
    for (auto& f : deferred_flags) f = at::Tensor();
    return;
  }
  TORCH_CHECK(flag->is_cuda() && flag->scalar_type() == at::kInt && flag->numel() == 1 && flag->is_contiguous(),
              "set_gpu_error_flag takes an int32 GPU tensor of one element (or None to read errors per call)");
  TORCH_CHECK(flag->get_device() < kMaxDevices, "device index ", flag->get_device(), " is too large");
  deferred_flags[flag->get_device()] = *flag;
}

// The flag a call's kernels report into: the engine's (deferred) or a new one this call reads back.
struct ErrorFlag {
  at::Tensor tensor;
  bool deferred;
};

ErrorFlag new_error_flag(const at::Device& device) {
  at::Tensor deferred = deferred_flag(device);
  if (deferred.defined()) return {deferred, true};
  return {at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device)), false};
}

// The error bits the kernels reported (see the top of this file); 0 for a deferred flag and while a CUDA
// graph is being captured. Otherwise blocks until the kernels are done.
int reported_errors(const ErrorFlag& flag) {
  if (flag.deferred) return 0;
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return 0;
  return flag.tensor.item<int>();
}

// What the attention plans need of a device, asked once.
struct DeviceInfo {
  int sm_count = 0;
  bool tensor_cores = false;  // mma.m16n8k16 and cp.async: sm_80+ (never under ROCm: HIP runs the CUDA-core kernel)
  int smem_per_sm = 0, smem_per_block = 0;  // bytes of shared memory an SM has, and a block may ask for
};

const DeviceInfo& device_info(const at::Device& device) {
  static std::array<DeviceInfo, kMaxDevices> infos{};
  static std::mutex mutex;
  const int index = device.has_index() ? device.index() : 0;
  static const DeviceInfo fallback{132, false, 0, 0};
  if (index >= kMaxDevices) return fallback;
  std::lock_guard<std::mutex> lock(mutex);
  DeviceInfo& info = infos[index];
  if (info.sm_count == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, index));
#if !defined(USE_ROCM)
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, index));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, index));
    info.tensor_cores = major >= 8;
#endif
    info.sm_count = n > 0 ? n : 1;
  }
  return info;
}

int sm_count(const at::Device& device) { return device_info(device).sm_count; }

// FP8KV_TC_STAGES=2..4 fixes the tensor-core kernel's pipeline depth (within what shared memory allows), for
// measuring the plan's choice against the others; read once.
int tc_stages_override() {
  static const int stages = [] {
    const char* value = std::getenv("FP8KV_TC_STAGES");
    const int n = value != nullptr ? std::atoi(value) : 0;
    return n >= 2 && n <= 4 ? n : 0;
  }();
  return stages;
}

// FP8KV_TC_SPLITS=N fixes the tensor-core kernel's splits per (sequence, head block), within what a call's length
// allows (tc_splits_within), for measuring tc_splits' choice against the others; read once.
int tc_splits_override() {
  static const int splits = [] {
    const char* value = std::getenv("FP8KV_TC_SPLITS");
    const int n = value != nullptr ? std::atoi(value) : 0;
    return n > 0 ? n : 0;
  }();
  return splits;
}

void raise_reported_errors(int bits, const char* op, int64_t num_slots, int64_t num_blocks) {
  TORCH_CHECK(!(bits & kErrorSlotOutOfRange), op, ": slot_mapping holds a slot >= ", num_slots,
              " (num_blocks * block_size); negative slots mean padding. Those tokens were not written.");
  TORCH_CHECK(!(bits & kErrorBlockOutOfRange), op,
              ": block_tables holds a block id outside the cache's blocks [0, ", num_blocks,
              ") within seq_lens; those blocks were not read.");
  TORCH_CHECK(!(bits & kErrorSeqLenOutOfRange), op,
              ": seq_lens holds a length that is negative, larger than max_seq_len, or longer than a "
              "block_tables row holds; pass max_seq_len >= max(seq_lens) and enough block ids per row.");
}


// A tensor's data as the kernels' element type T (float, bf16_t or half_t: the same bits as torch's).
template <typename T>
T* data_of(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

template <typename scalar_t, typename cache_t, Fp8Format kFormat>
void run_reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slots, const Geometry& g,
                           const at::Tensor& k_scale, const at::Tensor& v_scale, const ScaleCaches& dyn,
                           const ErrorFlag& flag) {
  using S = kernel_t<scalar_t>;
  using C = kernel_t<cache_t>;
  ReshapeAndCacheArgs<S, C> a{};
  a.key = data_of<const S>(key);
  a.value = data_of<const S>(value);
  a.key_cache = data_of<C>(key_cache);
  a.value_cache = data_of<C>(value_cache);
  a.slot_mapping = slots.data_ptr<int64_t>();
  a.k_scale = k_scale.data_ptr<float>();
  a.v_scale = v_scale.data_ptr<float>();
  a.k_scale_cache = dyn.k;
  a.v_scale_cache = dyn.v;
  a.error_flag = flag.tensor.data_ptr<int>();
  a.num_tokens = key.size(0);
  a.num_kv_heads = static_cast<int>(g.num_kv_heads);
  a.head_size = static_cast<int>(g.head_size);
  a.block_size = static_cast<int>(g.block_size);
  a.num_slots = g.num_blocks * g.block_size;
  a.key_token_stride = key.stride(0);
  a.key_head_stride = key.stride(1);
  a.value_token_stride = value.stride(0);
  a.value_head_stride = value.stride(1);
  a.key_cache_block_stride = key_cache.stride(0);
  a.key_cache_head_stride = key_cache.stride(1);
  a.value_cache_block_stride = value_cache.stride(0);
  a.value_cache_head_stride = value_cache.stride(1);
  a.k_scale_per_head = k_scale.numel() > 1;
  a.v_scale_per_head = v_scale.numel() > 1;
  C10_CUDA_CHECK((launch_reshape_and_cache<S, C, kFormat>(a, c10::cuda::getCurrentCUDAStream())));
}


void reshape_and_cache(FP8KV_RESHAPE_AND_CACHE_PARAMS) {
  const KVFormat format = kv_format_from_code(kv_cache_format);
  const Geometry g = check_caches(key_cache, value_cache, format);
  const at::Device device = key_cache.device();
  const ScaleCaches dyn = check_scale_caches(k_scale_cache, v_scale_cache, g, format != KVFormat::AUTO, device);
  for (const auto& [t, name] : {std::pair{&key, "key"}, std::pair{&value, "value"}}) {
    TORCH_CHECK(t->dim() == 3 && t->size(1) == g.num_kv_heads && t->size(2) == g.head_size, name,
                " must be [num_tokens, num_kv_heads=", g.num_kv_heads, ", head_size=", g.head_size, "], got ",
                t->sizes());
    check_on(*t, device, name);
    check_model_dtype(*t, name);
  }
  TORCH_CHECK(value.size(0) == key.size(0), "key and value have different token counts: ", key.size(0),
              " vs ", value.size(0));
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key and value dtypes differ: ", key.scalar_type(),
              " vs ", value.scalar_type());
  TORCH_CHECK(key.size(0) <= INT32_MAX, "too many tokens in one call: ", key.size(0));
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
              "slot_mapping must be 1-D with one slot per token (", key.size(0), "), got shape ",
              slot_mapping.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt,
              "slot_mapping must be int64 (or int32), got ", slot_mapping.scalar_type());
  check_on(slot_mapping, device, "slot_mapping");
  const at::Tensor ks = check_scale(k_scale, g, device, "k_scale");
  const at::Tensor vs = check_scale(v_scale, g, device, "v_scale");

  const c10::cuda::OptionalCUDAGuard guard(device);
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  // Heads and head dims must be dense; tokens may be strided (e.g. K and V sliced out of one QKV tensor).
  // An auto cache stores its own dtype: convert first, rounding exactly like torch's .to().
  const auto dense = [&](const at::Tensor& t) {
    const at::Tensor c = format == KVFormat::AUTO ? t.to(key_cache.scalar_type()) : t;
    return c.stride(2) == 1 && c.stride(1) == g.head_size ? c : c.contiguous();
  };
  const at::Tensor k = dense(key), v = dense(value);
  const ErrorFlag flag = new_error_flag(device);
#define FP8KV_CALL(scalar_t, cache_t, kFormat)                                                          \
  run_reshape_and_cache<scalar_t, cache_t, fp8_format_of(kFormat)>(k, v, key_cache, value_cache, slots, g, \
                                                                   ks, vs, dyn, flag)
  FP8KV_DISPATCH_BY_KV_FORMAT(k.scalar_type(), format, FP8KV_CALL);
#undef FP8KV_CALL
  raise_reported_errors(reported_errors(flag), "reshape_and_cache", g.num_blocks * g.block_size,
                        g.num_blocks);
}

template <size_t N>
bool is_one_of(int64_t v, const int (&choices)[N]) {
  for (const int c : choices) {
    if (v == c) return true;
  }
  return false;
}

DType model_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kBFloat16: return DType::kBF16;
    default: return DType::kF16;
  }
}

DType cache_dtype(const at::Tensor& cache, KVFormat format) {
  switch (format) {
    case KVFormat::E4M3FN: return DType::kE4M3FN;
    case KVFormat::E5M2: return DType::kE5M2;
    case KVFormat::E4M3FNUZ: return DType::kE4M3FNUZ;
    default: return model_dtype(cache);
  }
}

int block_shift_of(int64_t block_size) {
  int shift = 0;
  while ((int64_t(1) << shift) < block_size) ++shift;
  return shift;
}

CacheRef cache_ref(const at::Tensor& key_cache, const at::Tensor& value_cache, const Geometry& g, DType dtype,
                   const at::Tensor& block_tables) {
  CacheRef c{};
  c.key = key_cache.data_ptr();
  c.value = value_cache.data_ptr();
  c.dtype = dtype;
  c.block_tables = block_tables.data_ptr<int>();
  c.table_stride = block_tables.stride(0);
  c.table_width = static_cast<int>(block_tables.size(1));
  c.num_blocks = static_cast<int>(g.num_blocks);
  c.block_size = static_cast<int>(g.block_size);
  c.block_shift = block_shift_of(g.block_size);
  c.key_block_stride = key_cache.stride(0);
  c.key_head_stride = key_cache.stride(1);
  c.value_block_stride = value_cache.stride(0);
  c.value_head_stride = value_cache.stride(1);
  return c;
}

// The checked arguments of paged_attention (and the paged part of paged_attention_window), dense where the
// kernels need it, and the tensors the launch's pointers point into (kept alive until the launch is queued).
struct AttentionCall {
  AttentionParams params{};
  at::Tensor out, result, query, block_tables, seq_lens, alibi, k_scale, v_scale;
  at::Tensor window_tables, window_starts, partial_out, partial_max, partial_sum, sinks;
  ErrorFlag flag;
  Geometry g;
};

// Checks a paged_attention call (or paged_attention_window's paged part) and plans its launch; the caller holds
// a guard on the caches' device.
AttentionCall attention_call(FP8KV_PAGED_ATTENTION_PARAMS) {
  const KVFormat format = kv_format_from_code(kv_cache_format);
  const Geometry g = check_caches(key_cache, value_cache, format);
  const ScaleCaches dyn = check_scale_caches(k_scale_cache, v_scale_cache, g, format != KVFormat::AUTO, key_cache.device());
  const at::Device device = key_cache.device();
  TORCH_CHECK(query.dim() == 3, "query must be [num_seqs, num_heads, head_size], got ", query.sizes());
  TORCH_CHECK(sliding_window >= 0, "sliding_window = ", sliding_window, " must be >= 0 (0: no sliding window)");
  TORCH_CHECK(std::isfinite(logit_softcap) && logit_softcap >= 0, "logit_softcap = ", logit_softcap,
              " must be a finite number >= 0 (0: no soft-capping)");
  check_model_dtype(query, "query");
  check_model_dtype(out, "out");
  TORCH_CHECK(out.sizes() == query.sizes(), "out ", out.sizes(), " must have the shape of query ",
              query.sizes());
  check_on(query, device, "query");
  check_on(out, device, "out");
  TORCH_CHECK(format != KVFormat::AUTO || key_cache.scalar_type() == query.scalar_type(),
              "an 'auto' cache holds the model dtype, but the cache is ", key_cache.scalar_type(),
              " and the query ", query.scalar_type(), "; allocate the cache with the query's dtype");
  TORCH_CHECK(num_kv_heads == g.num_kv_heads, "num_kv_heads = ", num_kv_heads, " but the cache has ",
              g.num_kv_heads, " KV heads");
  TORCH_CHECK(block_size == g.block_size, "block_size = ", block_size, " but the cache's block size is ",
              g.block_size);
  TORCH_CHECK(is_one_of(g.block_size, kSupportedBlockSizes), "block_size ", g.block_size,
              " is not supported by the GPU kernels; use 8, 16 or 32");
  TORCH_CHECK(query.size(2) == g.head_size, "query head_size ", query.size(2), " != cache head_size ",
              g.head_size);
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  // The tensor-core kernel (sm_80+: FP8 and 16-bit caches) or the CUDA-core one (float32 caches, ROCm, what
  // does not fit the device's shared memory).
  const DeviceInfo& info = device_info(device);
  const DType cache_type = cache_dtype(key_cache, format);
  const int group = static_cast<int>(num_heads / num_kv_heads);
  const TcPlan tc = info.tensor_cores && g.head_size <= kMaxHeadSize
                        ? tc_plan(cache_type, static_cast<int>(g.head_size), group, query.scalar_type() == at::kFloat,
                                  info.smem_per_sm, info.smem_per_block, tc_stages_override())
                        : TcPlan{};
  TORCH_CHECK(tc.stages > 0 || (g.head_size % 16 == 0 && g.head_size <= kMaxHeadSize), "head_size ", g.head_size,
              " is not supported by the GPU kernels here: they take multiples of 16 up to ", kMaxHeadSize,
              info.tensor_cores ? " (multiples of 8 with a 16-bit cache)" : "",
              "; serve this model on the CPU (--device cpu)");
  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
              "block_tables must be [num_seqs=", num_seqs, ", max_blocks], got ", block_tables.sizes());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt, "block_tables must be int32, got ",
              block_tables.scalar_type());
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs, "seq_lens must be [num_seqs=", num_seqs,
              "], got ", seq_lens.sizes());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt, "seq_lens must be int32, got ", seq_lens.scalar_type());
  check_on(block_tables, device, "block_tables");
  check_on(seq_lens, device, "seq_lens");
  TORCH_CHECK(max_seq_len >= 0 && max_seq_len <= INT32_MAX - kMaxSplitTokens, "max_seq_len = ", max_seq_len,
              " is out of range; pass max(seq_lens)");
  TORCH_CHECK(num_seqs <= 65535, "at most 65535 sequences per call, got ", num_seqs);
  TORCH_CHECK(g.num_blocks <= INT32_MAX, "too many cache blocks: ", g.num_blocks);
  AttentionCall call;
  call.g = g;
  call.k_scale = check_scale(k_scale, g, device, "k_scale");
  call.v_scale = check_scale(v_scale, g, device, "v_scale");
  if (alibi_slopes.has_value()) {
    TORCH_CHECK(alibi_slopes->numel() == num_heads, "alibi_slopes must have num_heads = ", num_heads,
                " elements, got shape ", alibi_slopes->sizes());
    check_on(*alibi_slopes, device, "alibi_slopes");
    call.alibi = alibi_slopes->to(at::kFloat).contiguous();
  }
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->numel() == num_heads, "sinks must have num_heads = ", num_heads, " values, got shape ",
                sinks->sizes());
    check_on(*sinks, device, "sinks");
    call.sinks = sinks->to(at::kFloat).contiguous();
  }
  call.out = out;
  call.query = query.stride(2) == 1 ? query : query.contiguous();
  const bool direct = out.is_contiguous();  // the kernels write any model dtype into a dense output
  call.result = direct ? out : at::empty(query.sizes(), out.options());
  call.block_tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  call.seq_lens = seq_lens.contiguous();
  call.flag = new_error_flag(device);

  AttentionParams& p = call.params;
  p.out = call.result.data_ptr();
  p.out_dtype = model_dtype(call.result);
  p.query = call.query.data_ptr();
  p.query_dtype = model_dtype(call.query);
  p.query_seq_stride = call.query.stride(0);
  p.query_head_stride = call.query.stride(1);
  p.seq_lens = call.seq_lens.data_ptr<int>();
  p.alibi_slopes = call.alibi.defined() ? call.alibi.data_ptr<float>() : nullptr;
  p.k_scale = call.k_scale.data_ptr<float>();
  p.v_scale = call.v_scale.data_ptr<float>();
  p.k_scale_per_head = call.k_scale.numel() > 1;
  p.v_scale_per_head = call.v_scale.numel() > 1;
  p.error_flag = call.flag.tensor.data_ptr<int>();
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.head_size = static_cast<int>(g.head_size);
  p.max_seq_len = static_cast<int>(max_seq_len);
  p.scale = static_cast<float>(scale);
  p.sliding_window = static_cast<int>(std::min<int64_t>(sliding_window, INT32_MAX));
  p.softcap = static_cast<float>(logit_softcap);
  p.sinks = call.sinks.defined() ? call.sinks.data_ptr<float>() : nullptr;
  p.k_scale_cache = dyn.k;
  p.v_scale_cache = dyn.v;
  p.paged = cache_ref(key_cache, value_cache, g, cache_type, call.block_tables);
  // The positions a split plan covers: a sliding window's, from its aligned start, at most.
  const int plan_len = p.sliding_window > 0 ? std::min<int64_t>(p.max_seq_len, int64_t(p.sliding_window) + kWindowAlign)
                                            : p.max_seq_len;
  p.tensor_cores = tc.stages > 0;
  if (p.tensor_cores) {
    p.tc_stages = tc.stages;
    p.tc_smem_bytes = tc.smem_bytes;
    p.paged_splits = tc_splits_override() > 0
                         ? tc_splits_within(tc_splits_override(), plan_len)
                         : tc_splits(p.num_seqs, p.num_kv_heads * tc_head_blocks(group, p.head_size), plan_len,
                                     info.sm_count, tc.blocks_per_sm);
  } else {
    p.paged_splits = attention_splits(p.num_seqs, p.num_kv_heads * head_blocks_for(group, p.head_size), plan_len,
                                      info.sm_count);
  }
  return call;
}

// Partials for `splits` per (sequence, head); they must outlive the launch call (the stream keeps their memory
// through the caching allocator).
void allocate_partials(AttentionCall& call, int splits) {
  AttentionParams& p = call.params;
  const auto f32 = call.query.options().dtype(at::kFloat);
  call.partial_out = at::empty({p.num_seqs, p.num_heads, splits, p.head_size}, f32);
  call.partial_max = at::empty({p.num_seqs, p.num_heads, splits}, f32);
  call.partial_sum = at::empty({p.num_seqs, p.num_heads, splits}, f32);
  p.partial_out = call.partial_out.data_ptr<float>();
  p.partial_max = call.partial_max.data_ptr<float>();
  p.partial_sum = call.partial_sum.data_ptr<float>();
}

// Copies the result into out if the kernels could not write it directly. Returns the reported error bits.
int finish_attention(const AttentionCall& call) {
  if (!call.result.is_same(call.out)) call.out.copy_(call.result);
  return reported_errors(call.flag);
}

void paged_attention(FP8KV_PAGED_ATTENTION_PARAMS) {
  const c10::cuda::OptionalCUDAGuard guard(key_cache.device());
  AttentionCall call = attention_call(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                                      block_size, max_seq_len, alibi_slopes, kv_cache_format, k_scale, v_scale,
                                      sliding_window, logit_softcap, sinks, k_scale_cache, v_scale_cache);
  // Sinks are merged by the reduce kernel, which reads partials even for one split.
  if (call.params.paged_splits > 1 || call.params.sinks != nullptr) allocate_partials(call, call.params.paged_splits);
  C10_CUDA_CHECK(launch_paged_attention(call.params, c10::cuda::getCurrentCUDAStream()));
  raise_reported_errors(finish_attention(call), "paged_attention", call.g.num_blocks * call.g.block_size,
                        call.g.num_blocks);
}

// ---- paged_attention_window -------------------------------------------------------------------------------

void add_window(AttentionCall& call, const at::Tensor& window_key_cache, const at::Tensor& window_value_cache,
                const at::Tensor& window_block_tables, const at::Tensor& window_starts, int64_t window_size,
                int64_t window_sinks) {
  const at::Device device = window_key_cache.device();
  AttentionParams& p = call.params;
  const int64_t num_seqs = p.num_seqs;
  check_model_dtype(window_key_cache, "window_key_cache");
  TORCH_CHECK(window_key_cache.device() == call.query.device(), "window_key_cache is on ", window_key_cache.device(),
              " but the caches are on ", call.query.device(), "; move it with .to(", call.query.device(), ")");
  const Geometry w = check_caches(window_key_cache, window_value_cache, KVFormat::AUTO, "window_");
  TORCH_CHECK(w.num_kv_heads == call.g.num_kv_heads && w.head_size == call.g.head_size &&
                  w.block_size == call.g.block_size,
              "the window cache ", window_key_cache.sizes(), " must have the cache's num_kv_heads = ",
              call.g.num_kv_heads, ", head_size = ", call.g.head_size, " and block_size = ", call.g.block_size);
  TORCH_CHECK(w.num_blocks <= INT32_MAX, "too many window cache blocks: ", w.num_blocks);
  TORCH_CHECK(window_block_tables.dim() == 2 && window_block_tables.size(0) == num_seqs,
              "window_block_tables must be [num_seqs=", num_seqs, ", max_blocks], got ",
              window_block_tables.sizes());
  TORCH_CHECK(window_block_tables.scalar_type() == at::kInt, "window_block_tables must be int32, got ",
              window_block_tables.scalar_type());
  TORCH_CHECK(window_starts.dim() == 1 && window_starts.size(0) == num_seqs,
              "window_starts must be [num_seqs=", num_seqs, "], got ", window_starts.sizes());
  TORCH_CHECK(window_starts.scalar_type() == at::kInt, "window_starts must be int32, got ",
              window_starts.scalar_type());
  check_on(window_block_tables, device, "window_block_tables");
  check_on(window_starts, device, "window_starts");
  // The ring's seats: the sinks' window_sinks, then window_size for the recent positions.
  const int64_t seats = window_sinks + window_size;
  const int64_t ring_blocks = (seats + w.block_size - 1) / w.block_size;
  TORCH_CHECK(window_block_tables.size(1) >= ring_blocks, "window_block_tables has ",
              window_block_tables.size(1), " columns but a ring of window_sinks + window_size = ", window_sinks,
              " + ", window_size, " seats needs ", ring_blocks, " blocks of ", w.block_size);
  call.window_tables = window_block_tables.stride(1) == 1 ? window_block_tables : window_block_tables.contiguous();
  call.window_starts = window_starts.contiguous();
  p.window_starts = call.window_starts.data_ptr<int>();
  p.window_size = static_cast<int>(window_size);
  p.window_sinks = static_cast<int>(window_sinks);
  p.ring = cache_ref(window_key_cache, window_value_cache, w, model_dtype(window_key_cache), call.window_tables);
  // The ring's splits cover its sinks and recent positions, at most window_sinks + window_size of them.
  const int longest = static_cast<int>(std::min<int64_t>(seats, p.max_seq_len));
  const int kv_blocks = p.num_kv_heads * head_blocks_for(p.num_heads / p.num_kv_heads, p.head_size);
  p.ring_splits = attention_splits(p.num_seqs, kv_blocks, std::max(longest, 1), sm_count(device));
  TORCH_CHECK(int64_t(p.paged_splits) + p.ring_splits <= kMaxSplits, "max_seq_len ", p.max_seq_len,
              " is too long for one call");
}

// Raises what the window kernels reported; names the first bad window_starts entry (read back here, on
// the error path only).
void raise_reported_window_errors(int bits, const AttentionCall& call) {
  if (bits & kErrorWindowStartOutOfRange) {
    const at::Tensor lens = call.seq_lens.cpu(), starts = call.window_starts.cpu();
    for (int64_t s = 0; s < lens.size(0); ++s) {
      const int64_t len = lens.data_ptr<int>()[s], start = starts.data_ptr<int>()[s];
      const int64_t lowest = std::max<int64_t>(0, len - call.params.window_size);
      TORCH_CHECK(lowest <= start && start <= len, "window_starts[", s, "] = ", start,
                  " must lie in [max(0, seq_lens[", s, "] - window_size), seq_lens[", s, "]] = [", lowest,
                  ", ", len, "]");
    }
  }
  TORCH_CHECK(!(bits & kErrorSeqLenOutOfRange),
              "paged_attention_window: seq_lens holds a length that is negative or larger than max_seq_len, "
              "or a block_tables row holds fewer than window_starts positions; pass max_seq_len >= "
              "max(seq_lens) and enough block ids per row.");
  TORCH_CHECK(!(bits & kErrorWindowStartOutOfRange),
              "paged_attention_window: window_starts must lie in [max(0, seq_lens - window_size), seq_lens]");
  TORCH_CHECK(!(bits & kErrorBlockOutOfRange),
              "paged_attention_window: block_tables holds a block id outside the cache's blocks [0, ",
              call.g.num_blocks, ") below window_starts; those blocks were not read.");
  TORCH_CHECK(!(bits & kErrorWindowBlockOutOfRange),
              "paged_attention_window: window_block_tables holds a block id outside the window cache's "
              "blocks [0, ", call.params.ring.num_blocks, ") for a ring seat of [window_starts, seq_lens) or of the sinks; those "
              "blocks were not read.");
}

void paged_attention_window(FP8KV_PAGED_ATTENTION_WINDOW_PARAMS) {
  TORCH_CHECK(window_size >= 1, "window_size = ", window_size,
              " must be >= 1; call paged_attention when there is no window");
  TORCH_CHECK(window_size <= INT32_MAX - kMaxSplitTokens, "window_size = ", window_size, " is too large");
  TORCH_CHECK(window_sinks >= 0, "window_sinks = ", window_sinks,
              " must be >= 0 (the first positions the window ring keeps; 0: none)");
  TORCH_CHECK(window_sinks <= INT32_MAX - kMaxSplitTokens - window_size, "window_sinks = ", window_sinks,
              " is too large");
  const c10::cuda::OptionalCUDAGuard guard(key_cache.device());
  AttentionCall call = attention_call(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                                      block_size, max_seq_len, alibi_slopes, kv_cache_format, k_scale, v_scale,
                                      sliding_window, logit_softcap, sinks, k_scale_cache, v_scale_cache);
  add_window(call, window_key_cache, window_value_cache, window_block_tables, window_starts, window_size,
             window_sinks);
  allocate_partials(call, call.params.paged_splits + call.params.ring_splits);
  C10_CUDA_CHECK(launch_paged_attention_window(call.params, c10::cuda::getCurrentCUDAStream()));
  raise_reported_window_errors(finish_attention(call), call);
}

// ---- decoder-layer elementwise ops ---------------------------------------------------------------------

// [rows, n] view of a tensor whose last dim is contiguous and whose other dims collapse to one row stride.
struct RowView {
  int64_t rows, n, stride;
};

RowView row_view(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be on a GPU, got ", t.device());
  check_model_dtype(t, name);
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, " must have a contiguous last dim, got strides ",
              t.strides());
  const int64_t n = t.size(-1);
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  // Rows are evenly spaced when every leading dim's stride is the next one's stride times its size.
  int64_t stride = t.dim() >= 2 ? t.stride(-2) : n;
  for (int64_t d = t.dim() - 3; d >= 0; --d) {
    TORCH_CHECK(t.stride(d) == t.stride(d + 1) * t.size(d + 1) || t.size(d) == 1, name,
                " must be [rows, n] with evenly spaced rows, got shape ", t.sizes(), " strides ", t.strides());
  }
  return {rows, n, stride};
}

void check_like(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name, " is on ", ref.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), name, " is ", t.scalar_type(), " but ", ref_name, " is ",
              ref.scalar_type());
}

// The one way the elementwise ops reach their kernels: on `like`'s device and current stream, `launch(T{},
// stream)` for the kernels' type T of its dtype fills the op's argument struct and launches it; an error is raised.
template <typename F>
void launch_elementwise(const at::Tensor& like, const F& launch) {
  const c10::cuda::OptionalCUDAGuard guard(like.device());
  const Stream stream = c10::cuda::getCurrentCUDAStream();
  switch (like.scalar_type()) {
    case at::kFloat: C10_CUDA_CHECK(launch(float{}, stream)); break;
    case at::kBFloat16: C10_CUDA_CHECK(launch(bf16_t{}, stream)); break;
    default: C10_CUDA_CHECK(launch(half_t{}, stream)); break;
  }
}

// The arguments RMSNorm's kernels share: `out` (the normalized rows, `o` its view), weight and epsilon.
template <typename T>
RowsArgs<T> norm_args(const at::Tensor& out, const RowView& o, const at::Tensor& weight, double epsilon) {
  RowsArgs<T> a{};
  a.out = data_of<T>(out);
  a.weight = data_of<const T>(weight);
  a.rows = o.rows;
  a.n = o.n;
  a.out_stride = o.stride;
  a.epsilon = static_cast<float>(epsilon);
  return a;
}

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  const RowView x = row_view(input, "input"), o = row_view(out, "out");
  check_like(out, "out", input, "input");
  check_like(weight, "weight", input, "input");
  TORCH_CHECK(o.rows == x.rows && o.n == x.n && weight.numel() == x.n && weight.is_contiguous(),
              "rms_norm: out ", out.sizes(), ", input ", input.sizes(), " and weight ", weight.sizes(), " differ");
  launch_elementwise(input, [&](auto type, Stream stream) {
    using T = decltype(type);
    RowsArgs<T> a = norm_args<T>(out, o, weight, epsilon);
    a.input = data_of<const T>(input);
    a.input_stride = x.stride;
    return launch_rms_norm(a, stream);
  });
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon) {
  const RowView x = row_view(input, "input"), r = row_view(residual, "residual");
  check_like(residual, "residual", input, "input");
  check_like(weight, "weight", input, "input");
  TORCH_CHECK(r.rows == x.rows && r.n == x.n && weight.numel() == x.n && weight.is_contiguous(),
              "fused_add_rms_norm: input ", input.sizes(), ", residual ", residual.sizes(), " and weight ",
              weight.sizes(), " differ");
  launch_elementwise(input, [&](auto type, Stream stream) {
    using T = decltype(type);
    RowsArgs<T> a = norm_args<T>(input, x, weight, epsilon);  // input is normalized in place
    a.residual = data_of<T>(residual);
    a.residual_stride = r.stride;
    return launch_fused_add_rms_norm(a, stream);
  });
}

void rotary_embedding_cos_sin(at::Tensor& query, at::Tensor& key, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.size(0) == key.size(0) && query.size(2) == key.size(2),
              "query and key must be [tokens, heads, head_size], got ", query.sizes(), " and ", key.sizes());
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1, "query and key need a contiguous last dim");
  const int64_t d = query.size(2);
  TORCH_CHECK(d % 2 == 0, "head_size ", d, " must be even for rotary embeddings");
  check_like(key, "key", query, "query");
  check_like(cos, "cos", query, "query");
  check_like(sin, "sin", query, "query");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == query.size(0) && cos.size(1) == d &&
                  sin.sizes() == cos.sizes() && cos.stride(1) == 1 && sin.stride(1) == 1,
              "cos and sin must be [tokens, head_size] with a contiguous last dim, got ", cos.sizes(), " and ",
              sin.sizes());
  launch_elementwise(query, [&](auto type, Stream stream) {
    using T = decltype(type);
    RotaryArgs<T> a{};
    a.query = data_of<T>(query);
    a.key = data_of<T>(key);
    a.cos = data_of<const T>(cos);
    a.sin = data_of<const T>(sin);
    a.tokens = query.size(0);
    a.heads = static_cast<int>(query.size(1));
    a.kv_heads = static_cast<int>(key.size(1));
    a.d = static_cast<int>(d);
    a.query_token_stride = query.stride(0);
    a.query_head_stride = query.stride(1);
    a.key_token_stride = key.stride(0);
    a.key_head_stride = key.stride(1);
    a.cos_stride = cos.stride(0);
    a.sin_stride = sin.stride(0);
    return launch_rotary(a, stream);
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& gate, const at::Tensor& up) {
  const RowView o = row_view(out, "out"), g = row_view(gate, "gate"), u = row_view(up, "up");
  check_like(gate, "gate", out, "out");
  check_like(up, "up", out, "out");
  TORCH_CHECK(o.rows == g.rows && o.rows == u.rows && o.n == g.n && o.n == u.n, "silu_and_mul: out ",
              out.sizes(), ", gate ", gate.sizes(), " and up ", up.sizes(), " differ");
  launch_elementwise(out, [&](auto type, Stream stream) {
    using T = decltype(type);
    SiluMulArgs<T> a{};
    a.out = data_of<T>(out);
    a.gate = data_of<const T>(gate);
    a.up = data_of<const T>(up);
    a.rows = o.rows;
    a.n = o.n;
    a.out_stride = o.stride;
    a.gate_stride = g.stride;
    a.up_stride = u.stride;
    return launch_silu_and_mul(a, stream);
  });
}

}  // namespace
}  // namespace fp8kv::gpu

TORCH_LIBRARY_FRAGMENT(fp8kv, m) {
  m.def("set_gpu_error_flag(Tensor? flag) -> ()", &fp8kv::gpu::set_gpu_error_flag);
}

TORCH_LIBRARY_IMPL(fp8kv, CUDA, m) {
#define FP8KV_IMPL(name) m.impl(#name, &fp8kv::gpu::name);
  FP8KV_FOR_EACH_BACKEND_OP(FP8KV_IMPL)
#undef FP8KV_IMPL
}
