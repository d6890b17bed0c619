// linear_bf16's prefill batches on AMX tiles (Intel Sapphire Rapids and later), over the same packed panels
// its AVX512-BF16 kernel reads: a panel's K2 x 16 x 2 words are, 16 pairs at a time, exactly the "B" operand
// of TDPBF16PS (16 rows of 16 column pairs), so one packed copy serves both kernels. The dot-product kernel
// keeps decode batches (a few rows: one pass over the weights, bound by memory); AMX takes batches of
// kAmxMinRows rows and more, where the multiplies bound the time and oneDNN's AMX kernels ran several times
// faster than the dot products.
//
// Torch-free, and templated on the tile instructions: AmxHardware issues them; AmxEmulated runs their
// documented semantics in C++, so the kernel's tiling, padding and epilogue are tested on any AVX512-BF16
// CPU (tests/ops/test_amx_emulation.py, through csrc/cpu/standalone/amx_runner.cpp).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <cpuid.h>

#define FP8KV_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))

namespace fp8kv::cpu::amx {

constexpr int kAmxMinRows = 17;  // decode batches up to 16 rows stay on the dot-product kernel
constexpr int kRowsPerBlock = 32;  // two A tiles of 16 rows
constexpr int kPairsPerTile = 16;  // k pairs per A / B tile: 32 inputs, 64 bytes a row

// The tile palette: every tile 16 rows x 64 bytes. Tiles 0-3 accumulate (rows 0-15 / 16-31 x the two panels),
// 4-5 hold the x rows (A), 6-7 the two panels' 16 k pairs (B).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// Whether this CPU has AMX-TILE and AMX-BF16 and the kernel lets this process use them (Linux keeps the
// 8 KB tile state off until a process asks for it; a kernel older than 5.16 refuses).
inline bool amx_ready() {
  static const bool ready = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
    if (!tile || !bf16) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ready;
}

// GCC's tile intrinsics paste the tile number into the instruction text, so each must be a literal: the
// kernel's tiles are spelled out here (accumulators 0-3, A 4-5, B 6-7). GCC 12's LDTILECFG and TILELOADD
// name only 8 bytes of their operand, or none, as memory they read: `written` makes every store to it land
// first (the kernel's padded tail tiles and config are locals the compiler could otherwise drop as unread).
struct AmxHardware {
  static inline void written(const void* p) { __asm__ volatile("" : : "r"(p) : "memory"); }
  static FP8KV_AMX_TARGET inline void configure(const TileConfig& config) {
    written(&config);
    _tile_loadconfig(&config);
  }
  static FP8KV_AMX_TARGET inline void release() { _tile_release(); }
  template <int T>
  static FP8KV_AMX_TARGET inline void zero() {
    static_assert(T >= 0 && T <= 3, "accumulators are tiles 0-3");
    if constexpr (T == 0) _tile_zero(0);
    else if constexpr (T == 1) _tile_zero(1);
    else if constexpr (T == 2) _tile_zero(2);
    else _tile_zero(3);
  }
  template <int T>
  static FP8KV_AMX_TARGET inline void load(const void* src, int64_t stride) {
    static_assert(T >= 4 && T <= 7, "operands are tiles 4-7");
    written(src);
    if constexpr (T == 4) _tile_loadd(4, src, stride);
    else if constexpr (T == 5) _tile_loadd(5, src, stride);
    else if constexpr (T == 6) _tile_loadd(6, src, stride);
    else _tile_loadd(7, src, stride);
  }
  template <int T>
  static FP8KV_AMX_TARGET inline void store(void* dst, int64_t stride) {
    static_assert(T >= 0 && T <= 3, "accumulators are tiles 0-3");
    if constexpr (T == 0) _tile_stored(0, dst, stride);
    else if constexpr (T == 1) _tile_stored(1, dst, stride);
    else if constexpr (T == 2) _tile_stored(2, dst, stride);
    else _tile_stored(3, dst, stride);
  }
  template <int C, int A, int B>
  static FP8KV_AMX_TARGET inline void dot() {
    if constexpr (C == 0 && A == 4 && B == 6) _tile_dpbf16ps(0, 4, 6);
    else if constexpr (C == 1 && A == 4 && B == 7) _tile_dpbf16ps(1, 4, 7);
    else if constexpr (C == 2 && A == 5 && B == 6) _tile_dpbf16ps(2, 5, 6);
    else {
      static_assert(C == 3 && A == 5 && B == 7, "the kernel's four products only");
      _tile_dpbf16ps(3, 5, 7);
    }
  }
};

// TDPBF16PS and friends as Intel's SDM defines them, per thread: c.fp32[m][n] += a[m][2k] * b[k][2n], then
// += a[m][2k+1] * b[k][2n+1], for k in order; bfloat16 denormal inputs read as zero and denormal sums flush
// to zero (the products of two bfloat16 values are exact in float32).
struct AmxEmulated {
  struct State {
    TileConfig config;
    alignas(64) uint8_t tiles[8][1024] = {};
  };
  static State& state() {
    static thread_local State s;
    return s;
  }
  static void configure(const TileConfig& config) { state().config = config; }
  static void release() { state() = State(); }
  template <int T>
  static void zero() {
    std::memset(state().tiles[T], 0, sizeof(state().tiles[T]));
  }
  template <int T>
  static void load(const void* src, int64_t stride) {
    State& s = state();
    for (int r = 0; r < s.config.rows[T]; ++r) {
      std::memcpy(s.tiles[T] + 64 * r, static_cast<const uint8_t*>(src) + r * stride, s.config.colsb[T]);
    }
  }
  template <int T>
  static void store(void* dst, int64_t stride) {
    State& s = state();
    for (int r = 0; r < s.config.rows[T]; ++r) {
      std::memcpy(static_cast<uint8_t*>(dst) + r * stride, s.tiles[T] + 64 * r, s.config.colsb[T]);
    }
  }
  template <int C, int A, int B>
  static void dot() {
    State& s = state();
    const int rows = s.config.rows[C], cols = s.config.colsb[C] / 4, pairs = s.config.colsb[A] / 4;
    for (int m = 0; m < rows; ++m) {
      float* c = reinterpret_cast<float*>(s.tiles[C] + 64 * m);
      const uint16_t* a = reinterpret_cast<const uint16_t*>(s.tiles[A] + 64 * m);
      for (int k = 0; k < pairs; ++k) {
        const uint16_t* b = reinterpret_cast<const uint16_t*>(s.tiles[B] + 64 * k);
        for (int n = 0; n < cols; ++n) {
          c[n] = flush(c[n] + widen(a[2 * k]) * widen(b[2 * n]));
          c[n] = flush(c[n] + widen(a[2 * k + 1]) * widen(b[2 * n + 1]));
        }
      }
    }
  }

