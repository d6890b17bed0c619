// Writing K/V into the paged cache (quantizing to FP8 on the way) and the standalone quantize /
// dequantize ops that tests and the engine use to check fp8.h against torch.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "common/dynamic_scale.h"
#include "common/fp8.h"
#include "cpu/checks.h"
#include "cpu/cpu_ops.h"
#include "cpu/isa.h"
#include "dispatch.h"

namespace fp8kv::cpu {
namespace {

// Static scales divide (x / scale, as torch's reference does); dynamic ones multiply by their float32 reciprocal
// (x * (1 / scale), the reference's definition for them), a fraction of a division's cost in the cache write.
template <typename cache_t, KVFormat kFormat>
FP8KV_INLINE cache_t encode(float v, float scale, bool reciprocal) {
  if constexpr (kFormat == KVFormat::AUTO) {
    return static_cast<cache_t>(v);
  } else {
    return float_to_fp8<fp8_format_of(kFormat)>(reciprocal ? v * scale : v / scale);
  }
}

#if defined(FP8KV_ISA_AVX512)
// float_to_fp8 on 16 lanes: fp8.h's integer algorithm, lane by lane, so the bits are identical.
template <Fp8Format F>
FP8KV_INLINE __m128i float_to_fp8_x16(__m512 x) {
  using T = Fp8Traits<F>;
  constexpr int kM = T::kMantissaBits, kDrop = 23 - kM;
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i u = _mm512_castps_si512(x);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  // normal: round the mantissa to kM bits, ties to even, then rebias
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, kDrop), one);
  __m512i normal = _mm512_add_epi32(a, _mm512_add_epi32(_mm512_set1_epi32((1 << (kDrop - 1)) - 1), odd));
  normal = _mm512_sub_epi32(_mm512_srli_epi32(normal, kDrop), _mm512_set1_epi32((127 - T::kBias) << kM));
  // subnormal: units of 2^(1 - bias - kM); shifts past 26 round to 0 like 26 does
  const __m512i exp_field = _mm512_srli_epi32(a, 23);
  const __mmask16 has_exp = _mm512_test_epi32_mask(exp_field, exp_field);
  const __m512i mant = _mm512_mask_or_epi32(a, has_exp, _mm512_and_si512(a, _mm512_set1_epi32(0x7FFFFF)),
                                            _mm512_set1_epi32(0x800000));
  __m512i shift = _mm512_sub_epi32(_mm512_set1_epi32(151 - T::kBias - kM), _mm512_max_epu32(exp_field, one));
  shift = _mm512_min_epu32(shift, _mm512_set1_epi32(26));
  const __m512i half_m1 = _mm512_sub_epi32(_mm512_sllv_epi32(one, _mm512_sub_epi32(shift, one)), one);
  const __m512i sodd = _mm512_and_si512(_mm512_srlv_epi32(mant, shift), one);
  const __m512i subnormal = _mm512_srlv_epi32(_mm512_add_epi32(_mm512_add_epi32(mant, half_m1), sodd), shift);
  const __mmask16 is_normal = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(uint32_t(128 - T::kBias) << 23));
  __m512i mag = _mm512_mask_blend_epi32(is_normal, subnormal, normal);
  mag = _mm512_mask_mov_epi32(mag, _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(T::kMaxBits)),
                              _mm512_set1_epi32(T::kMaxCode));
  __m512i code = _mm512_or_si512(mag, sign);
  if constexpr (!T::kHasNegativeZero) code = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(mag, mag), code);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
  const __m512i nan_code = T::kHasNegativeZero ? _mm512_or_si512(_mm512_set1_epi32(T::kNanCode), sign)
                                               : _mm512_set1_epi32(T::kNanCode);
  return _mm512_cvtepi32_epi8(_mm512_mask_mov_epi32(code, nan, nan_code));
}

