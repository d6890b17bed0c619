// The loops fp8kv's panel linear kernels (linear_f32.cpp, linear_bf16.cpp) share: threads over groups of
// column panels, and within a group, rows in register tiles of MR with one smaller tile for the rest.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>

#include "cpu/isa.h"
#if defined(FP8KV_ISA_AVX512)
#include <immintrin.h>
#endif

namespace fp8kv::cpu {

constexpr int kPanel = 16;  // output columns per panel

// Packs weight [N, K] (row-major, src) into the panels the kernels read: feature n, input k at
// dst[((p * Kp + k / kPair) * kPanel + n % kPanel) * kPair + k % kPair], p = n / kPanel, Kp = ceil(K / kPair)
// (kPair 2: bfloat16's k pairs). dst comes zeroed, so the last panel's and pair's padding stays 0.
template <int kPair, typename T>
void pack_panels(const T* src, int64_t N, int64_t K, T* dst) {
  const int64_t P = (N + kPanel - 1) / kPanel, Kp = (K + kPair - 1) / kPair;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t n = p * kPanel; n < std::min(N, (p + 1) * kPanel); ++n) {
        for (int64_t k = 0; k < K; ++k) {
          dst[((p * Kp + k / kPair) * kPanel + n % kPanel) * kPair + k % kPair] = src[n * K + k];
        }
      }
    }
  });
}

// Rows of one register tile against NR panels: 8 x 3, 12 x 2 or 16 x 1 accumulators (24, 24 and 16 zmm).
constexpr int rows_per_tile(int NR) { return NR == 3 ? 8 : NR == 2 ? 12 : 16; }

// Panels per tile for M rows. 9 to 16 rows: one panel at a time with all rows in one 16-row tile, so each
// thread reads its panels once, front to back; 8 x 3 tiles would take two passes, the second from L2 with
// no memory traffic behind it. Default model's 30 layers, cold weights, float32: 16 rows 15.4 -> 12.2 ms,
// 12 rows 14.7 -> 11.6 ms; no gain at 20 or more rows, none at 8 or fewer (already one pass).
inline int64_t panels_per_tile(int64_t M) { return M > 8 && M <= 16 ? 1 : 3; }

// fn(std::integral_constant<int, NR>, first_panel, last) for the groups of panels_per_tile(M) consecutive
// panels (fewer at the end), spread over the threads, each thread a contiguous run of groups; `last` counts
// the columns of a group's last panel.
template <typename Fn>
void for_panel_groups(int64_t num_panels, int64_t out_features, int64_t M, Fn&& fn) {
  const int64_t group = panels_per_tile(M);
  const int64_t groups = (num_panels + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p0 = g * group;
      const int np = static_cast<int>(std::min<int64_t>(group, num_panels - p0));
      const int last = static_cast<int>(std::min<int64_t>(kPanel, out_features - (p0 + np - 1) * kPanel));
      if (np == 3) fn(std::integral_constant<int, 3>{}, p0, last);
      else if (np == 2) fn(std::integral_constant<int, 2>{}, p0, last);
      else fn(std::integral_constant<int, 1>{}, p0, last);
    }
  });
}

constexpr int64_t kPanelAhead = 256;  // panel rows (64 bytes each) between a weight prefetch and its use: 16 KB

// Decode batches of 2 to 16 rows read x feature-major (feature_major): their 16-row tiles would otherwise read
// 16 row pointers, more than the registers hold (gcc kept them in vector registers, a move per broadcast).
// Larger batches keep x's rows: their 8-row tiles have registers enough, and the copy cost more than it saved.
inline bool reads_feature_major(int64_t M) { return M > 1 && M <= 16; }

// x's M rows of K elements of type T, feature-major: out[k * M + m] = element k of row m. Elements are read
// with memcpy, so T may be a view of other storage (bfloat16 pairs as int32_t) at any alignment.
template <typename T>
std::vector<T> feature_major(const void* rows, int64_t M, int64_t K) {
  const char* bytes = static_cast<const char*>(rows);
  std::vector<T> out(static_cast<size_t>(M * K));
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t m = 0; m < M; ++m) std::memcpy(&out[k * M + m], bytes + (m * K + k) * sizeof(T), sizeof(T));
  }
  return out;
}

#if defined(FP8KV_ISA_AVX512)

// Lanes of panel j in an NR-panel tile that hold output columns: all 16, or `last` in the tile's last panel.
template <int NR>
inline __mmask16 panel_lanes(int j, int last) {
  return j == NR - 1 ? __mmask16((1u << last) - 1u) : __mmask16(0xFFFF);
}

// Every row's accumulators start from the bias of their panel's columns (zero without a bias).
template <int MR, int NR>
inline void start_tile(__m512 (&acc)[MR][NR], const float* bias, int last) {
  for (int j = 0; j < NR; ++j) {
    const __m512 b = bias ? _mm512_maskz_loadu_ps(panel_lanes<NR>(j, last), bias + j * kPanel) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) acc[m][j] = b;
  }
}
#endif

template <int R, int MR, typename Fn>
inline void rest_tile(int64_t rows, Fn& fn) {
  if constexpr (R < MR) {
    if (rows == R) {
      fn(std::integral_constant<int, R>{});
    } else {
      rest_tile<R + 1, MR>(rows, fn);
    }
  }
}

// fn(std::integral_constant<int, rows>, first_row) for M rows: full MR-row tiles, then one of the rest.
template <int MR, typename Fn>
inline void for_row_tiles(int64_t M, Fn&& fn) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) fn(std::integral_constant<int, MR>{}, m);
  auto rest = [&](auto rows) { fn(rows, m); };
  rest_tile<1, MR>(M - m, rest);
}

}  // namespace fp8kv::cpu