 private:
  static float widen(uint16_t h) {
    const uint32_t bits = (h & 0x7F80u) == 0 ? (h & 0x8000u) << 16 : static_cast<uint32_t>(h) << 16;  // DAZ
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static float flush(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    if ((bits & 0x7F800000u) == 0) bits &= 0x80000000u;  // FTZ
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
};

// y rows [m0, min(m0 + 16, M)) x the 16 columns of panel p from one accumulator tile (c: 16 x 16 floats),
// plus the bias, rounded to bfloat16 once (or kept in float32).
template <typename y_t>
inline void store_rows(const float* c, int64_t m0, int64_t M, int64_t p, int64_t N, const float* bias, y_t* y) {
  const int cols = static_cast<int>(std::min<int64_t>(16, N - 16 * p));
  const __mmask16 lanes = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(lanes, bias + 16 * p) : _mm512_setzero_ps();
  for (int64_t r = 0; r < 16 && m0 + r < M; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_load_ps(c + 16 * r), b);
    y_t* dst = y + (m0 + r) * N + 16 * p;
    if constexpr (sizeof(y_t) == 4) {
      _mm512_mask_storeu_ps(dst, lanes, v);
    } else {
      _mm256_mask_storeu_epi16(dst, lanes, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));  // round to nearest even
    }
  }
}

// Panels [p_begin, p_end) for all rows, two panels x 32 rows a block. Rows [0, full_rows) come from x, the
// block after them (if M > full_rows) from tail; both have ldx words a row (a multiple of 32), zero past the
// input's features, and tail zero past the input's rows. panels: [P, K2, 16, 2] words.
template <class Tiles, typename y_t>
FP8KV_AMX_TARGET void panel_range(const uint16_t* x, int64_t full_rows, const uint16_t* tail_rows, int64_t ldx,
                                  const uint16_t* panels, int64_t K2, int64_t p_begin, int64_t p_end, y_t* y,
                                  int64_t M, int64_t N, const float* bias) {
  constexpr int64_t kPanelWords = 16 * 2;  // one k pair of a panel: 16 columns x 2 inputs
  const int64_t full = K2 / kPairsPerTile, steps = (K2 + kPairsPerTile - 1) / kPairsPerTile;
  const int64_t tail_pairs = K2 - full * kPairsPerTile;
  alignas(64) uint16_t tail[2][kPairsPerTile * kPanelWords];  // a partial last B tile, zero-padded
  alignas(64) float acc[4][16 * 16];
  const TileConfig config;
  Tiles::configure(config);
  for (int64_t p = p_begin; p < p_end; p += 2) {
    const bool pair = p + 1 < p_end;
    const uint16_t* b0 = panels + p * K2 * kPanelWords;
    const uint16_t* b1 = pair ? b0 + K2 * kPanelWords : b0;  // a lone last panel: its twin's results are dropped
    if (tail_pairs > 0) {
      std::memset(tail, 0, sizeof(tail));
      std::memcpy(tail[0], b0 + full * kPairsPerTile * kPanelWords, tail_pairs * kPanelWords * 2);
      std::memcpy(tail[1], b1 + full * kPairsPerTile * kPanelWords, tail_pairs * kPanelWords * 2);
    }
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerBlock) {
      const uint16_t* a0 = m0 < full_rows ? x + m0 * ldx : tail_rows + (m0 - full_rows) * ldx;
      const uint16_t* a1 = a0 + 16 * ldx;
      Tiles::template zero<0>();
      Tiles::template zero<1>();
      Tiles::template zero<2>();
      Tiles::template zero<3>();
      for (int64_t s = 0; s < steps; ++s) {
        const bool whole = s < full;
        Tiles::template load<4>(a0 + s * 2 * kPairsPerTile, ldx * 2);
        Tiles::template load<5>(a1 + s * 2 * kPairsPerTile, ldx * 2);
        Tiles::template load<6>(whole ? b0 + s * kPairsPerTile * kPanelWords : tail[0], 64);
        Tiles::template load<7>(whole ? b1 + s * kPairsPerTile * kPanelWords : tail[1], 64);
        Tiles::template dot<0, 4, 6>();
        Tiles::template dot<1, 4, 7>();
        Tiles::template dot<2, 5, 6>();
        Tiles::template dot<3, 5, 7>();
      }
      Tiles::template store<0>(acc[0], 64);
      Tiles::template store<1>(acc[1], 64);
      Tiles::template store<2>(acc[2], 64);
      Tiles::template store<3>(acc[3], 64);
      store_rows(acc[0], m0, M, p, N, bias, y);
      store_rows(acc[2], m0 + 16, M, p, N, bias, y);
      if (pair) {
        store_rows(acc[1], m0, M, p + 1, N, bias, y);
        store_rows(acc[3], m0 + 16, M, p + 1, N, bias, y);
      }
    }
  }
  Tiles::release();
}

