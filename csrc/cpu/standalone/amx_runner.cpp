// Runs linear_bf16's AMX kernel (amx_tiles.h) outside torch with the tile instructions emulated
// (AmxEmulated), so its tiling, padding and epilogue are tested on CPUs without AMX
// (tests/ops/test_amx_emulation.py). With --hardware it issues the real instructions (an AMX CPU only).
//
// Not part of the op library. Built by the test with
//   g++ -std=c++20 -O2 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -I csrc amx_runner.cpp
// It reads one request on stdin and writes its result on stdout, both little-endian binary:
//   int64 M, K, N, has_bias, float32_out; uint16 x[M][K] (bfloat16 bits);
//   uint16 panels[ceil(N / 16)][ceil(K / 2)][16][2] (linear_bf16_pack's layout); float32 bias[N] if has_bias
//   -> y[M][N]: float32, or bfloat16 bits (uint16)
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu/amx_tiles.h"
#include "cpu/standalone/binary_io.h"

namespace {

using fp8kv::standalone::fail;
using fp8kv::standalone::read;
using fp8kv::standalone::write;

template <class Tiles, typename y_t>
void run(const std::vector<uint16_t>& x, int64_t M, int64_t K, const std::vector<uint16_t>& panels, int64_t P,
         int64_t K2, int64_t N, const float* bias) {
  std::vector<y_t> y(static_cast<size_t>(M * N));
  // Two chunks, as two threads would take them: each configures its own tiles.
  auto parallel = [](int64_t n, auto&& fn) {
    fn(0, n / 2);
    fn(n / 2, n);
  };
  fp8kv::cpu::amx::linear<Tiles>(x.data(), M, K, K, panels.data(), P, K2, y.data(), N, bias, parallel);
  write(y);
}

template <class Tiles>
void serve() {
  const std::vector<int64_t> head = read<int64_t>(5);
  const int64_t M = head[0], K = head[1], N = head[2];
  if (M < 0 || K < 1 || N < 1) fail("bad shape");
  const int64_t P = (N + 15) / 16, K2 = (K + 1) / 2;
  const std::vector<uint16_t> x = read<uint16_t>(M * K);
  const std::vector<uint16_t> panels = read<uint16_t>(P * K2 * 32);
  const std::vector<float> bias = head[3] ? read<float>(N) : std::vector<float>();
  const float* b = head[3] ? bias.data() : nullptr;
  if (head[4]) run<Tiles, float>(x, M, K, panels, P, K2, N, b);
  else run<Tiles, uint16_t>(x, M, K, panels, P, K2, N, b);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--hardware") == 0) {
    if (!fp8kv::cpu::amx::amx_ready()) fail("this CPU (or kernel) gives no AMX tiles");
    serve<fp8kv::cpu::amx::AmxHardware>();
  } else {
    serve<fp8kv::cpu::amx::AmxEmulated>();
  }
  return 0;
}
