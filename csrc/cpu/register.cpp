// CPU kernels of the fp8kv ops.
#include <torch/library.h>

#include "cpu/cpu_ops.h"

TORCH_LIBRARY_IMPL(fp8kv, CPU, m) {
  m.impl("reshape_and_cache", &fp8kv::cpu::reshape_and_cache);
  m.impl("paged_attention", &fp8kv::cpu::paged_attention);
  m.impl("paged_attention_window", &fp8kv::cpu::paged_attention_window);
  m.impl("quantize_fp8", &fp8kv::cpu::quantize_fp8);
  m.impl("dequantize_fp8", &fp8kv::cpu::dequantize_fp8);
  m.impl("rms_norm", &fp8kv::cpu::rms_norm);
  m.impl("fused_add_rms_norm", &fp8kv::cpu::fused_add_rms_norm);
  m.impl("rotary_embedding_cos_sin", &fp8kv::cpu::rotary_embedding_cos_sin);
  m.impl("silu_and_mul", &fp8kv::cpu::silu_and_mul);
  m.impl("linear_f32_pack", &fp8kv::cpu::linear_f32_pack);
  m.impl("linear_f32", &fp8kv::cpu::linear_f32);
  m.impl("linear_bf16_pack", &fp8kv::cpu::linear_bf16_pack);
  m.impl("linear_bf16", &fp8kv::cpu::linear_bf16);
  m.impl("decode_layer", &fp8kv::cpu::decode_layer);
}

// oneDNN's packed float32 weights are MkldnnCPU tensors; decode_layer passes them on to oneDNN's linear.
TORCH_LIBRARY_IMPL(fp8kv, MkldnnCPU, m) { m.impl("decode_layer", &fp8kv::cpu::decode_layer); }
