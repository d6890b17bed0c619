// Portable partition kernel: decodes one K row at a time into a small float buffer, then plain dot products;
// P.V decodes a block's V token-major and adds weighted rows (no sum across lanes), and FP8 codes decode
// through a table of their 256 values. The scalar build (Arm and other CPUs) uses it everywhere, the AVX-512
// and AVX2 builds for unusual geometries (head sizes that are not a multiple of 16, other block sizes).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/fp8.h"
#include "cpu/attention_kernel.h"
#include "cpu/fp8_f16c.h"
#include "cpu/isa.h"
#include "dispatch.h"

namespace fp8kv::cpu::generic {

#if defined(FP8KV_ISA_AVX2) || defined(FP8KV_ISA_AVX512)
// 8 FP8 codes -> 8 exact floats.
template <KVFormat kFormat>
FP8KV_INLINE __m256 fp8x8_to_float(const uint8_t* src) {
  constexpr float kRescale = Fp8Traits<fp8_format_of(kFormat)>::kHalfRescale;
  return _mm256_mul_ps(fp8x8_scaled_floats<kFormat>(src), _mm256_set1_ps(kRescale));
}
#endif

// Every FP8 code's float value (NaN, infinities and subnormals exact), so that the portable path decodes a code
// with one load: fp8_to_float's branches made its FP8 attention three times slower than over a bfloat16 cache.
template <Fp8Format F>
struct Fp8FloatTable {
  float value[256];

  Fp8FloatTable() {
    for (int c = 0; c < 256; ++c) value[c] = fp8_to_float<F>(static_cast<uint8_t>(c));
  }

  static const float* get() {
    static const Fp8FloatTable table;
    return table.value;
  }
};

// A cache element's value as a float: FP8 codes through their table (looked up once, where the converter is
// made, not per element), model-dtype values as they are.
template <typename cache_t, KVFormat kFormat>
struct ToFloat {
  const float* table = nullptr;

  ToFloat() {
    if constexpr (kFormat != KVFormat::AUTO) table = Fp8FloatTable<fp8_format_of(kFormat)>::get();
  }

  FP8KV_INLINE float operator()(cache_t v) const {
    if constexpr (kFormat == KVFormat::AUTO) {
      return static_cast<float>(v);
    } else {
      return table[v];
    }
  }
};

// dst[0..n) = value of src[0..n).
template <typename cache_t, KVFormat kFormat>
FP8KV_INLINE void decode(const cache_t* src, float* dst, int n) {
  int i = 0;
#if defined(FP8KV_ISA_AVX2) || defined(FP8KV_ISA_AVX512)
  if constexpr (kFormat != KVFormat::AUTO) {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, fp8x8_to_float<kFormat>(src + i));
  } else {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, model_dtype_x8_floats(src + i));
  }
#endif
  const ToFloat<cache_t, kFormat> value;
  for (; i < n; ++i) dst[i] = value(src[i]);
}

FP8KV_INLINE float dot(const float* a, const float* b, int n) {
  int i = 0;
  float sum = 0.f;
#if defined(FP8KV_ISA_AVX2) || defined(FP8KV_ISA_AVX512)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  const __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  sum = _mm_cvtss_f32(s);
#else
  // Eight running sums, as vector lanes keep them: a compiler may vectorize these (NEON, SSE) where one sum
  // must stay in order, and rounding errors grow more slowly (logits hundreds apart tell).
  float part[8] = {};
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) part[j] += a[i + j] * b[i + j];
  }
  sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// dst[t][d] = value of src[d * stride + t], t < n, d < D: a block's V rows (one per head dim) token-major.
template <typename cache_t, KVFormat kFormat>
FP8KV_INLINE void decode_transposed(const cache_t* src, int stride, int n, int D, float* dst) {
  const ToFloat<cache_t, kFormat> value;
  for (int d = 0; d < D; ++d) {
    for (int t = 0; t < n; ++t) dst[t * D + d] = value(src[d * stride + t]);
  }
}

// Four floats as one vector of whatever the target has (NEON, SSE): GCC's and Clang's vector extension. The
// vectorizer alone left a quarter of add_weighted_rows scalar (gcc 12, aarch64).
typedef float Float4 __attribute__((vector_size(16)));

