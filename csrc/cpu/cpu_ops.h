// CPU implementations of the fp8kv ops (registered in register.cpp, schemas in ../torch_bindings.cpp).
#pragma once

#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>
#include <c10/util/ArrayRef.h>

#include "../op_signatures.h"

namespace fp8kv::cpu {

// The ops both backends implement, with their parameters from ../op_signatures.h.
void reshape_and_cache(FP8KV_RESHAPE_AND_CACHE_PARAMS);
void paged_attention(FP8KV_PAGED_ATTENTION_PARAMS);
void paged_attention_window(FP8KV_PAGED_ATTENTION_WINDOW_PARAMS);

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

// x [..., d] times kvcache/rotation.py's (block) Hadamard matrix, in x's dtype, contiguous (hadamard.cpp).
at::Tensor hadamard_transform(const at::Tensor& x);

// One decoder layer of a decode step (decode_layer.cpp): the fused-layer sequence of the ops above in one call.
void decode_layer(at::Tensor& hidden, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                  at::IntArrayRef shape, c10::ArrayRef<double> eps, const at::Tensor& cos, const at::Tensor& sin,
                  double scale, at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
                  int64_t kv_cache_format, const at::Tensor& k_scale, const at::Tensor& v_scale,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t max_seq_len,
                  at::TensorList window, const std::optional<at::Tensor>& window_slot_mapping,
                  const std::optional<at::Tensor>& window_block_tables,
                  const std::optional<at::Tensor>& window_starts, int64_t window_size,
                  const std::optional<at::Tensor>& k_scale_cache, const std::optional<at::Tensor>& v_scale_cache,
                  bool hadamard, int64_t window_sinks);

}  // namespace fp8kv::cpu