template <typename scalar_t>
FP8KV_INLINE __m512 load16_as_float(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// One token and head: 16 dims at a time into the K chunk (contiguous) and the V rows (stride bs).
// kReciprocal: ksc and vsc are reciprocals to multiply by (dynamic scales, see encode).
template <typename scalar_t, Fp8Format F, bool kReciprocal>
void cache_row_fp8(const scalar_t* krow, const scalar_t* vrow, uint8_t* kdst, uint8_t* vdst, int64_t D,
                   int64_t bs, float ksc, float vsc) {
  const __m512 ks = _mm512_set1_ps(ksc), vs = _mm512_set1_ps(vsc);
  const auto apply = [](__m512 x, __m512 s) { return kReciprocal ? _mm512_mul_ps(x, s) : _mm512_div_ps(x, s); };
  for (int64_t c = 0; c < D / 16; ++c) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(kdst + c * bs * 16),
                     float_to_fp8_x16<F>(apply(load16_as_float(krow + 16 * c), ks)));
    alignas(16) uint8_t v[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(v), float_to_fp8_x16<F>(apply(load16_as_float(vrow + 16 * c), vs)));
    for (int i = 0; i < 16; ++i) vdst[(16 * c + i) * bs] = v[i];
  }
}

#endif

#if defined(FP8KV_ISA_AVX512)
// The largest magnitudes of two contiguous rows of D % 16 == 0 elements, NaN left out (the vector max returns its
// second operand then): both reduced at once.
template <typename scalar_t>
FP8KV_INLINE __m128 amax_pair(const scalar_t* a, const scalar_t* b, int64_t D) {
  __m512 ma = _mm512_setzero_ps(), mb = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    ma = _mm512_max_ps(_mm512_abs_ps(load16_as_float(a + d)), ma);
    mb = _mm512_max_ps(_mm512_abs_ps(load16_as_float(b + d)), mb);
  }
  // 128-bit lanes: a's two halves' maxima, then b's; then each pair's; then within the lane
  __m512 m = _mm512_max_ps(_mm512_shuffle_f32x4(ma, mb, 0x44), _mm512_shuffle_f32x4(ma, mb, 0xEE));
  m = _mm512_max_ps(m, _mm512_shuffle_f32x4(m, m, 0xB1));
  m = _mm512_max_ps(m, _mm512_permute_ps(m, 0x4E));
  m = _mm512_max_ps(m, _mm512_permute_ps(m, 0xB1));
  return _mm_unpacklo_ps(_mm512_castps512_ps128(m), _mm512_extractf32x4_ps(m, 2));  // {a's, b's, a's, b's}
}
#endif

// max |row[d * stride]| over d < D, NaN left out (std::fmax and the vector max both skip it).
template <typename scalar_t>
FP8KV_INLINE float row_amax(const scalar_t* row, int64_t stride, int64_t D) {
  int64_t d = 0;
  float m = 0.f;
#if defined(FP8KV_ISA_AVX512)
  if (stride == 1) {
    __m512 acc = _mm512_setzero_ps();
    for (; d + 16 <= D; d += 16) acc = _mm512_max_ps(_mm512_abs_ps(load16_as_float(row + d)), acc);
    m = _mm512_reduce_max_ps(acc);
  }
#endif
  for (; d < D; ++d) m = std::fmax(m, std::fabs(static_cast<float>(row[d * stride])));
  return m;
}

