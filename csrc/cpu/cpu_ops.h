// CPU implementations of the fp8kv ops (registered in register.cpp, schemas in ../torch_bindings.cpp).
#pragma once

#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>
#include <c10/util/ArrayRef.h>

namespace fp8kv::cpu {

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       int64_t kv_cache_format, const at::Tensor& k_scale,
                       const at::Tensor& v_scale, const std::optional<at::Tensor>& k_scale_cache = std::nullopt,
                       const std::optional<at::Tensor>& v_scale_cache = std::nullopt);

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                     int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                     int64_t kv_cache_format, const at::Tensor& k_scale,
                     const at::Tensor& v_scale, int64_t sliding_window = 0, double logit_softcap = 0.0,
                     const std::optional<at::Tensor>& sinks = std::nullopt,
                     const std::optional<at::Tensor>& k_scale_cache = std::nullopt,
                     const std::optional<at::Tensor>& v_scale_cache = std::nullopt);

// k_scale_cache / v_scale_cache: dynamic scales, bfloat16 [num_blocks, num_kv_heads, block_size] (common/dynamic_scale.h),
// written by reshape_and_cache and read by attention in place of k_scale / v_scale.
// sliding_window > 0: each sequence attends to its newest sliding_window positions; logit_softcap > 0: logits
// become logit_softcap * tanh(logit / logit_softcap); sinks [num_heads]: one more logit per head in the
// softmax's denominator (docs/design.md section 4).
// paged_attention whose newest positions [window_starts[i], seq_lens[i]) come from a model-dtype ring
// (window_key_cache / window_value_cache, ring slot = position % window_size) instead of the paged cache.
void paged_attention_window(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& window_key_cache,
                            const at::Tensor& window_value_cache, int64_t num_kv_heads, double scale,
                            const at::Tensor& block_tables, const at::Tensor& window_block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& window_starts, int64_t window_size,
                            int64_t block_size, int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                            int64_t kv_cache_format, const at::Tensor& k_scale,
                            const at::Tensor& v_scale, int64_t sliding_window = 0, double logit_softcap = 0.0,
                            const std::optional<at::Tensor>& sinks = std::nullopt,
                            const std::optional<at::Tensor>& k_scale_cache = std::nullopt,
                            const std::optional<at::Tensor>& v_scale_cache = std::nullopt);

at::Tensor quantize_fp8(const at::Tensor& x, int64_t kv_cache_format, const at::Tensor& scale);

at::Tensor dequantize_fp8(const at::Tensor& codes, int64_t kv_cache_format,
                          const at::Tensor& scale, at::ScalarType out_dtype);

// Decoder-layer elementwise ops (layer_ops.cpp), rounding where transformers' formulas do.
void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon);
void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon);
void rotary_embedding_cos_sin(at::Tensor& query, at::Tensor& key, const at::Tensor& cos, const at::Tensor& sin);
void silu_and_mul(at::Tensor& out, const at::Tensor& gate, const at::Tensor& up);

// float32 linear over a weight packed into 16-column panels (linear_f32.cpp).
at::Tensor linear_f32_pack(const at::Tensor& weight);
at::Tensor linear_f32(const at::Tensor& input, const at::Tensor& packed_weight, int64_t out_features,
                      const std::optional<at::Tensor>& bias);

// bfloat16 linear over a weight packed into 16-column panels of k pairs (linear_bf16.cpp); float32_out keeps
// the float32 sums instead of rounding them to bfloat16.
at::Tensor linear_bf16_pack(const at::Tensor& weight);
at::Tensor linear_bf16(const at::Tensor& input, const at::Tensor& packed_weight, int64_t out_features,
                       const std::optional<at::Tensor>& bias, bool float32_out);

// One decoder layer of a decode step (decode_layer.cpp): the fused-layer sequence of the ops above in one call.
void decode_layer(at::Tensor& hidden, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                  at::IntArrayRef shape, c10::ArrayRef<double> eps, const at::Tensor& cos, const at::Tensor& sin,
                  double scale, at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
                  int64_t kv_cache_format, const at::Tensor& k_scale, const at::Tensor& v_scale,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t max_seq_len,
                  at::TensorList window, const std::optional<at::Tensor>& window_slot_mapping,
                  const std::optional<at::Tensor>& window_block_tables,
                  const std::optional<at::Tensor>& window_starts, int64_t window_size,
                  const std::optional<at::Tensor>& k_scale_cache, const std::optional<at::Tensor>& v_scale_cache);

}  // namespace fp8kv::cpu
