// The C++ parameter lists of the fp8kv ops that both backends implement (cpu/ and cuda/), each written once:
// a backend declares and defines `void paged_attention(FP8KV_PAGED_ATTENTION_PARAMS)`. They follow the schemas
// of torch_bindings.cpp: torch checks the types when a kernel is registered, tests/ops/test_op_signatures.py
// the names and their order (which torch does not: k_scale and v_scale swapped would compile).
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

// k_scale_cache / v_scale_cache: dynamic scales, bfloat16 [num_blocks, num_kv_heads, block_size]
// (common/dynamic_scale.h), written by reshape_and_cache and read by attention in place of k_scale / v_scale.
#define FP8KV_RESHAPE_AND_CACHE_PARAMS                                                                        \
  const at::Tensor &key, const at::Tensor &value, at::Tensor &key_cache, at::Tensor &value_cache,             \
      const at::Tensor &slot_mapping, int64_t kv_cache_format, const at::Tensor &k_scale,                     \
      const at::Tensor &v_scale, const std::optional<at::Tensor> &k_scale_cache,                             \
      const std::optional<at::Tensor> &v_scale_cache

// sliding_window > 0: each sequence attends to its newest sliding_window positions; logit_softcap > 0: logits
// become logit_softcap * tanh(logit / logit_softcap); sinks [num_heads]: one more logit per head in the
// softmax's denominator (docs/design.md section 4).
#define FP8KV_PAGED_ATTENTION_PARAMS                                                                          \
  at::Tensor &out, const at::Tensor &query, const at::Tensor &key_cache, const at::Tensor &value_cache,       \
      int64_t num_kv_heads, double scale, const at::Tensor &block_tables, const at::Tensor &seq_lens,         \
      int64_t block_size, int64_t max_seq_len, const std::optional<at::Tensor> &alibi_slopes,                 \
      int64_t kv_cache_format, const at::Tensor &k_scale, const at::Tensor &v_scale, int64_t sliding_window, \
      double logit_softcap, const std::optional<at::Tensor> &sinks,                                           \
      const std::optional<at::Tensor> &k_scale_cache, const std::optional<at::Tensor> &v_scale_cache

// paged_attention whose newest positions [window_starts[i], seq_lens[i]) and, with window_sinks S > 0, its first
// positions [0, min(S, window_starts[i])) (the attention sinks) come from a model-dtype ring (window_key_cache /
// window_value_cache) instead of the paged cache. Ring slot = position < S ? position : S + position % window_size:
// S + window_size slots per sequence (docs/design.md section 10).
#define FP8KV_PAGED_ATTENTION_WINDOW_PARAMS                                                                   \
  at::Tensor &out, const at::Tensor &query, const at::Tensor &key_cache, const at::Tensor &value_cache,       \
      const at::Tensor &window_key_cache, const at::Tensor &window_value_cache, int64_t num_kv_heads,         \
      double scale, const at::Tensor &block_tables, const at::Tensor &window_block_tables,                    \
      const at::Tensor &seq_lens, const at::Tensor &window_starts, int64_t window_size, int64_t block_size,   \
      int64_t max_seq_len, const std::optional<at::Tensor> &alibi_slopes, int64_t kv_cache_format,           \
      const at::Tensor &k_scale, const at::Tensor &v_scale, int64_t sliding_window, double logit_softcap,     \
      const std::optional<at::Tensor> &sinks, const std::optional<at::Tensor> &k_scale_cache,                 \
      const std::optional<at::Tensor> &v_scale_cache, int64_t window_sinks

// The ops every backend registers a kernel of (cpu/register.cpp, cuda/torch_bindings_cuda.cu): X(name) each.
#define FP8KV_FOR_EACH_BACKEND_OP(X)                                                                          \
  X(reshape_and_cache)                                                                                        \
  X(paged_attention)                                                                                          \
  X(paged_attention_window)                                                                                   \
  X(rms_norm)                                                                                                 \
  X(fused_add_rms_norm)                                                                                       \
  X(rotary_embedding_cos_sin)                                                                                 \
  X(silu_and_mul)
