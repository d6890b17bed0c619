// torch.ops.fp8kv.hadamard_transform(Tensor x) -> Tensor: x [..., d] times fp8cache/kvcache/rotation.py's Hadamard
// matrix H (block-diagonal for head sizes that are not a power of two), in x's dtype: the same as
// `(x.float() @ H).to(x.dtype)` up to float32 rounding, in O(d log d) per row instead of O(d^2).
//
// Schema and CPU kernel (the CUDA/HIP kernel is cuda/hadamard.cu). The math is common/hadamard.h's
// butterfly in float32; rows run in parallel (at::parallel_for, OpenMP). In AVX-512 and AVX2 builds the
// butterflies of distance below the vector width run inside one register (a lane permute and an FMA with
// +-1 per stage) and the wider ones between registers, and bfloat16/float16 convert 8 or 16 at a time.
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "common/hadamard.h"
#include "cpu/isa.h"
#include "hadamard_checks.h"

namespace fp8kv::cpu {
namespace {

#if defined(FP8KV_ISA_AVX512) || defined(FP8KV_ISA_AVX2)
// 8 float lanes (AVX2 + F16C + FMA).
struct Lanes8 {
  using reg = __m256;
  static constexpr int kWidth = 8;

  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg load(const c10::BFloat16* p) {
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(w), 16));
  }
  static reg load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static void store(c10::BFloat16* p, reg v) {
    // c10::BFloat16's rounding: to nearest even, any NaN -> 0x7FC0.
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void store(c10::Half* p, reg v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg set1(float x) { return _mm256_set1_ps(x); }

  // Stages h = 1, 2, 4 inside the register: lane i gets v[i] * (bit h of i ? -1 : 1) + v[i ^ h], which is
  // a + b in the lower lane of each pair and a - b in the upper (exact: one rounding, like an add).
  static reg butterflies(reg v) {
    v = _mm256_fmadd_ps(v, _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1), _mm256_permute_ps(v, 0xB1));
    v = _mm256_fmadd_ps(v, _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1), _mm256_permute_ps(v, 0x4E));
    return _mm256_fmadd_ps(v, _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1), _mm256_permute2f128_ps(v, v, 0x01));
  }
};
#endif

#if defined(FP8KV_ISA_AVX512)
// 16 float lanes (AVX-512 F/BW).
struct Lanes16 {
  using reg = __m512;
  static constexpr int kWidth = 16;

  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static reg load(const c10::BFloat16* p) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
  }
  static reg load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static void store(c10::BFloat16* p, reg v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store(c10::Half* p, reg v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg set1(float x) { return _mm512_set1_ps(x); }

  // Stages h = 1, 2, 4, 8 inside the register, as Lanes8::butterflies (0xB1 / 0x4E swap neighbouring
  // floats, pairs, then 128-bit lanes).
  static reg butterflies(reg v) {
    v = _mm512_fmadd_ps(v, _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1),
                        _mm512_permute_ps(v, 0xB1));
    v = _mm512_fmadd_ps(v, _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1),
                        _mm512_permute_ps(v, 0x4E));
    v = _mm512_fmadd_ps(v, _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1),
                        _mm512_shuffle_f32x4(v, v, 0xB1));
    return _mm512_fmadd_ps(v, _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1),
                           _mm512_shuffle_f32x4(v, v, 0x4E));
  }
};
#endif

// One row: in -> out = in @ H. `buf` holds d floats for the paths that need room.
template <typename scalar_t>
using RowFn = void (*)(const scalar_t* in, scalar_t* out, float* buf, int64_t d, int64_t block, float norm);

#if defined(FP8KV_ISA_AVX512) || defined(FP8KV_ISA_AVX2)
// Butterflies of distance HV registers (HV * kWidth values) between the registers of a row, where the
// Hadamard block spans more than HV registers. Static indices, so the row stays in registers.
template <class L, int NV, int HV>
FP8KV_INLINE void stage_between_registers(typename L::reg (&v)[NV], int64_t block_regs) {
  if constexpr (HV < NV) {
    if (HV >= block_regs) return;
#pragma GCC unroll 16
    for (int k = 0; k < NV; ++k) {
      if ((k & HV) == 0 && k + HV < NV) {
        const typename L::reg a = v[k], b = v[k + HV];
        v[k] = L::add(a, b);
        v[k + HV] = L::sub(a, b);
      }
    }
  }
}

// A row of NV registers (d = NV * kWidth, up to 16 registers): loaded, transformed and stored without
// touching memory in between.
template <class L, int NV, typename scalar_t>
void transform_row_in_registers(const scalar_t* in, scalar_t* out, float*, int64_t, int64_t block, float norm) {
  constexpr int W = L::kWidth;
  typename L::reg v[NV];
#pragma GCC unroll 16
  for (int k = 0; k < NV; ++k) v[k] = L::butterflies(L::load(in + k * W));
  const int64_t block_regs = block / W;
  stage_between_registers<L, NV, 1>(v, block_regs);
  stage_between_registers<L, NV, 2>(v, block_regs);
  stage_between_registers<L, NV, 4>(v, block_regs);
  stage_between_registers<L, NV, 8>(v, block_regs);
  const typename L::reg n = L::set1(norm);
#pragma GCC unroll 16
  for (int k = 0; k < NV; ++k) L::store(out + k * W, L::mul(v[k], n));
}

