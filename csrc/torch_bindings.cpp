// Op schemas of torch.ops.fp8kv (docs/design.md section 4): each op's signature, declared once. The C++ parameter
// lists (op_signatures.h), the Python wrappers, fake kernels and reference follow them, checked by
// tests/ops/test_op_signatures.py. Kernels are registered per backend: cpu/register.cpp (CPU) and cuda/ (CUDA, HIP).
#include <string>

#include <torch/library.h>

#include "cpu/isa.h"

namespace {

// Which CPU code path this library was compiled with: "avx512", "avx2" or "scalar".
std::string cpu_isa() { return fp8kv::cpu::isa_name(); }

// Whether that path has AVX512-BF16 dot products (linear_bf16 runs its fast kernel).
bool cpu_bf16_dot() { return fp8kv::cpu::has_bf16_dot(); }

}  // namespace

// k_scale_cache / v_scale_cache (None: static scales): dynamic scales, bfloat16 [num_blocks, num_kv_heads,
// block_size], one per token and KV head (common/dynamic_scale.h), used in place of k_scale / v_scale.
// kv_cache_format is a KVFormat code (common/cache_format.h), resolved from the user's kv-cache-dtype string in
// Python (fp8cache.ops and fp8cache.kvcache.formats.format_code): no op parses a string on its calls.
TORCH_LIBRARY(fp8kv, m) {
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, int kv_cache_format, Tensor k_scale, Tensor v_scale, "
      "Tensor(c!)? k_scale_cache=None, Tensor(d!)? v_scale_cache=None) -> ()");
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "int num_kv_heads, float scale, Tensor block_tables, Tensor seq_lens, int block_size, "
      "int max_seq_len, Tensor? alibi_slopes, int kv_cache_format, Tensor k_scale, Tensor v_scale, "
      "int sliding_window=0, float logit_softcap=0.0, Tensor? sinks=None, Tensor? k_scale_cache=None, "
      "Tensor? v_scale_cache=None) -> ()");
  m.def(
      "paged_attention_window(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor window_key_cache, Tensor window_value_cache, int num_kv_heads, float scale, "
      "Tensor block_tables, Tensor window_block_tables, Tensor seq_lens, Tensor window_starts, "
      "int window_size, int block_size, int max_seq_len, Tensor? alibi_slopes, int kv_cache_format, "
      "Tensor k_scale, Tensor v_scale, int sliding_window=0, float logit_softcap=0.0, Tensor? sinks=None, "
      "Tensor? k_scale_cache=None, Tensor? v_scale_cache=None, int window_sinks=0) -> ()");
  m.def("quantize_fp8(Tensor x, int kv_cache_format, Tensor scale) -> Tensor");
  m.def("dequantize_fp8(Tensor codes, int kv_cache_format, Tensor scale, ScalarType out_dtype) -> Tensor");
  // Decoder-layer elementwise ops of the CPU fast path (fp8cache/backends/cpu/fused_layer.py); CPU kernels only.
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float epsilon) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()");
  m.def("rotary_embedding_cos_sin(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate, Tensor up) -> ()");
  // float32 linear over 16-column weight panels (fp8cache/backends/cpu/packed_linear.py); CPU kernels only.
  m.def("linear_f32_pack(Tensor weight) -> Tensor");
  m.def("linear_f32(Tensor input, Tensor packed_weight, int out_features, Tensor? bias) -> Tensor");
  // bfloat16 linear over 16-column panels of k pairs (fp8cache/backends/cpu/packed_linear.py); CPU kernels only.
  m.def("linear_bf16_pack(Tensor weight) -> Tensor");
  m.def("linear_bf16(Tensor input, Tensor packed_weight, int out_features, Tensor? bias, bool float32_out=False) -> Tensor");
  // One float32 decoder layer of a decode step over panel weights (fp8cache/backends/cpu/fused_layer.py); CPU only.
  m.def(
      "decode_layer(Tensor(a!) hidden, Tensor[] weights, Tensor?[] biases, int[] shape, float[] eps, Tensor cos, "
      "Tensor sin, float scale, Tensor(b!) key_cache, Tensor(c!) value_cache, Tensor slot_mapping, "
      "int kv_cache_format, Tensor k_scale, Tensor v_scale, Tensor block_tables, Tensor seq_lens, int max_seq_len, "
      "Tensor(d!)[] window, Tensor? window_slot_mapping, Tensor? window_block_tables, Tensor? window_starts, "
      "int window_size, Tensor(e!)? k_scale_cache=None, Tensor(f!)? v_scale_cache=None, bool hadamard=False, "
      "int window_sinks=0) -> ()");
  m.def("cpu_isa() -> str", &cpu_isa);
  m.def("cpu_bf16_dot() -> bool", &cpu_bf16_dot);
}