FP8KV_INLINE Float4 load4(const float* p) {
  Float4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// out[0..D) += sum over t < n of p[t] * v[t][0..D) (v token-major): 16 dims at a time, summed over all n
// tokens in four vectors of sums with no sum across lanes.
FP8KV_INLINE void add_weighted_rows(const float* p, const float* v, int n, int D, float* out) {
  int d0 = 0;
  for (; d0 + 16 <= D; d0 += 16) {
    Float4 acc[4];
    for (int j = 0; j < 4; ++j) acc[j] = load4(out + d0 + 4 * j);
    for (int t = 0; t < n; ++t) {
      const float* row = v + t * D + d0;
      for (int j = 0; j < 4; ++j) acc[j] += p[t] * load4(row + 4 * j);
    }
    for (int j = 0; j < 4; ++j) std::memcpy(out + d0 + 4 * j, &acc[j], sizeof acc[j]);
  }
  for (int t = 0; t < n; ++t) {  // the last D % 16 dims
    for (int d = d0; d < D; ++d) out[d] += p[t] * v[t * D + d];
  }
}

// Softmax numerators in place: logits[h][0..n) -> exp(logit - max); returns max and sum per head.
inline void softmax_numerators(float* logits, int n, float* max_logit, float* exp_sum) {
  float m = -INFINITY;
  for (int i = 0; i < n; ++i) m = std::fmax(m, logits[i]);
  float s = 0.f;
  for (int i = 0; i < n; ++i) {
    logits[i] = std::exp(logits[i] - m);
    s += logits[i];
  }
  *max_logit = m;
  *exp_sum = s;
}

template <typename cache_t, KVFormat kFormat>
void run_partition(const PartitionWork& w) {
  NextScales(w.next_scales).fetch_all();  // dynamic scales: the next pass's lines, at once
  const int G = w.group, D = w.head_size, bs = w.block_size, P = w.end - w.start;
  const int x = 16 / static_cast<int>(sizeof(cache_t));
  const int64_t block_elems = w.num_kv_heads * D * bs;
  const cache_t* kcache = static_cast<const cache_t*>(w.key_cache) + w.kv_head * D * bs;
  const cache_t* vcache = static_cast<const cache_t*>(w.value_cache) + w.kv_head * D * bs;
  float* logits = w.scratch;                      // [G][P]
  float* q = logits + G * (kPartitionSize + 32);  // [G][D], pre-scaled
  float* row = q + G * D;                         // one decoded K row; then a block's V, token-major
  for (int i = 0; i < G * D; ++i) q[i] = w.query[i] * w.qk_scale;

  const float* alibi = w.k_scales ? nullptr : w.alibi;  // dynamic scales: ALiBi after them
  for (int t = w.start; t < w.end; ++t) {
    const cache_t* kb = kcache + w.block_table[t / bs] * block_elems + (t % bs) * x;
    for (int c = 0; c < D / x; ++c) decode<cache_t, kFormat>(kb + c * bs * x, row + c * x, x);
    for (int h = 0; h < G; ++h) {
      float logit = dot(q + h * D, row, D);
      if (alibi) logit += alibi[h] * static_cast<float>(t - w.last_pos);
      logits[h * P + (t - w.start)] = logit;
    }
  }
  if (w.k_scales) apply_key_scales(w, logits, P, w.start, P);
  for (int h = 0; h < G; ++h) {
    soft_cap(logits + h * P, 0, P, w.softcap);
    softmax_numerators(logits + h * P, P, w.max_logit + h, w.exp_sum + h);
  }
  if (w.v_scales) apply_value_scales(w, logits, P, w.start, P);

  // P.V a token at a time, out[h] += p[h][t] * V[t]: V is [head dim][token] in a block, so its valid tokens
  // (stale slots may hold NaN) are decoded token-major first. Dot products over a block's 16 tokens spent
  // more time summing lanes than multiplying.
  std::fill(w.out, w.out + G * D, 0.f);
  for (int b = w.start / bs; b * bs < w.end; ++b) {
    const int t0 = std::max(w.start, b * bs), n = std::min(w.end, (b + 1) * bs) - t0;
    const cache_t* vb = vcache + w.block_table[b] * block_elems + (t0 - b * bs);
    decode_transposed<cache_t, kFormat>(vb, bs, n, D, row);
    for (int h = 0; h < G; ++h) add_weighted_rows(logits + h * P + (t0 - w.start), row, n, D, w.out + h * D);
  }
  for (int h = 0; h < G; ++h) {
    const float norm = w.v_scale / w.exp_sum[h];
    for (int d = 0; d < D; ++d) w.out[h * D + d] *= norm;
  }
}

}  // namespace fp8kv::cpu::generic
