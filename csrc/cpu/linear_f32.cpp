// float32 linear layer over a weight packed once into column panels: [ceil(N / 16), K, 16], panel p holding
// output columns 16p .. 16p + 15 for every input feature k (zero columns pad the last panel).
//
// Why not oneDNN's packed float32 matmul: at decode batches (a few to a few dozen rows) a layer's weights
// stream from memory once per step and the multiply is short, so what counts is keeping memory busy
// during the FMAs. Here each thread walks its own panels front to back with a software prefetch 16 KB
// ahead on every panel stream. Default model's 30 layers, 16 rows, cold weights, with the 8 x 3 tiles
// alone: 12.2 ms vs 15.2 ms for oneDNN (AMD EPYC Zen 5, 2 threads); at prefill sizes both run at
// ~450 GFLOP/s.
//
// The AVX-512 micro-kernel holds an MR x NR tile of 16-float accumulators (panel_tiles.h: 8 rows x 3
// panels, or 16 rows x 1 panel for decode batches of 9-16 rows), so each weight vector feeds MR FMAs and
// each broadcast input NR: the loads stay under the FMA rate.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "cpu/cpu_ops.h"
#include "cpu/isa.h"
#include "cpu/panel_tiles.h"
#if defined(FP8KV_ISA_AVX2)
#include "cpu/panel_tiles_avx2.h"
#endif

namespace fp8kv::cpu {
namespace {

#if defined(FP8KV_ISA_AVX512)
// y[m, 16j + c] = sum_k x[m, k] * panel_j[k, c] for an MR x NR tile; the last panel stores `last` columns.
// x[m, k] is x[k * ld + m] when kFeatureMajor (decode batches, as linear_bf16 reads them), else x[m * ld + k].
template <int MR, int NR, bool kFeatureMajor>
void tile(const float* x, int64_t ld, const float* panels, int64_t K, float* y, int64_t ldy, const float* bias,
          int last) {
  __m512 acc[MR][NR];
  start_tile(acc, bias, last);
  const int64_t stride = K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[NR];
    for (int j = 0; j < NR; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(panels + j * stride + (k + kPanelAhead) * kPanel), _MM_HINT_T0);
      w[j] = _mm512_loadu_ps(panels + j * stride + k * kPanel);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(kFeatureMajor ? x[k * ld + m] : x[m * ld + k]);
      for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_fmadd_ps(w[j], xb, acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < NR; ++j) _mm512_mask_storeu_ps(y + m * ldy + j * 16, panel_lanes<NR>(j, last), acc[m][j]);
  }
}

#endif

// Portable path: the same panels, one output element at a time.
void panel_group_scalar(const float* x, int64_t M, int64_t K, const float* panels, int num_panels, float* y,
                        int64_t N, const float* bias, int last) {
  for (int64_t m = 0; m < M; ++m) {
    for (int j = 0; j < num_panels; ++j) {
      const int cols = j == num_panels - 1 ? last : kPanel;
      for (int c = 0; c < cols; ++c) {
        float sum = bias ? bias[j * kPanel + c] : 0.f;
        for (int64_t k = 0; k < K; ++k) sum += x[m * K + k] * panels[(j * K + k) * kPanel + c];
        y[m * N + j * kPanel + c] = sum;
      }
    }
  }
}

}  // namespace

at::Tensor linear_f32_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "weight must be a float32 CPU tensor [out_features, in_features], got ", weight.scalar_type(), " ",
              weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({P, K, kPanel}, weight.options());
  const at::Tensor w = weight.contiguous();
  pack_panels<1>(w.data_ptr<float>(), N, K, packed.data_ptr<float>());
  return packed;
}

at::Tensor linear_f32(const at::Tensor& input, const at::Tensor& packed_weight, int64_t out_features,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.device().is_cpu() && input.dim() >= 1,
              "input must be a float32 CPU tensor [..., in_features], got ", input.scalar_type(), " ", input.sizes());
  TORCH_CHECK(packed_weight.dim() == 3 && packed_weight.size(2) == kPanel && packed_weight.is_contiguous() &&
                  packed_weight.scalar_type() == at::kFloat,
              "packed_weight must come from linear_f32_pack ([panels, in_features, 16] float32), got ",
              packed_weight.sizes());
  const int64_t K = packed_weight.size(1), N = out_features, P = packed_weight.size(0);
  TORCH_CHECK(input.size(-1) == K, "input has ", input.size(-1), " features; the weight takes ", K);
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "out_features ", N, " does not match ", P, " panels of 16");
  const float* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == at::kFloat && bias_c.numel() == N, "bias must be float32 [", N, "], got ",
                bias_c.scalar_type(), " ", bias_c.sizes());
    b = bias_c.data_ptr<float>();
  }
  const at::Tensor x = input.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = N;
  at::Tensor out = at::empty(out_shape, input.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed_weight.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  if (M == 0) return out;
#if defined(FP8KV_ISA_AVX512)
  // Decode batches read x feature-major (reads_feature_major; 16-row tiles on Zen 5, one thread, cache-resident
  // weights: 306 -> 243 us at 3072 x 576).
  const bool by_feature = reads_feature_major(M);
  const std::vector<float> xt = by_feature ? feature_major<float>(xp, M, K) : std::vector<float>();
#endif
  for_panel_groups(P, N, M, [&](auto panels_in_tile, int64_t p0, int last) {
    constexpr int NR = decltype(panels_in_tile)::value;
    const float* panels = wp + p0 * K * kPanel;
    float* y = yp + p0 * kPanel;
    const float* bg = b ? b + p0 * kPanel : nullptr;
#if defined(FP8KV_ISA_AVX512)
    for_row_tiles<rows_per_tile(NR)>(M, [&](auto rows, int64_t m) {
      if (by_feature) tile<decltype(rows)::value, NR, true>(xt.data() + m, M, panels, K, y + m * N, N, bg, last);
      else tile<decltype(rows)::value, NR, false>(xp + m * K, K, panels, K, y + m * N, N, bg, last);
    });
#elif defined(FP8KV_ISA_AVX2)
    for (int j = 0; j < NR; ++j) {
      const float* panel = panels + j * K * kPanel;
      float* yj = y + j * kPanel;
      for_row_tiles<6>(M, [&](auto rows, int64_t m) {
        avx2::f32_panel_rows<decltype(rows)::value>(xp + m * K, K, panel, K, bg ? bg + j * kPanel : nullptr,
                                                    j == NR - 1 ? last : kPanel,
                                                    [&](int r, int c, float v) { yj[(m + r) * N + c] = v; });
      });
    }
#else
    panel_group_scalar(xp, M, K, panels, NR, y, N, bg, last);
#endif
  });
  return out;
}

}  // namespace fp8kv::cpu