// key/value: [num_tokens, num_kv_heads, head_size] with any strides; caches contiguous.
template <typename scalar_t, typename cache_t, KVFormat kFormat>
void reshape_and_cache_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const std::vector<int64_t>& slots,
                            const CacheGeometry& g, const std::vector<float>& k_scale,
                            const std::vector<float>& v_scale, const ScaleCaches& dyn) {
  const scalar_t* k = key.data_ptr<scalar_t>();
  const scalar_t* v = value.data_ptr<scalar_t>();
  cache_t* kc = static_cast<cache_t*>(key_cache.data_ptr());
  cache_t* vc = static_cast<cache_t*>(value_cache.data_ptr());
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), ks2 = key.stride(2);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1), vs2 = value.stride(2);
  const int64_t H = g.num_kv_heads, D = g.head_size, bs = g.block_size, x = g.x;
  at::parallel_for(0, static_cast<int64_t>(slots.size()), 16, [&](int64_t begin, int64_t end) {
#if defined(FP8KV_ISA_AVX512)
    if constexpr (kFormat != KVFormat::AUTO) {
      if (dyn.dynamic() && ks2 == 1 && vs2 == 1 && D % 16 == 0) {
        // A head's scales (its maximum, a reduction, a division: a chain its codes wait on) are taken one head
        // ahead of its codes, so the chain runs while the head before is quantized: in turn, this write took
        // 1.3x the static one's time at head size 64, now <= 1.1x.
        struct Row {
          const scalar_t *k, *v;
          uint8_t *kdst, *vdst;
          float k_inv, v_inv;  // 1 / its scales
        };
        constexpr Fp8Format F = fp8_format_of(kFormat);
        constexpr float kMax = Fp8Traits<F>::kMax;
        auto quantize = [&](const Row& r) { cache_row_fp8<scalar_t, F, true>(r.k, r.v, r.kdst, r.vdst, D, bs, r.k_inv, r.v_inv); };
        Row pending{};
        bool has_pending = false;
        for (int64_t t = begin; t < end; ++t) {
          const int64_t slot = slots[t];
          if (slot < 0) continue;  // padding
          const int64_t block = slot / bs, offset = slot % bs;
          for (int64_t h = 0; h < H; ++h) {
            const int64_t head = (block * H + h) * D * bs, at = (block * H + h) * bs + offset;  // at: scale caches
            Row row{k + t * ks0 + h * ks1, v + t * vs0 + h * vs1, kc + head + offset * x, vc + head + offset, 0.f, 0.f};
            const __m128 amax = amax_pair(row.k, row.v, D);
            const uint16_t kbits = scale_bits(_mm_cvtss_f32(amax), kMax);
            const uint16_t vbits = scale_bits(_mm_cvtss_f32(_mm_movehdup_ps(amax)), kMax);
            dyn.k[at] = kbits;
            dyn.v[at] = vbits;
            // both reciprocals in one division, exactly as two
            const __m128 inv = _mm_div_ps(_mm_set1_ps(1.f), _mm_setr_ps(scale_value(kbits), scale_value(vbits), 1.f, 1.f));
            row.k_inv = _mm_cvtss_f32(inv);
            row.v_inv = _mm_cvtss_f32(_mm_movehdup_ps(inv));
            if (has_pending) quantize(pending);
            pending = row;
            has_pending = true;
          }
        }
        if (has_pending) quantize(pending);
        return;
      }
    }
#endif
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding
      const int64_t block = slot / bs, offset = slot % bs;
      for (int64_t h = 0; h < H; ++h) {
        const scalar_t* krow = k + t * ks0 + h * ks1;
        const scalar_t* vrow = v + t * vs0 + h * vs1;
        cache_t* kdst = kc + (block * H + h) * D * bs + offset * x;  // + (d / x) * bs * x + d % x
        cache_t* vdst = vc + (block * H + h) * D * bs + offset;      // + d * bs
        float ksc = k_scale[h], vsc = v_scale[h];
        if constexpr (kFormat != KVFormat::AUTO) {
          if (dyn.dynamic()) {  // this token and head's own scales, stored at its slot
            constexpr float kMax = Fp8Traits<fp8_format_of(kFormat)>::kMax;
            const int64_t at = (block * H + h) * bs + offset;
            const uint16_t kbits = scale_bits(row_amax(krow, ks2, D), kMax);
            const uint16_t vbits = scale_bits(row_amax(vrow, vs2, D), kMax);
            dyn.k[at] = kbits;
            dyn.v[at] = vbits;
            ksc = 1.f / scale_value(kbits);
            vsc = 1.f / scale_value(vbits);
          }
        }
#if defined(FP8KV_ISA_AVX512)
        if constexpr (kFormat != KVFormat::AUTO) {
          if (ks2 == 1 && vs2 == 1 && D % 16 == 0) {
            if (dyn.dynamic()) {
              cache_row_fp8<scalar_t, fp8_format_of(kFormat), true>(krow, vrow, kdst, vdst, D, bs, ksc, vsc);
            } else {
              cache_row_fp8<scalar_t, fp8_format_of(kFormat), false>(krow, vrow, kdst, vdst, D, bs, ksc, vsc);
            }
            continue;
          }
        }
#endif
        if constexpr (kFormat == KVFormat::AUTO && std::is_same_v<scalar_t, cache_t>) {
          if (ks2 == 1 && vs2 == 1) {  // the values as they are: K in x-element chunks, V a column of rows
            for (int64_t c = 0; c < D / x; ++c) std::memcpy(kdst + c * bs * x, krow + c * x, x * sizeof(cache_t));
            for (int64_t d = 0; d < D; ++d) vdst[d * bs] = vrow[d];
            continue;
          }
        }
        for (int64_t d = 0; d < D; ++d) {
          kdst[(d / x) * bs * x + d % x] =
              encode<cache_t, kFormat>(static_cast<float>(krow[d * ks2]), ksc, dyn.dynamic());
          vdst[d * bs] = encode<cache_t, kFormat>(static_cast<float>(vrow[d * vs2]), vsc, dyn.dynamic());
        }
      }
    }
  });
}