// y [M, N] = x [M, K] (bfloat16 words, row stride ldx) . the packed panels [P, K2, 16, 2] + bias. The tiles read
// 32 rows x 32 features at a time: x is read in place where its rows hold a multiple of 32 features; a last
// partial block of rows (and every row, for other feature counts) is copied, zero-padded.
// parallel(n, fn) runs fn(begin, end) over [0, n) in chunks (at::parallel_for in the op library).
template <class Tiles, typename y_t, typename Parallel>
void linear(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* panels, int64_t P, int64_t K2,
            y_t* y, int64_t N, const float* bias, Parallel&& parallel) {
  const int64_t ld = (2 * K2 + 2 * kPairsPerTile - 1) / (2 * kPairsPerTile) * (2 * kPairsPerTile);
  const bool in_place = ld == ldx && K == ldx;
  const int64_t full_rows = in_place ? M / kRowsPerBlock * kRowsPerBlock : 0;
  const int64_t copied_rows = M - full_rows;
  std::vector<uint16_t> padded(static_cast<size_t>((copied_rows + kRowsPerBlock - 1) / kRowsPerBlock *
                                                   kRowsPerBlock * ld), 0);
  for (int64_t m = 0; m < copied_rows; ++m) {
    std::memcpy(padded.data() + m * ld, x + (full_rows + m) * ldx, K * sizeof(uint16_t));
  }
  const int64_t pairs = (P + 1) / 2;
  parallel(pairs, [&](int64_t begin, int64_t end) {
    panel_range<Tiles>(x, full_rows, padded.data(), ld, panels, K2, 2 * begin, std::min(P, 2 * end), y, M, N, bias);
  });
}

}  // namespace fp8kv::cpu::amx
