// GPU kernel of torch.ops.fp8kv.hadamard_transform (x [..., d] -> x @ H, fp8cache/kvcache/rotation.py's matrix):
// common/hadamard.h's butterfly spread over the lanes of a warp. Torch-free, like the other kernel headers:
// it compiles as CUDA, as HIP, and as plain C++ for the host emulation (FP8KV_HOST_EMULATION).
//
// Each thread holds E consecutive values of a row (E = 8, or block / 32 for Hadamard blocks above 256), so
// one Hadamard block of b values lives in b / E <= 32 neighbouring lanes of a warp. The butterflies of
// distance below E run in the thread's registers; distance E * m pairs the lane with lane ^ m, whose value
// comes by a warp shuffle. A thread block of kHadamardThreads threads covers kHadamardThreads * E values of
// consecutive rows; the blocks of a row, and rows, start at multiples of b / E lanes, so a shuffle never
// leaves its Hadamard block. Every lane takes part in every shuffle (lanes past the last row carry zeros).
#pragma once

#include <cstdint>

#include "platform.cuh"  // first: under hipcc the HIP runtime must come before the common headers

#include "../common/hadamard.h"

namespace fp8kv::gpu {

constexpr int kHadamardThreads = 256;
constexpr int kHadamardMaxLanes = 32;  // lanes per Hadamard block: within one warp on CUDA and ROCm
constexpr int kHadamardMaxBlock = 32 * kHadamardMaxLanes;  // values per Hadamard block with E = 32

template <typename scalar_t>
struct HadamardArgs {
  const scalar_t* in;  // rows of d values, last dim contiguous, row r at in + rows.offset(r); 16-byte aligned
  scalar_t* out;       // [rows.num_rows, d], contiguous
  HadamardRows rows;
  int64_t d;
  int block;   // hadamard_block_size(d), at most kHadamardMaxBlock
  float norm;  // hadamard_norm(block)
};

// Values per thread for Hadamard blocks of `block` values.
inline int hadamard_values_per_thread(int block) { return block <= 8 * kHadamardMaxLanes ? 8 : block / kHadamardMaxLanes; }

// Returns the launch error (success when there is nothing to do). Preconditions, checked by the binding:
// hadamard_supports(d), block <= kHadamardMaxBlock, `in` 16-byte aligned and its row strides multiples of 8.
template <typename scalar_t>
Error launch_hadamard_transform(const HadamardArgs<scalar_t>& args, Stream stream);

#define FP8KV_FOR_EACH_HADAMARD_TYPE(X) \
  X(float)                              \
  X(::fp8kv::gpu::half_t)               \
  X(::fp8kv::gpu::bf16_t)

// The bits of a 16-bit value (half_t, bf16_t), little end first when two are packed into a word.
template <typename T>
FP8KV_DEVICE uint16_t bits16(T x) {
  static_assert(sizeof(T) == 2, "bits16 takes a 16-bit type");
  uint16_t bits;
  __builtin_memcpy(&bits, &x, sizeof(bits));
  return bits;
}

template <typename scalar_t, int E, class Thread>
FP8KV_DEVICE void hadamard_transform_body(const HadamardArgs<scalar_t>& a, const Thread& th) {
  static_assert(E % 8 == 0, "values per thread come in 16-byte (or wider) loads of 8");
  const int64_t chunks_per_row = a.d / E;
  const int64_t chunk = static_cast<int64_t>(th.block_x()) * kHadamardThreads + th.index();
  const bool active = chunk < a.rows.num_rows * chunks_per_row;
  const int64_t row = active ? chunk / chunks_per_row : 0;
  const int64_t col = (chunk - row * chunks_per_row) * E;

  float v[E];
  if (active) {
    const scalar_t* src = a.in + a.rows.offset(row) + col;
    FP8KV_UNROLL
    for (int i = 0; i < E; i += 8) {
      const Vec<scalar_t, 8> x = load_vec<scalar_t, 8>(src + i);
      FP8KV_UNROLL
      for (int j = 0; j < 8; ++j) v[i + j] = to_float(x.e[j]);
    }
  } else {
    FP8KV_UNROLL
    for (int i = 0; i < E; ++i) v[i] = 0.0f;
  }
  fwht_registers<E>(v);
  const int lanes = a.block / E;
  for (int m = 1; m < lanes; m <<= 1) {  // distance E * m: the partner is lane ^ m
    const bool upper = (th.index() & m) != 0;
    FP8KV_UNROLL
    for (int i = 0; i < E; ++i) {
      const float other = th.shfl_xor(v[i], m);
      v[i] = upper ? other - v[i] : v[i] + other;
    }
  }
  if (active) {
    scalar_t* dst = a.out + row * a.d + col;
    FP8KV_UNROLL
    for (int i = 0; i < E; i += 8) {
      if constexpr (sizeof(scalar_t) == 2) {
        // 16-bit values go out as 32-bit words: Debian's clang 15 crashes in AMDGPU instruction selection on
        // the direct 16-bit stores for E >= 16 (the bytes written are the same).
        Vec<uint32_t, 4> y;
        FP8KV_UNROLL
        for (int j = 0; j < 4; ++j) {
          y.e[j] = uint32_t(bits16(from_float<scalar_t>(v[i + 2 * j] * a.norm))) |
                   (uint32_t(bits16(from_float<scalar_t>(v[i + 2 * j + 1] * a.norm))) << 16);
        }
        store_vec<uint32_t, 4>(reinterpret_cast<uint32_t*>(dst + i), y);
      } else {
        Vec<scalar_t, 8> y;
        FP8KV_UNROLL
        for (int j = 0; j < 8; ++j) y.e[j] = from_float<scalar_t>(v[i + j] * a.norm);
        store_vec<scalar_t, 8>(dst + i, y);
      }
    }
  }
}

#if !defined(FP8KV_PLATFORM_HOST)
template <typename scalar_t, int E>
__global__ void __launch_bounds__(kHadamardThreads) hadamard_transform_kernel(const HadamardArgs<scalar_t> args) {
  hadamard_transform_body<scalar_t, E>(args, GpuThread{});
}
#endif

}  // namespace fp8kv::gpu
