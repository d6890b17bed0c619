// The panel linear kernels' AVX2 tiles (CPUs with AVX2 and FMA but not the AVX-512 path: AMD Zen 2/3, Intel
// Haswell to Cascade Lake), over the same packed panels as the AVX-512 tiles: one panel (16 output columns,
// two 8-float halves) by up to 6 rows (float32) or 4 rows (bfloat16 weights), within the 16 vector registers.
// A decode step streams each weight once, front to back, with a software prefetch 16 KB ahead, as the AVX-512
// kernels do; oneDNN's and MKL's kernels, which the AVX2 path used before, read decode batches' weights
// more slowly. bfloat16 weights widen to float32 in registers (a shift or a mask per 8 pairs), so a bfloat16
// model reads half the bytes of a float32 one; sums are float32.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/panel_tiles.h"

namespace fp8kv::cpu::avx2 {

// 8 pairs of bfloat16 weights (a panel row's half: 32-bit lane c holds W[c, 2kk] low, W[c, 2kk + 1] high) as the
// floats of features 2kk (even) and 2kk + 1 (odd): a shift and a mask.
inline void widen_pairs(const uint16_t* pairs, __m256& even, __m256& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// y[m, c] = bias[c] + the tile's row m for c < cols. The accumulators leave their registers through
// constant indices only: indexed by a loop counter in the store loop, gcc kept the whole array on the stack
// and stored every accumulator at every step of the multiply loop.
template <int MR, typename Store>
inline void store_tile(const float (&out)[MR][16], const float* bias, int cols, Store& store) {
  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < cols; ++c) store(m, c, out[m][c] + (bias ? bias[c] : 0.f));
  }
}

// One float32 panel ([K][16] floats) by MR rows of x (row stride ldx); store(m, c, value) writes y.
template <int MR, typename Store>
inline void f32_panel_rows(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias, int cols,
                           Store&& store) {
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPanelAhead) * 16), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(panel + k * 16), w1 = _mm256_loadu_ps(panel + k * 16 + 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
      acc[m][0] = _mm256_fmadd_ps(w0, xb, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(w1, xb, acc[m][1]);
    }
  }
  alignas(32) float out[MR][16];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    _mm256_store_ps(out[m], acc[m][0]);
    _mm256_store_ps(out[m] + 8, acc[m][1]);
  }
  store_tile(out, bias, cols, store);
}

// One bfloat16 panel ([K2][16][2] words) by MR rows of x, already widened to float32 (row stride ldx, 2 * K2
// features), widened by widen_pairs. One or two rows keep even and odd features in separate
// accumulators, so enough multiply-adds are in flight (one row would otherwise wait on its two chains).
template <int MR, typename Store>
inline void bf16_panel_rows(const float* x, int64_t ldx, const uint16_t* panel, int64_t K2, const float* bias,
                            int cols, Store&& store) {
  constexpr int kChains = MR <= 2 ? 2 : 1;
  __m256 acc[kChains][MR][2];
  for (int s = 0; s < kChains; ++s) {
    for (int m = 0; m < MR; ++m) acc[s][m][0] = acc[s][m][1] = _mm256_setzero_ps();
  }
  for (int64_t kk = 0; kk < K2; ++kk) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (kk + kPanelAhead) * 32), _MM_HINT_T0);
    __m256 even[2], odd[2];
    for (int h = 0; h < 2; ++h) widen_pairs(panel + kk * 32 + 16 * h, even[h], odd[h]);
    for (int m = 0; m < MR; ++m) {
      const __m256 x0 = _mm256_broadcast_ss(x + m * ldx + 2 * kk), x1 = _mm256_broadcast_ss(x + m * ldx + 2 * kk + 1);
      for (int h = 0; h < 2; ++h) {
        acc[0][m][h] = _mm256_fmadd_ps(even[h], x0, acc[0][m][h]);
        acc[kChains - 1][m][h] = _mm256_fmadd_ps(odd[h], x1, acc[kChains - 1][m][h]);
      }
    }
  }
  alignas(32) float out[MR][16];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    _mm256_store_ps(out[m], kChains == 2 ? _mm256_add_ps(acc[0][m][0], acc[kChains - 1][m][0]) : acc[0][m][0]);
    _mm256_store_ps(out[m] + 8, kChains == 2 ? _mm256_add_ps(acc[0][m][1], acc[kChains - 1][m][1]) : acc[0][m][1]);
  }
  store_tile(out, bias, cols, store);
}

// A bfloat16 panel ([K2][16][2] words) as a float32 one ([2 * K2][16] floats), for f32_panel_rows: larger
// batches widen each weight once instead of once per 4-row tile (256 rows, 15 of the default model's layers:
// 132.8 -> 112.8 ms, against 107.0 for float32 weights).
inline void widen_bf16_panel(const uint16_t* panel, int64_t K2, float* out) {
  for (int64_t kk = 0; kk < K2; ++kk) {
    for (int h = 0; h < 2; ++h) {
      __m256 even, odd;
      widen_pairs(panel + kk * 32 + 16 * h, even, odd);
      _mm256_storeu_ps(out + (2 * kk) * 16 + 8 * h, even);
      _mm256_storeu_ps(out + (2 * kk + 1) * 16 + 8 * h, odd);
    }
  }
}

}  // namespace fp8kv::cpu::avx2