void check_kv_input(const at::Tensor& t, const char* name, const CacheGeometry& g) {
  TORCH_CHECK(t.dim() == 3 && t.size(1) == g.num_kv_heads && t.size(2) == g.head_size, name,
              " must be [num_tokens, num_kv_heads=", g.num_kv_heads, ", head_size=", g.head_size,
              "], got ", t.sizes());
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  check_model_dtype(t, name);
}

// Head index of each element for a scale broadcast over dim -2 (one scale per head).
int64_t heads_of(const at::Tensor& x, const at::Tensor& scale) {
  if (scale.numel() == 1) return 1;
  TORCH_CHECK(x.dim() >= 2 && x.size(-2) == scale.numel(), "scale with ", scale.numel(),
              " elements must match dim -2 (heads) of the input, whose shape is ", x.sizes());
  return scale.numel();
}

}  // namespace

void reshape_and_cache(FP8KV_RESHAPE_AND_CACHE_PARAMS) {
  const KVFormat format = kv_format_from_code(kv_cache_format);
  const CacheGeometry g = check_caches(key_cache, value_cache, format != KVFormat::AUTO);
  const ScaleCaches dyn = check_scale_caches(k_scale_cache, v_scale_cache, g, format != KVFormat::AUTO, key_cache.device());
  check_kv_input(key, "key", g);
  check_kv_input(value, "value", g);
  TORCH_CHECK(value.size(0) == key.size(0), "key and value have different token counts: ", key.size(0),
              " vs ", value.size(0));
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
              "slot_mapping must be 1-D with one slot per token (", key.size(0), "), got shape ",
              slot_mapping.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt,
              "slot_mapping must be int64 (or int32), got ", slot_mapping.scalar_type());
  const bool fp8 = format != KVFormat::AUTO;  // an "auto" cache ignores the scales
  const std::vector<float> ks = fp8 ? check_scale(k_scale, g.num_kv_heads, "k_scale") : std::vector<float>(g.num_kv_heads, 1.f);
  const std::vector<float> vs = fp8 ? check_scale(v_scale, g.num_kv_heads, "v_scale") : std::vector<float>(g.num_kv_heads, 1.f);

  const at::Tensor slots_t = slot_mapping.to(at::kLong).contiguous();
  std::vector<int64_t> slots(slots_t.data_ptr<int64_t>(), slots_t.data_ptr<int64_t>() + slots_t.numel());
  const int64_t num_slots = g.num_blocks * g.block_size;
  for (size_t i = 0; i < slots.size(); ++i) {
    TORCH_CHECK(slots[i] < num_slots, "slot_mapping[", i, "] = ", slots[i], " is out of range: the cache has ",
                num_slots, " slots (num_blocks * block_size); negative slots mean padding");
  }

  // "auto" stores the cache dtype: convert first (rounding exactly like torch's .to()).
  const at::Tensor k = format == KVFormat::AUTO ? key.to(key_cache.scalar_type()) : key;
  const at::Tensor v = format == KVFormat::AUTO ? value.to(key_cache.scalar_type()) : value;
  const at::ScalarType src = format == KVFormat::AUTO ? key_cache.scalar_type() : key.scalar_type();
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "key and value dtypes differ: ", key.scalar_type(), " vs ",
              value.scalar_type());