// Any row of whole registers, through `buf` (for rows longer than 16 registers).
template <class L, typename scalar_t>
void transform_row_through_buffer(const scalar_t* in, scalar_t* out, float* buf, int64_t d, int64_t block,
                                  float norm) {
  constexpr int64_t W = L::kWidth;
  for (int64_t c = 0; c < d; c += W) L::store(buf + c, L::butterflies(L::load(in + c)));
  for (int64_t h = W; h < block; h <<= 1) {
    for (int64_t i = 0; i < d; i += 2 * h) {
      for (int64_t j = i; j < i + h; j += W) {
        const typename L::reg a = L::load(buf + j), b = L::load(buf + j + h);
        L::store(buf + j, L::add(a, b));
        L::store(buf + j + h, L::sub(a, b));
      }
    }
  }
  const typename L::reg n = L::set1(norm);
  for (int64_t c = 0; c < d; c += W) L::store(out + c, L::mul(L::load(buf + c), n));
}

constexpr int64_t kMaxRegistersPerRow = 16;

template <class L, typename scalar_t, size_t... I>
RowFn<scalar_t> in_registers_for(int64_t num_regs, std::index_sequence<I...>) {
  static constexpr RowFn<scalar_t> table[] = {&transform_row_in_registers<L, int(I) + 1, scalar_t>...};
  return table[num_regs - 1];
}

// The row function for rows of d values with L's registers (d a multiple of its width).
template <class L, typename scalar_t>
RowFn<scalar_t> vectorized_row_function(int64_t d) {
  const int64_t num_regs = d / L::kWidth;
  if (num_regs > kMaxRegistersPerRow) return &transform_row_through_buffer<L, scalar_t>;
  return in_registers_for<L, scalar_t>(num_regs, std::make_index_sequence<kMaxRegistersPerRow>{});
}
#endif

template <typename scalar_t>
void transform_row_scalar(const scalar_t* in, scalar_t* out, float* buf, int64_t d, int64_t block, float norm) {
  for (int64_t c = 0; c < d; ++c) buf[c] = static_cast<float>(in[c]);
  fwht(buf, d, block);
  for (int64_t c = 0; c < d; ++c) out[c] = static_cast<scalar_t>(buf[c] * norm);
}

template <typename scalar_t>
RowFn<scalar_t> row_function(int64_t d) {
#if defined(FP8KV_ISA_AVX512)
  if (d % Lanes16::kWidth == 0) return vectorized_row_function<Lanes16, scalar_t>(d);
  return vectorized_row_function<Lanes8, scalar_t>(d);  // d = 8 * odd: blocks of 8
#elif defined(FP8KV_ISA_AVX2)
  return vectorized_row_function<Lanes8, scalar_t>(d);
#else
  (void)d;  // one scalar loop fits every row length
  return &transform_row_scalar<scalar_t>;
#endif
}

template <typename scalar_t>
void transform_rows(const scalar_t* in, scalar_t* out, const HadamardRows& rows, int64_t d) {
  const int64_t block = hadamard_block_size(d);
  const float norm = hadamard_norm(block);
  const RowFn<scalar_t> transform_row = row_function<scalar_t>(d);
  // A task of at least ~16K values keeps the threads' start-up cost small next to the work.
  const int64_t grain = std::max<int64_t>(1, 16384 / d);
  at::parallel_for(0, rows.num_rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(d));
    int64_t outer = begin / rows.inner_rows, inner = begin % rows.inner_rows;  // HadamardRows::offset, stepped
    for (int64_t r = begin; r < end; ++r) {
      transform_row(in + outer * rows.outer_stride + inner * rows.inner_stride, out + r * d, buf.data(), d,
                    block, norm);
      if (++inner == rows.inner_rows) {
        inner = 0;
        ++outer;
      }
    }
  });
}

}  // namespace

at::Tensor hadamard_transform(const at::Tensor& x) {
  const int64_t d = check_hadamard_input(x);
  const auto dtype = x.scalar_type();
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  at::Tensor src = x.stride(-1) == 1 ? x : x.contiguous();
  HadamardRows rows{};
  if (!collapse_rows(src.sizes().data(), src.strides().data(), static_cast<int>(src.dim()) - 1, &rows)) {
    src = src.contiguous();  // leading dimensions too scattered to walk with two strides
    collapse_rows(src.sizes().data(), src.strides().data(), static_cast<int>(src.dim()) - 1, &rows);
  }
  switch (dtype) {
    case at::kFloat:
      transform_rows(src.data_ptr<float>(), out.data_ptr<float>(), rows, d);
      break;
    case at::kBFloat16:
      transform_rows(src.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, d);
      break;
    default:
      transform_rows(src.data_ptr<c10::Half>(), out.data_ptr<c10::Half>(), rows, d);
      break;
  }
  return out;
}

}  // namespace fp8kv::cpu

// A fragment, so the schema lives beside its kernel and ../torch_bindings.cpp stays as it is.
TORCH_LIBRARY_FRAGMENT(fp8kv, m) { m.def("hadamard_transform(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(fp8kv, CPU, m) { m.impl("hadamard_transform", &fp8kv::cpu::hadamard_transform); }
