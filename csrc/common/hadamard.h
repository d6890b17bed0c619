// Fast Walsh-Hadamard transform over the head dimension (kv rotation "hadamard"), shared by the CPU, CUDA
// and HIP ops. Torch-free; usable on host and device.
//
// The matrix is fp8cache/kvcache/rotation.py's: for a row of d values, H = block_diag(S_b, ..., S_b) / sqrt(b), where
// b is the largest power of two dividing d (at least kHadamardMinBlock, else the head size is refused) and
// S_b is the Sylvester Hadamard matrix, S_1 = [1], S_2n = [[S_n, S_n], [S_n, -S_n]], so that
// S_b[i][j] = (-1)^popcount(i & j). The transform computes the row vector x H.
//
// Why the butterfly is exactly x S_b: S_b is the Kronecker product of log2(b) copies of S_2, one per bit of
// the index, and the stage with distance h (pairs i, i + h for i without bit h, in natural order, no bit
// reversal) multiplies by the S_2 of bit h. Each stage is b additions, so a row costs O(b log b) per block
// instead of the O(d^2) multiply-adds of a matmul with H. S_b is symmetric and H orthonormal, so the same
// transform also rotates back.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>  // hipcc defines __forceinline__ and __host__/__device__ only here
#endif

// FP8KV_HOST_DEVICE and FP8KV_INLINE as common/fp8.h defines them (the same tokens, so either header may
// come first).
#if defined(__CUDACC__) || defined(__HIPCC__)
#ifndef FP8KV_HOST_DEVICE
#define FP8KV_HOST_DEVICE __host__ __device__
#endif
#ifndef FP8KV_INLINE
#define FP8KV_INLINE __forceinline__
#endif
#define FP8KV_HADAMARD_UNROLL _Pragma("unroll")
#else
#ifndef FP8KV_HOST_DEVICE
#define FP8KV_HOST_DEVICE
#endif
#ifndef FP8KV_INLINE
#define FP8KV_INLINE inline __attribute__((always_inline))
#endif
#define FP8KV_HADAMARD_UNROLL
#endif

namespace fp8kv {

// Smaller blocks spread an outlier over too few channels to help (rotation.py's MIN_BLOCK).
constexpr int64_t kHadamardMinBlock = 8;

// The Hadamard block size for rows of d values: the largest power of two dividing d (0 if d <= 0).
FP8KV_HOST_DEVICE constexpr int64_t hadamard_block_size(int64_t d) { return d > 0 ? (d & -d) : 0; }

FP8KV_HOST_DEVICE constexpr bool hadamard_supports(int64_t d) {
  return hadamard_block_size(d) >= kHadamardMinBlock;
}

// H's nonzero magnitude as float32: 1 / sqrt(b) rounded once from double, as rotation.py's matrix is
// (S_b / math.sqrt(b) in float64, then .to(float32)). Host only; kernels get it as an argument.
inline float hadamard_norm(int64_t block) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(block))); }

// One butterfly stage in place: for every pair (j, j + h) with bit h of j clear, (a, b) -> (a + b, a - b).
// n must be a multiple of 2h.
template <typename T>
FP8KV_HOST_DEVICE FP8KV_INLINE void fwht_stage(T* x, int64_t n, int64_t h) {
  for (int64_t i = 0; i < n; i += 2 * h) {
    for (int64_t j = i; j < i + h; ++j) {
      const T a = x[j], b = x[j + h];
      x[j] = a + b;
      x[j + h] = a - b;
    }
  }
}

// x[0, n) in place: every consecutive run of `block` values times S_block (unnormalised); block a power of
// two dividing n.
template <typename T>
FP8KV_HOST_DEVICE FP8KV_INLINE void fwht(T* x, int64_t n, int64_t block) {
  for (int64_t h = 1; h < block; h <<= 1) fwht_stage(x, n, h);
}

// N values held in registers (N a power of two, a compile-time constant so every index is static): times S_N.
template <int N>
FP8KV_HOST_DEVICE FP8KV_INLINE void fwht_registers(float (&v)[N]) {
  static_assert(N > 0 && (N & (N - 1)) == 0, "fwht_registers needs a power-of-two count");
  FP8KV_HADAMARD_UNROLL
  for (int h = 1; h < N; h <<= 1) {
    FP8KV_HADAMARD_UNROLL
    for (int j = 0; j < N; ++j) {
      if ((j & h) == 0) {
        const float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
    }
  }
}

// Where the rows of a [..., d] tensor start: its leading dimensions collapsed to at most two, so row r
// begins (r / inner_rows) * outer_stride + (r % inner_rows) * inner_stride elements into the data. This
// covers contiguous rows and e.g. a [tokens, heads, d] view of a [heads, tokens, d] tensor without a copy.
struct HadamardRows {
  int64_t num_rows;
  int64_t inner_rows;  // >= 1
  int64_t outer_stride;
  int64_t inner_stride;

  FP8KV_HOST_DEVICE int64_t offset(int64_t r) const {
    return (r / inner_rows) * outer_stride + (r % inner_rows) * inner_stride;
  }
};

// The HadamardRows of leading dimensions sizes[0, n) / strides[0, n) (elements), or false when they do not
// collapse to two (the caller then makes the tensor contiguous). Host only.
inline bool collapse_rows(const int64_t* sizes, const int64_t* strides, int n, HadamardRows* rows) {
  int64_t size[2] = {1, 1}, stride[2] = {0, 0};
  int kept = 0;  // collapsed dimensions so far, innermost last
  int64_t num_rows = 1;
  for (int i = 0; i < n; ++i) {
    num_rows *= sizes[i];
    if (sizes[i] == 1) continue;  // a size-1 dimension's stride never matters
    if (kept > 0 && stride[kept - 1] == strides[i] * sizes[i]) {
      size[kept - 1] *= sizes[i];  // dimension i continues the previous one
      stride[kept - 1] = strides[i];
    } else if (kept < 2) {
      size[kept] = sizes[i];
      stride[kept] = strides[i];
      ++kept;
    } else {
      return false;
    }
  }
  if (num_rows == 0) {
    *rows = HadamardRows{0, 1, 0, 0};
  } else if (kept < 2) {  // one (or no) dimension: all rows are "inner"
    *rows = HadamardRows{num_rows, num_rows, 0, kept == 1 ? stride[0] : 0};
  } else {
    *rows = HadamardRows{num_rows, size[1], stride[0], stride[1]};
  }
  return true;
}

}  // namespace fp8kv
