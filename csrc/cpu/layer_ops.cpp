// Elementwise parts of a decoder layer for the CPU fast path (fp8cache/backends/cpu/fused_layer.py): RMSNorm,
// residual add + RMSNorm, rotary embedding and SiLU-and-mul, one op each where transformers' modules run
// five to ten torch ops. In a decode step of a small model the per-op dispatch costs more than the
// arithmetic. Each op rounds to the model dtype where transformers' formulas do (after every torch op),
// so the two paths differ by float summation order and contraction only.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu/checks.h"
#include "cpu/cpu_ops.h"
#include "cpu/isa.h"
#if defined(FP8KV_ISA_AVX512)
#include "cpu/vector_exp.h"
#endif

namespace fp8kv::cpu {
namespace {

// Rows of a [rows, n] problem per thread chunk: about 16k elements, so decode-sized inputs stay on the
// calling thread (an OpenMP fork costs more than they do).
int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n)); }

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);  // c10's BFloat16 / Half round to nearest even, as torch's casts do
}

// A [rows, n] view with a contiguous last dimension: 2-D, or 3-D flattened over its first two dims.
struct Rows {
  char* base;
  int64_t rows, inner, n;      // rows = size(0) * inner
  int64_t stride0, stride1;    // in elements
  int64_t element_size;
  template <typename T>
  T* row(int64_t r) const {
    const int64_t i = r / inner, j = r % inner;
    return reinterpret_cast<T*>(base) + i * stride0 + j * stride1;
  }
};

Rows rows_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, name, " must be [tokens, n] or [tokens, heads, n], got shape ", t.sizes());
  TORCH_CHECK(t.stride(-1) == 1, name, " needs a contiguous last dimension, got strides ", t.strides());
  check_model_dtype(t, name);
  const bool three = t.dim() == 3;
  return Rows{static_cast<char*>(t.data_ptr()), t.size(0) * (three ? t.size(1) : 1), three ? t.size(1) : 1,
              t.size(-1), t.stride(0), three ? t.stride(1) : 0, static_cast<int64_t>(t.element_size())};
}

void check_same(const at::Tensor& a, const char* an, const at::Tensor& b, const char* bn) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), an, " and ", bn, " dtypes differ: ", a.scalar_type(), " vs ",
              b.scalar_type());
  TORCH_CHECK(a.sizes() == b.sizes(), an, " and ", bn, " shapes differ: ", a.sizes(), " vs ", b.sizes());
}

std::vector<float> weight_of(const at::Tensor& weight, int64_t n) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "weight must be [", n, "], got shape ", weight.sizes());
  TORCH_CHECK(weight.device().is_cpu(), "weight must be a CPU tensor");
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  return std::vector<float>(w.data_ptr<float>(), w.data_ptr<float>() + n);
}

// 1 / sqrt(mean(x^2) + eps) of one row, in float32 (16 running sums, so the loop vectorizes).
template <typename T>
float inv_rms(const T* x, int64_t n, float eps) {
  float part[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) {
      const float v = static_cast<float>(x[i + j]);
      part[j] += v * v;
    }
  }
  float sum = 0.f;
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  for (int j = 0; j < 16; ++j) sum += part[j];
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// transformers' RMSNorm: weight * (x * inv_rms).to(dtype), the product in the dtype.
template <typename T>
void norm_row(T* out, const T* x, const float* w, int64_t n, float eps) {
  const float inv = inv_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = round_to<T>(w[i] * static_cast<float>(round_to<T>(static_cast<float>(x[i]) * inv)));
  }
}

// silu(g) = g / (1 + exp(-g)), as torch computes it, then rounded to the dtype; times up, rounded.
template <typename T>
void silu_mul_row(T* out, const T* gate, const T* up, int64_t n, float* buffer) {
  for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(gate[i]);
  int64_t i = 0;
#if defined(FP8KV_ISA_AVX512)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(buffer + i);
    const __m512 e = avx512::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_storeu_ps(buffer + i, _mm512_div_ps(g, _mm512_add_ps(one, e)));
  }
#endif
  for (; i < n; ++i) buffer[i] = buffer[i] / (1.f + std::exp(-buffer[i]));
  for (int64_t j = 0; j < n; ++j) {
    out[j] = round_to<T>(static_cast<float>(round_to<T>(buffer[j])) * static_cast<float>(up[j]));
  }
}

