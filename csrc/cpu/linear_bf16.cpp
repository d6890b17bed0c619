// bfloat16 linear layer over a weight packed once into column panels of k pairs: [ceil(N / 16), K2, 16, 2]
// with K2 = ceil(K / 2), panel p holding W[16p + c, 2kk + e] at [p, kk, c, e] (zeros pad the last panel and an
// odd K). One 64-byte row of a panel is one AVX512-BF16 dot-product operand: 16 columns x 2 inputs.
//
// Why not oneDNN's packed bfloat16 matmul: at decode batches it streams the weights at ~16 GB/s here
// (default model's 30 layers, 16 rows: 13.1 ms for 212 MB), where the same walk as linear_f32 (each thread
// its own panels front to back, a software prefetch 16 KB ahead, all rows of a decode batch in one pass)
// keeps memory busier. Products of bfloat16 values are exact in float32; sums are float32 (the dot-product
// instruction flushes denormals), the result is rounded to bfloat16 once, after the bias, as F.linear does, or
// kept in float32 (float32_out: a language-model head, whose bfloat16 logits would tie tokens 1/8 apart).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include "cpu/cpu_ops.h"
#include "cpu/isa.h"
#include "cpu/panel_tiles.h"
#if defined(FP8KV_ISA_AVX2)
#include "cpu/panel_tiles_avx2.h"
#endif
// AMX tiles for larger batches (amx_tiles.h), where the compiler knows them (GCC 11, Clang 12); used only
// where the CPU has them.
#if defined(FP8KV_ISA_AVX512) && defined(__AVX512BF16__) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#include "cpu/amx_tiles.h"
#define FP8KV_LINEAR_AMX 1
#endif

namespace fp8kv::cpu {
namespace {

using bf16 = c10::BFloat16;

#if defined(FP8KV_ISA_AVX512) && defined(__AVX512BF16__)
// Two bfloat16 features read as one dot-product operand (x's own storage when it is one row).
typedef int32_t __attribute__((may_alias, aligned(2))) Pair;

// y[m, 16j + c] = bias + sum_k x[m, k] * W[16j + c, k] for an MR x NR tile (rounded once when y_t is
// bfloat16). x's pair of features 2kk, 2kk + 1 of row m: pairs[kk * ld + m] when kPairMajor (feature_major: one
// pointer reaches every row's pair), else pairs[m * ld + kk] (x's own rows).
template <int MR, int NR, bool kPairMajor, typename y_t>
void tile(const Pair* pairs, int64_t ld, const bf16* panels, int64_t K2, y_t* y, int64_t ldy, const float* bias,
          int last) {
  __m512 acc[MR][NR];
  start_tile(acc, bias, last);
  const int64_t stride = K2 * 2 * kPanel;
  for (int64_t kk = 0; kk < K2; ++kk) {
    __m512i w[NR];
    for (int j = 0; j < NR; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(panels + j * stride + (kk + kPanelAhead) * 2 * kPanel), _MM_HINT_T0);
      w[j] = _mm512_loadu_si512(panels + j * stride + kk * 2 * kPanel);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512i xb = _mm512_set1_epi32(kPairMajor ? pairs[kk * ld + m] : pairs[m * ld + kk]);
      for (int j = 0; j < NR; ++j) {
        acc[m][j] = _mm512_dpbf16_ps(acc[m][j], reinterpret_cast<__m512bh>(w[j]), reinterpret_cast<__m512bh>(xb));
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < NR; ++j) {
      if constexpr (std::is_same_v<y_t, float>) {
        _mm512_mask_storeu_ps(y + m * ldy + j * 16, panel_lanes<NR>(j, last), acc[m][j]);
      } else {
        const __m256i r = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[m][j]));  // round to nearest even
        _mm256_mask_storeu_epi16(y + m * ldy + j * 16, panel_lanes<NR>(j, last), r);
      }
    }
  }
}

#endif

// Portable path: the same panels, one output element at a time, float32 sums.
template <typename y_t>
void panel_group_scalar(const bf16* x, int64_t M, int64_t ldx, int64_t K2, const bf16* panels, int num_panels,
                        y_t* y, int64_t N, const float* bias, int last) {
  for (int64_t m = 0; m < M; ++m) {
    for (int j = 0; j < num_panels; ++j) {
      const bf16* panel = panels + j * K2 * 2 * kPanel;
      for (int c = 0; c < (j == num_panels - 1 ? last : kPanel); ++c) {
        float sum = bias ? bias[j * kPanel + c] : 0.f;
        for (int64_t k = 0; k < 2 * K2; ++k) {
          sum += static_cast<float>(x[m * ldx + k]) * static_cast<float>(panel[(k / 2 * kPanel + c) * 2 + k % 2]);
        }
        y[m * N + j * kPanel + c] = static_cast<y_t>(sum);
      }
    }
  }
}

}  // namespace

at::Tensor linear_bf16_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "weight must be a bfloat16 CPU tensor [out_features, in_features], got ", weight.scalar_type(), " ",
              weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel, K2 = (K + 1) / 2;
  at::Tensor packed = at::zeros({P, K2, kPanel, 2}, weight.options());
  const at::Tensor w = weight.contiguous();
  pack_panels<2>(w.data_ptr<bf16>(), N, K, packed.data_ptr<bf16>());
  return packed;
}

