// The decoder layer's elementwise ops on the GPU (fp8cache/model/fused_layer.py runs them between the
// projections): RMSNorm, residual add + RMSNorm, rotary embedding in place, SiLU-and-mul. Each is one kernel
// where transformers' eager layer runs 3-10 (RMSNorm alone: pow, mean, add, rsqrt, mul, to, mul).
//
// They round where transformers' formulas round, so their results are those of the eager layer up to the
// order of a float32 sum: an op of the model dtype rounds its float32 result to that dtype.
#pragma once

#include <cmath>

#include "platform.cuh"

namespace fp8kv::gpu {

constexpr int kLayerThreads = 256;

template <typename T>
FP8KV_DEVICE T round_to(float v) {
  return from_float<T>(v);
}

template <typename T>
struct RowsArgs {
  T* out;          // rms_norm: [rows, n]; fused_add_rms_norm: input (normalized in place)
  T* residual;     // fused_add_rms_norm only: residual += input
  const T* input;  // rms_norm's input
  const T* weight;  // [n]
  int64_t rows, n;
  int64_t out_stride, residual_stride, input_stride;  // per row, elements
  float epsilon;
};

// Sum of v over the block's threads, for every thread (scratch: kLayerThreads / kWarpSize floats).
template <class Thread>
FP8KV_DEVICE float block_sum(float v, float* scratch, const Thread& th) {
  for (int mask = kWarpSize / 2; mask > 0; mask /= 2) v += th.shfl_xor(v, mask);
  if (th.index() % kWarpSize == 0) scratch[th.index() / kWarpSize] = v;
  th.sync();
  float total = 0.0f;
  for (int w = 0; w < kLayerThreads / kWarpSize; ++w) total += scratch[w];
  th.sync();  // scratch is reused by the next row
  return total;
}

// LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), x in float32 (the product in the dtype).
template <typename T, class Thread>
FP8KV_DEVICE void norm_row(T* out, const T* x, const T* weight, int64_t n, float epsilon, float* scratch,
                           const Thread& th) {
  float squares = 0.0f;
  for (int64_t i = th.index(); i < n; i += kLayerThreads) {
    const float v = to_float(x[i]);
    squares += v * v;
  }
  const float inv = 1.0f / sqrtf(block_sum(squares, scratch, th) / static_cast<float>(n) + epsilon);
  for (int64_t i = th.index(); i < n; i += kLayerThreads) {
    const float normed = to_float(round_to<T>(to_float(x[i]) * inv));
    out[i] = round_to<T>(to_float(weight[i]) * normed);
  }
}

template <typename T, class Thread>
FP8KV_DEVICE void rms_norm_body(const RowsArgs<T>& a, float* scratch, const Thread& th) {
  const int64_t row = th.block_x();
  norm_row(a.out + row * a.out_stride, a.input + row * a.input_stride, a.weight, a.n, a.epsilon, scratch, th);
}

// residual += input (rounded to the dtype); input = rms_norm(residual).
template <typename T, class Thread>
FP8KV_DEVICE void fused_add_rms_norm_body(const RowsArgs<T>& a, float* scratch, const Thread& th) {
  const int64_t row = th.block_x();
  T* residual = a.residual + row * a.residual_stride;
  T* x = a.out + row * a.out_stride;
  for (int64_t i = th.index(); i < a.n; i += kLayerThreads) {
    residual[i] = round_to<T>(to_float(residual[i]) + to_float(x[i]));
  }
  th.sync();  // the norm's threads read other threads' sums
  norm_row(x, residual, a.weight, a.n, a.epsilon, scratch, th);
}

template <typename T>
struct RotaryArgs {
  T* query;  // [tokens, heads, d], d contiguous
  T* key;    // [tokens, kv_heads, d]
  const T* cos;  // [tokens, d], d contiguous
  const T* sin;
  int64_t tokens;
  int heads, kv_heads, d;
  int64_t query_token_stride, query_head_stride, key_token_stride, key_head_stride;
  int64_t cos_stride, sin_stride;
};

// transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], each product
// and the sum rounded to the dtype. One block per token; thread pairs (i, i + d/2) of every head.
template <typename T, class Thread>
FP8KV_DEVICE void rotary_body(const RotaryArgs<T>& a, const Thread& th) {
  const int64_t token = th.block_x();
  const int half = a.d / 2;
  const T* cos = a.cos + token * a.cos_stride;
  const T* sin = a.sin + token * a.sin_stride;
  const int pairs = (a.heads + a.kv_heads) * half;
  for (int i = th.index(); i < pairs; i += kLayerThreads) {
    const int head = i / half, j = i % half;
    T* x = head < a.heads ? a.query + token * a.query_token_stride + int64_t(head) * a.query_head_stride
                          : a.key + token * a.key_token_stride + int64_t(head - a.heads) * a.key_head_stride;
    const float x1 = to_float(x[j]), x2 = to_float(x[j + half]);
    const float c1 = to_float(cos[j]), c2 = to_float(cos[j + half]);
    const float s1 = to_float(sin[j]), s2 = to_float(sin[j + half]);
    const float a1 = to_float(round_to<T>(x1 * c1)), b1 = to_float(round_to<T>(-x2 * s1));
    const float a2 = to_float(round_to<T>(x2 * c2)), b2 = to_float(round_to<T>(x1 * s2));
    x[j] = round_to<T>(a1 + b1);
    x[j + half] = round_to<T>(a2 + b2);
  }
}

template <typename T>
struct SiluMulArgs {
  T* out;  // [rows, n]
  const T* gate;
  const T* up;
  int64_t rows, n;
  int64_t out_stride, gate_stride, up_stride;
};

// LlamaMLP's act_fn(gate) * up: silu in float32 rounded to the dtype, then the product rounded.
template <typename T, class Thread>
FP8KV_DEVICE void silu_and_mul_body(const SiluMulArgs<T>& a, const Thread& th) {
  const int64_t row = th.block_x();
  const T* gate = a.gate + row * a.gate_stride;
  const T* up = a.up + row * a.up_stride;
  T* out = a.out + row * a.out_stride;
  for (int64_t i = th.index(); i < a.n; i += kLayerThreads) {
    const float g = to_float(gate[i]);
    const float silu = to_float(round_to<T>(g / (1.0f + expf(-g))));
    out[i] = round_to<T>(silu * to_float(up[i]));
  }
}

#if !defined(FP8KV_PLATFORM_HOST)
template <typename T>
__global__ void __launch_bounds__(kLayerThreads) rms_norm_kernel(const RowsArgs<T> args) {
  __shared__ float scratch[kLayerThreads / 32];
  rms_norm_body(args, scratch, GpuThread{});
}

template <typename T>
__global__ void __launch_bounds__(kLayerThreads) fused_add_rms_norm_kernel(const RowsArgs<T> args) {
  __shared__ float scratch[kLayerThreads / 32];
  fused_add_rms_norm_body(args, scratch, GpuThread{});
}

template <typename T>
__global__ void __launch_bounds__(kLayerThreads) rotary_kernel(const RotaryArgs<T> args) {
  rotary_body(args, GpuThread{});
}

template <typename T>
__global__ void __launch_bounds__(kLayerThreads) silu_and_mul_kernel(const SiluMulArgs<T> args) {
  silu_and_mul_body(args, GpuThread{});
}
#endif

template <typename T>
Error launch_rms_norm(const RowsArgs<T>& args, Stream stream);
template <typename T>
Error launch_fused_add_rms_norm(const RowsArgs<T>& args, Stream stream);
template <typename T>
Error launch_rotary(const RotaryArgs<T>& args, Stream stream);
template <typename T>
Error launch_silu_and_mul(const SiluMulArgs<T>& args, Stream stream);

}  // namespace fp8kv::gpu
