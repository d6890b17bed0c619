// CPU kernels of the fp8kv ops.
#include <torch/library.h>

#include "cpu/cpu_ops.h"

TORCH_LIBRARY_IMPL(fp8kv, CPU, m) {
#define FP8KV_IMPL(name) m.impl(#name, &fp8kv::cpu::name);
  FP8KV_FOR_EACH_BACKEND_OP(FP8KV_IMPL)
#undef FP8KV_IMPL
  m.impl("quantize_fp8", &fp8kv::cpu::quantize_fp8);
  m.impl("dequantize_fp8", &fp8kv::cpu::dequantize_fp8);
  m.impl("linear_f32_pack", &fp8kv::cpu::linear_f32_pack);
  m.impl("linear_f32", &fp8kv::cpu::linear_f32);
  m.impl("linear_bf16_pack", &fp8kv::cpu::linear_bf16_pack);
  m.impl("linear_bf16", &fp8kv::cpu::linear_bf16);
  m.impl("decode_layer", &fp8kv::cpu::decode_layer);
}

// oneDNN's packed float32 weights are MkldnnCPU tensors; decode_layer passes them on to oneDNN's linear.
TORCH_LIBRARY_IMPL(fp8kv, MkldnnCPU, m) { m.impl("decode_layer", &fp8kv::cpu::decode_layer); }