at::Tensor linear_bf16(const at::Tensor& input, const at::Tensor& packed_weight, int64_t out_features,
                       const std::optional<at::Tensor>& bias, bool float32_out) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.device().is_cpu() && input.dim() >= 1,
              "input must be a bfloat16 CPU tensor [..., in_features], got ", input.scalar_type(), " ", input.sizes());
  TORCH_CHECK(packed_weight.dim() == 4 && packed_weight.size(2) == kPanel && packed_weight.size(3) == 2 &&
                  packed_weight.is_contiguous() && packed_weight.scalar_type() == at::kBFloat16,
              "packed_weight must come from linear_bf16_pack ([panels, in_features / 2, 16, 2] bfloat16), got ",
              packed_weight.sizes());
  const int64_t K = input.size(-1), K2 = packed_weight.size(1), N = out_features, P = packed_weight.size(0);
  TORCH_CHECK(K2 == (K + 1) / 2, "input has ", K, " features; the weight takes ", 2 * K2 - 1, " or ", 2 * K2);
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "out_features ", N, " does not match ", P, " panels of 16");
  const float* b = nullptr;
  at::Tensor bias_f32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias must have ", N, " elements, got ", bias->sizes());
    bias_f32 = bias->to(at::kFloat).contiguous();
    b = bias_f32.data_ptr<float>();
  }
  // Rows of an even number of features (an odd K gets a zero column, as the weight has a zero row).
  at::Tensor x = input.reshape({-1, K});
  if (K % 2 != 0) {
    at::Tensor padded = at::zeros({x.size(0), K + 1}, x.options());
    padded.narrow(1, 0, K).copy_(x);
    x = padded;
  }
  x = x.contiguous();
  const int64_t M = x.size(0), ldx = x.size(1);
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = N;
  at::Tensor out = at::empty(out_shape, input.options().dtype(float32_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = packed_weight.data_ptr<bf16>();
  const auto run = [&](auto* yp) {
    using y_t = std::remove_pointer_t<decltype(yp)>;
#if defined(FP8KV_LINEAR_AMX)
    if (M >= amx::kAmxMinRows && amx::amx_ready()) {
      const auto parallel = [](int64_t n, auto&& fn) { at::parallel_for(0, n, 1, fn); };
      amx::linear<amx::AmxHardware>(reinterpret_cast<const uint16_t*>(xp), M, 2 * K2, ldx,
                                    reinterpret_cast<const uint16_t*>(wp), P, K2, yp, N, b, parallel);
      return;
    }
#endif
#if defined(FP8KV_ISA_AVX2)
    std::vector<float> xf(static_cast<size_t>(M * ldx));  // x widened once: the tiles broadcast floats
    for (size_t i = 0; i < xf.size(); ++i) xf[i] = static_cast<float>(xp[i]);
#endif
#if defined(FP8KV_ISA_AVX512) && defined(__AVX512BF16__)
    // x's rows as pairs of features; pair-major for decode batches (on Zen 5, one thread, cache-resident weights,
    // their 16-row tiles ran at 66% of the dot-product peak over 16 row pointers).
    const bool pair_major = reads_feature_major(M);
    const std::vector<int32_t> transposed = pair_major ? feature_major<int32_t>(xp, M, K2) : std::vector<int32_t>();
    const Pair* pairs = reinterpret_cast<const Pair*>(pair_major ? static_cast<const void*>(transposed.data()) : xp);
#endif
    for_panel_groups(P, N, M, [&](auto panels_in_tile, int64_t p0, int last) {
      constexpr int NR = decltype(panels_in_tile)::value;
      const bf16* panels = wp + p0 * K2 * 2 * kPanel;
      y_t* y = yp + p0 * kPanel;
      const float* bg = b ? b + p0 * kPanel : nullptr;
#if defined(FP8KV_ISA_AVX512) && defined(__AVX512BF16__)
      for_row_tiles<rows_per_tile(NR)>(M, [&](auto rows, int64_t m) {
        if (pair_major) tile<decltype(rows)::value, NR, true>(pairs + m, M, panels, K2, y + m * N, N, bg, last);
        else tile<decltype(rows)::value, NR, false>(pairs + m * K2, K2, panels, K2, y + m * N, N, bg, last);
      });
#elif defined(FP8KV_ISA_AVX2)
      std::vector<float> widened;  // batches over 16 rows: a panel widened once, then float32 tiles over all rows
      for (int j = 0; j < NR; ++j) {
        const uint16_t* panel = reinterpret_cast<const uint16_t*>(panels + j * K2 * 2 * kPanel);
        y_t* yj = y + j * kPanel;
        const float* bj = bg ? bg + j * kPanel : nullptr;
        const int cols = j == NR - 1 ? last : kPanel;
        auto store = [&](int64_t m) { return [yj, m, N](int r, int c, float v) { yj[(m + r) * N + c] = y_t(v); }; };
        if (M > 16) {
          widened.resize(static_cast<size_t>(2 * K2 * kPanel));
          avx2::widen_bf16_panel(panel, K2, widened.data());
          for_row_tiles<6>(M, [&](auto rows, int64_t m) {
            avx2::f32_panel_rows<decltype(rows)::value>(xf.data() + m * ldx, ldx, widened.data(), 2 * K2, bj, cols,
                                                        store(m));
          });
        } else {
          for_row_tiles<4>(M, [&](auto rows, int64_t m) {
            avx2::bf16_panel_rows<decltype(rows)::value>(xf.data() + m * ldx, ldx, panel, K2, bj, cols, store(m));
          });
        }
      }
#else
      panel_group_scalar(xp, M, ldx, K2, panels, NR, y, N, bg, last);
#endif
    });
  };
  if (float32_out) {
    run(out.data_ptr<float>());
  } else {
    run(out.data_ptr<bf16>());
  }
  return out;
}

}  // namespace fp8kv::cpu