// x * cos + rotate_half(x) * sin over one head, rotate_half(x) = [-x2, x1]; each product and the sum
// rounded to the dtype, as transformers' apply_rotary_pos_emb does.
template <typename T>
void rotate_row(T* x, const T* cos, const T* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    const float a = static_cast<float>(round_to<T>(x1 * static_cast<float>(cos[i])));
    const float b = static_cast<float>(round_to<T>(-x2 * static_cast<float>(sin[i])));
    const float c = static_cast<float>(round_to<T>(x2 * static_cast<float>(cos[i + half])));
    const float e = static_cast<float>(round_to<T>(x1 * static_cast<float>(sin[i + half])));
    x[i] = round_to<T>(a + b);
    x[i + half] = round_to<T>(c + e);
  }
}

// fn(r) for each of `rows` rows of `n` elements' work, spread over the threads.
template <typename F>
void for_each_row(int64_t rows, int64_t n, const F& fn) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

#define FP8KV_DISPATCH_MODEL_DTYPE(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  const Rows x = rows_of(input, "input"), o = rows_of(out, "out");
  check_same(out, "out", input, "input");
  const std::vector<float> w = weight_of(weight, x.n);
  FP8KV_DISPATCH_MODEL_DTYPE(input.scalar_type(), "rms_norm", [&] {
    for_each_row(x.rows, x.n, [&](int64_t r) {
      norm_row(o.row<scalar_t>(r), x.row<scalar_t>(r), w.data(), x.n, static_cast<float>(epsilon));
    });
  });
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon) {
  const Rows x = rows_of(input, "input"), res = rows_of(residual, "residual");
  check_same(input, "input", residual, "residual");
  const std::vector<float> w = weight_of(weight, x.n);
  FP8KV_DISPATCH_MODEL_DTYPE(input.scalar_type(), "fused_add_rms_norm", [&] {
    for_each_row(x.rows, x.n, [&](int64_t r) {
      scalar_t* sum = res.row<scalar_t>(r);
      scalar_t* in = x.row<scalar_t>(r);
      for (int64_t i = 0; i < x.n; ++i) {
        sum[i] = round_to<scalar_t>(static_cast<float>(sum[i]) + static_cast<float>(in[i]));
      }
      norm_row(in, sum, w.data(), x.n, static_cast<float>(epsilon));
    });
  });
}

void rotary_embedding_cos_sin(at::Tensor& query, at::Tensor& key, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3, "query and key must be [tokens, heads, head_size], got shapes ",
              query.sizes(), " and ", key.sizes());
  const Rows q = rows_of(query, "query"), k = rows_of(key, "key");
  const Rows c = rows_of(cos, "cos"), s = rows_of(sin, "sin");
  const int64_t tokens = query.size(0), d = q.n;
  TORCH_CHECK(d % 2 == 0, "head_size must be even for rotary embedding, got ", d);
  TORCH_CHECK(key.size(0) == tokens && k.n == d, "key ", key.sizes(), " does not match query ", query.sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == tokens && c.n == d, "cos must be [tokens, head_size] = [", tokens,
              ", ", d, "], got shape ", cos.sizes());
  check_same(cos, "cos", sin, "sin");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == cos.scalar_type(),
              "query, key and cos/sin must share a dtype, got ", query.scalar_type(), ", ", key.scalar_type(),
              " and ", cos.scalar_type());
  const int64_t qh = query.size(1), kh = key.size(1);
  FP8KV_DISPATCH_MODEL_DTYPE(query.scalar_type(), "rotary_embedding_cos_sin", [&] {
    for_each_row(tokens, d * (qh + kh), [&](int64_t t) {
      const scalar_t* ct = c.row<scalar_t>(t);
      const scalar_t* st = s.row<scalar_t>(t);
      for (int64_t h = 0; h < qh; ++h) rotate_row(q.row<scalar_t>(t * qh + h), ct, st, d);
      for (int64_t h = 0; h < kh; ++h) rotate_row(k.row<scalar_t>(t * kh + h), ct, st, d);
    });
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& gate, const at::Tensor& up) {
  const Rows o = rows_of(out, "out"), g = rows_of(gate, "gate"), u = rows_of(up, "up");
  check_same(gate, "gate", up, "up");
  check_same(out, "out", gate, "gate");
  FP8KV_DISPATCH_MODEL_DTYPE(gate.scalar_type(), "silu_and_mul", [&] {
    at::parallel_for(0, g.rows, grain_rows(g.n), [&](int64_t begin, int64_t end) {
      std::vector<float> buffer(static_cast<size_t>(g.n));
      for (int64_t r = begin; r < end; ++r) {
        silu_mul_row(o.row<scalar_t>(r), g.row<scalar_t>(r), u.row<scalar_t>(r), g.n, buffer.data());
      }
    });
  });
}

}  // namespace fp8kv::cpu
