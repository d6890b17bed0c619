// A whole Llama-family decoder layer for a decode step in one call: the same kernels, in the same order,
// as fp8cache/backends/cpu/fused_layer.py runs them from Python (so the results are bitwise those of that path),
// without its ~25 Python-level op calls per layer. In a decode step of a small model that dispatch was
// about an eighth of the step; here it is one call. Layers whose projections are packed
// (fp8cache/backends/cpu/packed_linear.py): in fp8kv's 16-column panels (linear_f32, linear_bf16), or in oneDNN's
// layout (mkldnn::_linear_pointwise, called through the dispatcher as the Python path calls it).
#include <cstdint>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/core/List.h>
#include <c10/util/ArrayRef.h>

#include "common/cache_format.h"
#include "cpu/cpu_ops.h"

namespace fp8kv::cpu {

namespace {

// weights: the layer's tensors in this order; biases: one (or none) per projection, same order.
enum Weight : int { kInputNorm, kQkv, kOut, kPostNorm, kGateUp, kDown, kNumWeights };
enum Projection : int { kQkvBias, kOutBias, kGateUpBias, kDownBias, kNumBiases };

enum Packing : int64_t { kPanels = 0, kOneDnn = 1 };

// x @ W.T + b over a packed weight, as PackedLinear.forward computes it.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const std::optional<at::Tensor>& bias, int64_t packing) {
  if (packing == kPanels) {
    return packed.scalar_type() == at::kBFloat16 ? linear_bf16(x, packed, out_features, bias, false)
                                                  : linear_f32(x, packed, out_features, bias);
  }
  static const auto onednn =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
  return onednn.call(x, packed, bias, "none", c10::List<std::optional<c10::Scalar>>(), c10::string_view(""));
}

}  // namespace

void decode_layer(at::Tensor& hidden, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                  at::IntArrayRef shape, c10::ArrayRef<double> eps, const at::Tensor& cos, const at::Tensor& sin,
                  double scale, at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
                  int64_t kv_cache_format, const at::Tensor& k_scale, const at::Tensor& v_scale,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t max_seq_len,
                  at::TensorList window, const std::optional<at::Tensor>& window_slot_mapping,
                  const std::optional<at::Tensor>& window_block_tables,
                  const std::optional<at::Tensor>& window_starts, int64_t window_size,
                  const std::optional<at::Tensor>& k_scale_cache, const std::optional<at::Tensor>& v_scale_cache,
                  bool hadamard, int64_t window_sinks) {
  TORCH_CHECK(weights.size() == kNumWeights, "weights must be [input_norm, qkv, o, post_norm, gate_up, down], got ",
              weights.size(), " tensors");
  TORCH_CHECK(biases.size() == kNumBiases, "biases must hold one entry (or None) per projection: qkv, o, gate_up, "
              "down; got ", biases.size());
  TORCH_CHECK(shape.size() == 5, "shape must be [num_heads, num_kv_heads, head_size, intermediate_size, packing], got ",
              shape.size(), " values");
  const int64_t packing = shape[4];
  TORCH_CHECK(packing == kPanels || packing == kOneDnn, "packing must be 0 (fp8kv panels) or 1 (oneDNN), got ", packing);
  TORCH_CHECK(eps.size() == 2, "eps must be [input_norm_eps, post_norm_eps], got ", eps.size(), " values");
  TORCH_CHECK(hidden.dim() == 2 && (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16) &&
                  hidden.is_contiguous(),
              "hidden must be a contiguous float32 or bfloat16 [tokens, hidden_size] tensor, got ", hidden.scalar_type(),
              " ", hidden.sizes());
  TORCH_CHECK(weights[kQkv].scalar_type() == hidden.scalar_type(), "the packed weights are ",
              weights[kQkv].scalar_type(), " but hidden is ", hidden.scalar_type());
  TORCH_CHECK(window.empty() || window.size() == 2, "window must be [] or [window_key_cache, window_value_cache]");
  const bool windowed = window.size() == 2;
  TORCH_CHECK(!windowed || (window_slot_mapping && window_block_tables && window_starts),
              "a window needs window_slot_mapping, window_block_tables and window_starts");
  const int64_t tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t heads = shape[0], kv_heads = shape[1], d = shape[2], intermediate = shape[3];
  const int64_t q_size = heads * d, kv_size = kv_heads * d;

  at::Tensor h = at::empty(hidden.sizes(), hidden.options());
  rms_norm(h, hidden, weights[kInputNorm], eps[0]);
  const at::Tensor qkv = packed_linear(h, weights[kQkv], q_size + 2 * kv_size, biases.get(kQkvBias), packing);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads, d});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, d});
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, d});
  rotary_embedding_cos_sin(q, k, cos, sin);
  if (hadamard) {
    // kv rotation, as attention.attend does it: K/V are cached rotated and Q meets them in the same basis, so
    // q.k is unchanged; the output rotates back below (H is its own inverse).
    q = hadamard_transform(q);
    k = hadamard_transform(k);
    v = hadamard_transform(v);
  }

  reshape_and_cache(k, v, key_cache, value_cache, slot_mapping, kv_cache_format, k_scale, v_scale, k_scale_cache,
                    v_scale_cache);
  at::Tensor attn = at::empty({tokens, heads, d}, hidden.options());
  const at::Tensor query = q.contiguous();
  if (windowed) {
    at::Tensor window_key = window[0], window_value = window[1];
    reshape_and_cache(k, v, window_key, window_value, *window_slot_mapping,
                      static_cast<int64_t>(KVFormat::AUTO), k_scale, v_scale, std::nullopt, std::nullopt);
    paged_attention_window(attn, query, key_cache, value_cache, window_key, window_value, kv_heads, scale,
                           block_tables, *window_block_tables, seq_lens, *window_starts, window_size,
                           key_cache.size(3), max_seq_len, std::nullopt, kv_cache_format, k_scale, v_scale, 0, 0.0,
                           std::nullopt, k_scale_cache, v_scale_cache, window_sinks);
  } else {
    paged_attention(attn, query, key_cache, value_cache, kv_heads, scale, block_tables, seq_lens, key_cache.size(3),
                    max_seq_len, std::nullopt, kv_cache_format, k_scale, v_scale, 0, 0.0, std::nullopt, k_scale_cache,
                    v_scale_cache);
  }

  if (hadamard) attn = hadamard_transform(attn);
  at::Tensor o = packed_linear(attn.view({tokens, q_size}), weights[kOut], hidden_size, biases.get(kOutBias), packing);
  fused_add_rms_norm(o, hidden, weights[kPostNorm], eps[1]);  // hidden += o; o = norm(hidden)
  const at::Tensor gate_up = packed_linear(o, weights[kGateUp], 2 * intermediate, biases.get(kGateUpBias), packing);
  at::Tensor act = at::empty({tokens, intermediate}, hidden.options());
  silu_and_mul(act, gate_up.narrow(1, 0, intermediate), gate_up.narrow(1, intermediate, intermediate));
  hidden.add_(packed_linear(act, weights[kDown], hidden_size, biases.get(kDownBias), packing));
}

}  // namespace fp8kv::cpu
