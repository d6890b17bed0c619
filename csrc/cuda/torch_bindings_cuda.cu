// CUDA (and, through torch's hipify, ROCm) kernels of torch.ops.fp8kv: argument checks, then a launch of the
// torch-free kernels of kernels_instantiate.cu. Schemas: ../torch_bindings.cpp.
//
// quantize_fp8 / dequantize_fp8 have no GPU kernels here (they are tools for tests and scale files).
//
// Out-of-range slots and block ids: the kernels skip them and set a bit in a device flag, which is read back
// and raised as an error after the launch (a host sync). While a CUDA graph is being captured the flag
// cannot be read, so only the skipping protects the cache then.
#include "launch.h"  // first: under hipcc the HIP runtime must come before common/fp8.h

#include <algorithm>
#include <optional>
#include <string>

#include <ATen/ATen.h>
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

at::Tensor new_error_flag(const at::Device& device) {
  return at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device));
}

// The error bits the kernels reported (see the top of this file); 0 while a CUDA graph is being captured.
// Blocks until the kernels are done.
int reported_errors(const at::Tensor& flag) {
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return 0;
  return flag.item<int>();
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

template <typename scalar_t, typename cache_t, Fp8Format kFormat>
void run_reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slots, const Geometry& g,
                           const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& flag) {
  using S = kernel_t<scalar_t>;
  using C = kernel_t<cache_t>;
  ReshapeAndCacheArgs<S, C> a{};
  a.key = reinterpret_cast<const S*>(key.data_ptr());
  a.value = reinterpret_cast<const S*>(value.data_ptr());
  a.key_cache = reinterpret_cast<C*>(key_cache.data_ptr());
  a.value_cache = reinterpret_cast<C*>(value_cache.data_ptr());
  a.slot_mapping = slots.data_ptr<int64_t>();
  a.k_scale = k_scale.data_ptr<float>();
  a.v_scale = v_scale.data_ptr<float>();
  a.error_flag = flag.data_ptr<int>();
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

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                       const at::Tensor& v_scale) {
  const KVFormat format = parse_kv_cache_dtype(kv_cache_dtype, kDeviceDefaultFp8);
  const Geometry g = check_caches(key_cache, value_cache, format);
  const at::Device device = key_cache.device();
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
  const at::Tensor flag = new_error_flag(device);
#define FP8KV_CALL(scalar_t, cache_t, kFormat)                                                          \
  run_reshape_and_cache<scalar_t, cache_t, fp8_format_of(kFormat)>(k, v, key_cache, value_cache, slots, g, \
                                                                   ks, vs, flag)
  FP8KV_DISPATCH_BY_KV_CACHE_DTYPE(k.scalar_type(), kv_cache_dtype, FP8KV_CALL);
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

// The checked arguments of paged_attention (and the paged part of paged_attention_window), dense where the
// kernels need it.
struct AttentionInputs {
  at::Tensor out;     // the op's out
  at::Tensor result;  // what the kernels write: out itself, or a dense buffer in query's dtype copied into it
  at::Tensor query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale, v_scale, flag;
  Geometry g;
  double scale;
  int64_t max_seq_len;
};

AttentionInputs attention_inputs(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const Geometry& g, KVFormat format,
                                 int64_t num_kv_heads, double scale, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
                                 const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& k_scale,
                                 const at::Tensor& v_scale) {
  const at::Device device = key_cache.device();
  TORCH_CHECK(query.dim() == 3, "query must be [num_seqs, num_heads, head_size], got ", query.sizes());
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
  TORCH_CHECK(is_one_of(g.head_size, kSupportedHeadSizes), "head_size ", g.head_size,
              " is not supported by the GPU kernels; supported: 64, 80, 96, 112, 128, 256");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
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
  TORCH_CHECK(max_seq_len >= 0 && max_seq_len <= INT32_MAX - kPartitionSize, "max_seq_len = ", max_seq_len,
              " is out of range; pass max(seq_lens)");
  // Grid limits: y = sequences, z = partitions of max_seq_len.
  TORCH_CHECK(num_seqs <= 65535, "at most 65535 sequences per call, got ", num_seqs);
  TORCH_CHECK(num_partitions_for(static_cast<int>(max_seq_len)) <= 65535, "max_seq_len ", max_seq_len,
              " is too long for one call");
  TORCH_CHECK(g.num_blocks <= INT32_MAX, "too many cache blocks: ", g.num_blocks);
  AttentionInputs in;
  in.k_scale = check_scale(k_scale, g, device, "k_scale");
  in.v_scale = check_scale(v_scale, g, device, "v_scale");
  if (alibi_slopes.has_value()) {
    TORCH_CHECK(alibi_slopes->numel() == num_heads, "alibi_slopes must have num_heads = ", num_heads,
                " elements, got shape ", alibi_slopes->sizes());
    check_on(*alibi_slopes, device, "alibi_slopes");
    in.alibi = alibi_slopes->to(at::kFloat).contiguous();
  }
  in.out = out;
  in.query = query.stride(2) == 1 ? query : query.contiguous();
  // The kernels write the query's dtype into a dense [seq, head, dim] output.
  const bool direct = out.scalar_type() == query.scalar_type() && out.is_contiguous();
  in.result = direct ? out : at::empty(query.sizes(), query.options());
  in.key_cache = key_cache;
  in.value_cache = value_cache;
  in.block_tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  in.seq_lens = seq_lens.contiguous();
  in.flag = new_error_flag(device);
  in.g = g;
  in.scale = scale;
  in.max_seq_len = max_seq_len;
  return in;
}

// The float32 partial results of a launch with several partitions; they must outlive the launch call.
struct Partials {
  at::Tensor out, max, sum;
};

template <typename S, typename C>
PagedAttentionArgs<S, C> paged_attention_args(const AttentionInputs& in, int num_partitions,
                                              Partials& partials) {
  PagedAttentionArgs<S, C> a{};
  a.num_seqs = static_cast<int>(in.query.size(0));
  a.num_heads = static_cast<int>(in.query.size(1));
  a.num_kv_heads = static_cast<int>(in.g.num_kv_heads);
  a.head_size = static_cast<int>(in.g.head_size);
  a.block_size = static_cast<int>(in.g.block_size);
  a.num_blocks = static_cast<int>(in.g.num_blocks);
  a.max_blocks_per_seq = static_cast<int>(in.block_tables.size(1));
  a.max_seq_len = static_cast<int>(in.max_seq_len);
  a.num_partitions = num_partitions;
  a.scale = static_cast<float>(in.scale);
  if (num_partitions > 1) {
    const auto f32 = in.query.options().dtype(at::kFloat);
    partials.out = at::empty({a.num_seqs, a.num_heads, num_partitions, a.head_size}, f32);
    partials.max = at::empty({a.num_seqs, a.num_heads, num_partitions}, f32);
    partials.sum = at::empty({a.num_seqs, a.num_heads, num_partitions}, f32);
    a.partial_out = partials.out.data_ptr<float>();
    a.partial_max = partials.max.data_ptr<float>();
    a.partial_sum = partials.sum.data_ptr<float>();
  }
  a.out = reinterpret_cast<S*>(in.result.data_ptr());
  a.query = reinterpret_cast<const S*>(in.query.data_ptr());
  a.key_cache = reinterpret_cast<const C*>(in.key_cache.data_ptr());
  a.value_cache = reinterpret_cast<const C*>(in.value_cache.data_ptr());
  a.block_tables = in.block_tables.data_ptr<int>();
  a.seq_lens = in.seq_lens.data_ptr<int>();
  a.alibi_slopes = in.alibi.defined() ? in.alibi.data_ptr<float>() : nullptr;
  a.k_scale = in.k_scale.data_ptr<float>();
  a.v_scale = in.v_scale.data_ptr<float>();
  a.error_flag = in.flag.data_ptr<int>();
  a.query_seq_stride = in.query.stride(0);
  a.query_head_stride = in.query.stride(1);
  a.block_table_stride = in.block_tables.stride(0);
  a.key_cache_block_stride = in.key_cache.stride(0);
  a.key_cache_head_stride = in.key_cache.stride(1);
  a.value_cache_block_stride = in.value_cache.stride(0);
  a.value_cache_head_stride = in.value_cache.stride(1);
  a.k_scale_per_head = in.k_scale.numel() > 1;
  a.v_scale_per_head = in.v_scale.numel() > 1;
  return a;
}

// Copies the result into out if the kernels could not write it directly. Returns the reported error bits.
int finish_attention(const AttentionInputs& in) {
  if (!in.result.is_same(in.out)) in.out.copy_(in.result);
  return reported_errors(in.flag);
}

template <typename scalar_t, typename cache_t, Fp8Format kFormat>
void run_paged_attention(const AttentionInputs& in) {
  using S = kernel_t<scalar_t>;
  using C = kernel_t<cache_t>;
  Partials partials;
  const int num_partitions = num_partitions_for(static_cast<int>(in.max_seq_len));
  const auto a = paged_attention_args<S, C>(in, num_partitions, partials);
  C10_CUDA_CHECK((launch_paged_attention<S, C, kFormat>(a, c10::cuda::getCurrentCUDAStream())));
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                     int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                     const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                     const at::Tensor& v_scale) {
  const KVFormat format = parse_kv_cache_dtype(kv_cache_dtype, kDeviceDefaultFp8);
  const Geometry g = check_caches(key_cache, value_cache, format);
  const c10::cuda::OptionalCUDAGuard guard(key_cache.device());
  const AttentionInputs in = attention_inputs(out, query, key_cache, value_cache, g, format, num_kv_heads,
                                              scale, block_tables, seq_lens, block_size, max_seq_len,
                                              alibi_slopes, k_scale, v_scale);
#define FP8KV_CALL(scalar_t, cache_t, kFormat) \
  run_paged_attention<scalar_t, cache_t, fp8_format_of(kFormat)>(in)
  FP8KV_DISPATCH_BY_KV_CACHE_DTYPE(query.scalar_type(), kv_cache_dtype, FP8KV_CALL);
#undef FP8KV_CALL
  raise_reported_errors(finish_attention(in), "paged_attention", g.num_blocks * g.block_size, g.num_blocks);
}

// ---- paged_attention_window -------------------------------------------------------------------------------

// The checked window arguments (the window cache may hold another model dtype than the query).
struct WindowInputs {
  at::Tensor key_cache, value_cache, block_tables, starts;
  Geometry g;
  int64_t window_size;
};

WindowInputs window_inputs(const AttentionInputs& in, const at::Tensor& window_key_cache,
                           const at::Tensor& window_value_cache, const at::Tensor& window_block_tables,
                           const at::Tensor& window_starts, int64_t window_size) {
  const at::Device device = in.key_cache.device();
  const int64_t num_seqs = in.query.size(0);
  check_model_dtype(window_key_cache, "window_key_cache");
  TORCH_CHECK(window_key_cache.device() == device, "window_key_cache is on ", window_key_cache.device(),
              " but the caches are on ", device, "; move it with .to(", device, ")");
  const Geometry w = check_caches(window_key_cache, window_value_cache, KVFormat::AUTO, "window_");
  TORCH_CHECK(w.num_kv_heads == in.g.num_kv_heads && w.head_size == in.g.head_size &&
                  w.block_size == in.g.block_size,
              "the window cache ", window_key_cache.sizes(), " must have the cache's num_kv_heads = ",
              in.g.num_kv_heads, ", head_size = ", in.g.head_size, " and block_size = ", in.g.block_size);
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
  const int64_t ring_blocks = (window_size + w.block_size - 1) / w.block_size;
  TORCH_CHECK(window_block_tables.size(1) >= ring_blocks, "window_block_tables has ",
              window_block_tables.size(1), " columns but a ring of window_size = ", window_size, " needs ",
              ring_blocks);
  // Grid z: the paged partitions and the window's.
  const int max_seq_len = static_cast<int>(in.max_seq_len);
  const int window_partitions = num_window_partitions_for(static_cast<int>(window_size), max_seq_len);
  TORCH_CHECK(num_partitions_for(max_seq_len) + window_partitions <= 65535, "max_seq_len ", max_seq_len,
              " is too long for one call");
  WindowInputs win;
  win.key_cache = window_key_cache;
  win.value_cache = window_value_cache;
  win.block_tables =
      window_block_tables.stride(1) == 1 ? window_block_tables : window_block_tables.contiguous();
  win.starts = window_starts.contiguous();
  win.g = w;
  win.window_size = window_size;
  return win;
}

template <typename scalar_t, typename cache_t, Fp8Format kFormat, typename window_t>
void run_paged_attention_window(const AttentionInputs& in, const WindowInputs& win) {
  using S = kernel_t<scalar_t>;
  using C = kernel_t<cache_t>;
  using W = kernel_t<window_t>;
  const int max_seq_len = static_cast<int>(in.max_seq_len);
  const int window_size = static_cast<int>(win.window_size);
  PagedAttentionWindowArgs<S, C, W> a{};
  WindowPositions& positions = a.positions;
  positions.window_starts = win.starts.data_ptr<int>();
  positions.window_size = window_size;
  positions.num_fp8_partitions = num_partitions_for(max_seq_len);
  positions.num_window_partitions = num_window_partitions_for(window_size, max_seq_len);
  Partials partials;
  a.paged = paged_attention_args<S, C>(
      in, positions.num_fp8_partitions + positions.num_window_partitions, partials);
  WindowCache<W>& ring = a.window;
  ring.key_cache = reinterpret_cast<const W*>(win.key_cache.data_ptr());
  ring.value_cache = reinterpret_cast<const W*>(win.value_cache.data_ptr());
  ring.block_tables = win.block_tables.data_ptr<int>();
  ring.num_blocks = static_cast<int>(win.g.num_blocks);
  ring.block_table_stride = win.block_tables.stride(0);
  ring.key_block_stride = win.key_cache.stride(0);
  ring.key_head_stride = win.key_cache.stride(1);
  ring.value_block_stride = win.value_cache.stride(0);
  ring.value_head_stride = win.value_cache.stride(1);
  C10_CUDA_CHECK((launch_paged_attention_window<S, C, kFormat, W>(a, c10::cuda::getCurrentCUDAStream())));
}

template <typename scalar_t, typename cache_t, Fp8Format kFormat>
void run_paged_attention_window(const AttentionInputs& in, const WindowInputs& win) {
  switch (win.key_cache.scalar_type()) {
    case at::kFloat: return run_paged_attention_window<scalar_t, cache_t, kFormat, float>(in, win);
    case at::kHalf: return run_paged_attention_window<scalar_t, cache_t, kFormat, c10::Half>(in, win);
    case at::kBFloat16: return run_paged_attention_window<scalar_t, cache_t, kFormat, c10::BFloat16>(in, win);
    default: TORCH_CHECK(false, "window_key_cache must be float32, bfloat16 or float16");
  }
}

// Raises what the window kernels reported; names the first bad window_starts entry (read back here, on
// the error path only).
void raise_reported_window_errors(int bits, const AttentionInputs& in, const WindowInputs& win) {
  if (bits & kErrorWindowStartOutOfRange) {
    const at::Tensor lens = in.seq_lens.cpu(), starts = win.starts.cpu();
    for (int64_t s = 0; s < lens.size(0); ++s) {
      const int64_t len = lens.data_ptr<int>()[s], start = starts.data_ptr<int>()[s];
      const int64_t lowest = std::max<int64_t>(0, len - win.window_size);
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
              in.g.num_blocks, ") below window_starts; those blocks were not read.");
  TORCH_CHECK(!(bits & kErrorWindowBlockOutOfRange),
              "paged_attention_window: window_block_tables holds a block id outside the window cache's "
              "blocks [0, ", win.g.num_blocks, ") for a ring slot of [window_starts, seq_lens); those blocks "
              "were not read.");
}

void paged_attention_window(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& window_key_cache,
                            const at::Tensor& window_value_cache, int64_t num_kv_heads, double scale,
                            const at::Tensor& block_tables, const at::Tensor& window_block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& window_starts, int64_t window_size,
                            int64_t block_size, int64_t max_seq_len,
                            const std::optional<at::Tensor>& alibi_slopes, const std::string& kv_cache_dtype,
                            const at::Tensor& k_scale, const at::Tensor& v_scale) {
  TORCH_CHECK(window_size >= 1, "window_size = ", window_size,
              " must be >= 1; call paged_attention when there is no window");
  TORCH_CHECK(window_size <= INT32_MAX - kPartitionSize, "window_size = ", window_size, " is too large");
  const KVFormat format = parse_kv_cache_dtype(kv_cache_dtype, kDeviceDefaultFp8);
  const Geometry g = check_caches(key_cache, value_cache, format);
  const c10::cuda::OptionalCUDAGuard guard(key_cache.device());
  const AttentionInputs in = attention_inputs(out, query, key_cache, value_cache, g, format, num_kv_heads,
                                              scale, block_tables, seq_lens, block_size, max_seq_len,
                                              alibi_slopes, k_scale, v_scale);
  const WindowInputs win = window_inputs(in, window_key_cache, window_value_cache, window_block_tables,
                                         window_starts, window_size);
#define FP8KV_CALL(scalar_t, cache_t, kFormat) \
  run_paged_attention_window<scalar_t, cache_t, fp8_format_of(kFormat)>(in, win)
  FP8KV_DISPATCH_BY_KV_CACHE_DTYPE(query.scalar_type(), kv_cache_dtype, FP8KV_CALL);
#undef FP8KV_CALL
  raise_reported_window_errors(finish_attention(in), in, win);
}

}  // namespace
}  // namespace fp8kv::gpu

TORCH_LIBRARY_IMPL(fp8kv, CUDA, m) {
  m.impl("reshape_and_cache", &fp8kv::gpu::reshape_and_cache);
  m.impl("paged_attention", &fp8kv::gpu::paged_attention);
  m.impl("paged_attention_window", &fp8kv::gpu::paged_attention_window);
}