#define FP8KV_CALL(scalar_t, cache_t, kFormat) \
  reshape_and_cache_impl<scalar_t, cache_t, kFormat>(k, v, key_cache, value_cache, slots, g, ks, vs, dyn)
  FP8KV_DISPATCH_BY_KV_FORMAT(src, format, FP8KV_CALL);
#undef FP8KV_CALL
}

at::Tensor quantize_fp8(const at::Tensor& x, int64_t kv_cache_format, const at::Tensor& scale) {
  const KVFormat format = kv_format_from_code(kv_cache_format);
  TORCH_CHECK(format != KVFormat::AUTO, "quantize_fp8 needs an FP8 kv_cache_dtype, not 'auto'");
  TORCH_CHECK(x.device().is_cpu(), "quantize_fp8: x must be a CPU tensor");
  check_model_dtype(x, "x");
  const int64_t heads = heads_of(x, scale);
  const std::vector<float> s = check_scale(scale, heads, "scale");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  const float* in = xf.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  const int64_t inner = x.dim() >= 1 ? x.size(-1) : 1;
  const int64_t n = xf.numel();
  auto run = [&](auto format_tag) {
    constexpr Fp8Format F = decltype(format_tag)::value;
    at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
      int64_t i = begin;
#if defined(FP8KV_ISA_AVX512)
      if (inner % 16 == 0) {  // 16 values share one scale
        for (; i % 16 != 0 && i < end; ++i) out[i] = float_to_fp8<F>(in[i] / s[(i / inner) % heads]);
        for (; i + 16 <= end; i += 16) {
          const __m512 scaled = _mm512_div_ps(_mm512_loadu_ps(in + i), _mm512_set1_ps(s[(i / inner) % heads]));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), float_to_fp8_x16<F>(scaled));
        }
      }
#endif
      for (; i < end; ++i) out[i] = float_to_fp8<F>(in[i] / s[(i / inner) % heads]);
    });
  };
  switch (format) {
    case KVFormat::E5M2: run(std::integral_constant<Fp8Format, Fp8Format::E5M2>{}); break;
    case KVFormat::E4M3FNUZ: run(std::integral_constant<Fp8Format, Fp8Format::E4M3FNUZ>{}); break;
    default: run(std::integral_constant<Fp8Format, Fp8Format::E4M3FN>{}); break;
  }
  return codes;
}

at::Tensor dequantize_fp8(const at::Tensor& codes, int64_t kv_cache_format, const at::Tensor& scale,
                          at::ScalarType out_dtype) {
  const KVFormat format = kv_format_from_code(kv_cache_format);
  TORCH_CHECK(format != KVFormat::AUTO, "dequantize_fp8 needs an FP8 kv_cache_dtype, not 'auto'");
  TORCH_CHECK(codes.scalar_type() == at::kByte, "dequantize_fp8: codes must be uint8, got ", codes.scalar_type());
  TORCH_CHECK(codes.device().is_cpu(), "dequantize_fp8: codes must be a CPU tensor");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
              "dequantize_fp8: out_dtype must be float32, bfloat16 or float16, got ", out_dtype);
  const int64_t heads = heads_of(codes, scale);
  const std::vector<float> s = check_scale(scale, heads, "scale");
  const at::Tensor c = codes.contiguous();
  at::Tensor values = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  const uint8_t* in = c.data_ptr<uint8_t>();
  float* out = values.data_ptr<float>();
  const int64_t inner = codes.dim() >= 1 ? codes.size(-1) : 1;
  const int64_t n = c.numel();
  auto run = [&](auto format_tag) {
    constexpr Fp8Format F = decltype(format_tag)::value;
    at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) out[i] = fp8_to_float<F>(in[i]) * s[(i / inner) % heads];
    });
  };
  switch (format) {
    case KVFormat::E5M2: run(std::integral_constant<Fp8Format, Fp8Format::E5M2>{}); break;
    case KVFormat::E4M3FNUZ: run(std::integral_constant<Fp8Format, Fp8Format::E4M3FNUZ>{}); break;
    default: run(std::integral_constant<Fp8Format, Fp8Format::E4M3FN>{}); break;
  }
  return out_dtype == at::kFloat ? values : values.to(out_dtype);
}

}  // namespace fp8kv::cpu
