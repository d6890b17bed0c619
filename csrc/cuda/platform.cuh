// What the GPU kernels need from the platform, behind one small surface so that the same kernel source
// compiles as CUDA (nvcc), as HIP (hipcc, or torch's hipify of this file) and as plain C++20 for the
// host emulation that tests the kernel logic on machines without a GPU (FP8KV_HOST_EMULATION).
//
// Torch-free: this header, the kernel headers and kernels_*.cu never include torch.
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(FP8KV_HOST_EMULATION)
#include <atomic>
#include <cmath>
#if defined(FP8KV_HOST_EMULATION_CUDA_FP8)
#include <cuda_fp8.h>  // its host versions of the sm_89+ conversions, to test that path (see fp8_encode)
#endif
#define FP8KV_DEVICE inline
#define FP8KV_UNROLL
#define FP8KV_PLATFORM_HOST 1
#elif defined(USE_ROCM) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
#define FP8KV_DEVICE __device__ __forceinline__
#define FP8KV_UNROLL _Pragma("unroll")
#define FP8KV_PLATFORM_ROCM 1
#else
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#define FP8KV_DEVICE __device__ __forceinline__
#define FP8KV_UNROLL _Pragma("unroll")
#define FP8KV_PLATFORM_CUDA 1
#endif

// Keeps the compiler from moving shared-memory loads across it: without it, loads of one tile's queries or
// probabilities that several unrolled iterations share are hoisted and held in registers all at once.
#define FP8KV_COMPILER_FENCE() asm volatile("" ::: "memory")

// After the runtime headers: under hipcc, fp8.h's __forceinline__ comes from hip_runtime.h.
#include "../common/fp8.h"

namespace fp8kv::gpu {

#if defined(FP8KV_PLATFORM_ROCM) || defined(FP8KV_PLATFORM_CUDA)
// The runtime's name for a thing: hipStream_t or cudaStream_t, hipSuccess or cudaSuccess.
#if defined(FP8KV_PLATFORM_ROCM)
#define FP8KV_RUNTIME(name) hip##name
#if defined(__AMDGCN_WAVEFRONT_SIZE)
constexpr int kWarpSize = __AMDGCN_WAVEFRONT_SIZE;
#else
constexpr int kWarpSize = 64;  // host pass; only device code reads it
#endif
#else
#define FP8KV_RUNTIME(name) cuda##name
constexpr int kWarpSize = 32;
#endif
using Stream = FP8KV_RUNTIME(Stream_t);
using Error = FP8KV_RUNTIME(Error_t);
constexpr Error kSuccess = FP8KV_RUNTIME(Success);
constexpr Error kInvalidValue = FP8KV_RUNTIME(ErrorInvalidValue);
inline Error last_launch_error() { return FP8KV_RUNTIME(GetLastError)(); }
using half_t = __half;
#else
using Stream = void*;
using Error = int;
constexpr Error kSuccess = 0;
constexpr Error kInvalidValue = 1;
using half_t = _Float16;  // g++ >= 12 on x86-64: IEEE binary16 with round-to-nearest-even conversions
constexpr int kWarpSize = 32;
#endif

// bfloat16 as its bits, identical on every platform and laid out like torch's c10::BFloat16 (no dependence
// on cuda_bf16.h vs hip_bfloat16, and exactly torch's rounding for the output).
struct alignas(2) bf16_t {
  uint16_t bits;
};

// Error bits the kernels raise instead of touching memory outside the cache (see launch.h).
FP8KV_DEVICE void report_error(int* flag, int bits) {
#if defined(FP8KV_PLATFORM_HOST)
  std::atomic_ref<int>(*flag).fetch_or(bits);
#else
  atomicOr(flag, bits);
#endif
}

FP8KV_DEVICE float half_bits_to_float(uint16_t bits) {
#if defined(FP8KV_PLATFORM_HOST)
  _Float16 h;
  std::memcpy(&h, &bits, sizeof(h));
  return static_cast<float>(h);
#else
  return __half2float(__ushort_as_half(bits));
#endif
}

// ---- model dtypes <-> float -------------------------------------------------------------------------

FP8KV_DEVICE float to_float(float v) { return v; }
FP8KV_DEVICE float to_float(bf16_t v) { return bits_to_float(uint32_t(v.bits) << 16); }
FP8KV_DEVICE float to_float(half_t v) {
#if defined(FP8KV_PLATFORM_HOST)
  return static_cast<float>(v);
#else
  return __half2float(v);
#endif
}

template <typename T>
FP8KV_DEVICE T from_float(float v);

template <>
FP8KV_DEVICE float from_float<float>(float v) {
  return v;
}

template <>
FP8KV_DEVICE bf16_t from_float<bf16_t>(float v) {
  // torch's c10::BFloat16: round to nearest even, any NaN becomes the canonical 0x7FC0.
  const uint32_t u = float_to_bits(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16_t{0x7FC0};
  return bf16_t{static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}

template <>
FP8KV_DEVICE half_t from_float<half_t>(float v) {
#if defined(FP8KV_PLATFORM_HOST)
  return static_cast<_Float16>(v);
#else
  return __float2half_rn(v);
#endif
}

// ---- FP8 codes <-> float ----------------------------------------------------------------------------
// On sm_89+ cuda_fp8.h converts with one instruction (cvt.rn.satfinite: round to nearest even and
// saturation, as docs/design.md section 3 asks). Elsewhere (older GPUs, E4M3FNUZ, HIP, host) the shared software
// conversion of common/fp8.h is used: the CPU ops run the same code, so both builds store the same bits.

#if (defined(FP8KV_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890) || \
    defined(FP8KV_HOST_EMULATION_CUDA_FP8)
#define FP8KV_HW_FP8 1
#endif

template <Fp8Format F>
FP8KV_DEVICE uint8_t fp8_encode(float x) {
#if defined(FP8KV_HW_FP8)
  if constexpr (F != Fp8Format::E4M3FNUZ) {
    // The hardware writes one canonical NaN; torch keeps the NaN's sign bit, so NaNs take the shared path.
    if (x != x) return float_to_fp8<F>(x);
    return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, F == Fp8Format::E5M2 ? __NV_E5M2 : __NV_E4M3);
  }
#endif
  return float_to_fp8<F>(x);
}

template <Fp8Format F>
FP8KV_DEVICE float fp8_decode(uint8_t code) {
#if defined(FP8KV_HW_FP8)
  if constexpr (F != Fp8Format::E4M3FNUZ) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(code, F == Fp8Format::E5M2 ? __NV_E5M2 : __NV_E4M3);
    return half_bits_to_float(h.x);
  }
#endif
  // fp16 bits times a power of two is exact; NaN codes of the E4M3 formats have no fp16 twin.
  if (fp8_is_nan<F>(code)) return bits_to_float(0x7FC00000u);
  return half_bits_to_float(fp8_to_half_bits<F>(code)) * Fp8Traits<F>::kHalfRescale;
}

// The values of codes[0 .. N) (N even), two codes per conversion: on sm_89+ one instruction turns a pair into
// two halves, where decoding one code at a time also spends integer work taking each byte apart (an FP8
// attention kernel measured on an H100 was bound by its integer pipe).
template <Fp8Format F, int N>
FP8KV_DEVICE void fp8_decode_pairs(const uint8_t* codes, float* out) {
#if defined(FP8KV_HW_FP8)
  constexpr bool kPairs = F != Fp8Format::E4M3FNUZ;
#else
  constexpr bool kPairs = false;
#endif
  if constexpr (kPairs) {
#if defined(FP8KV_HW_FP8)
    const auto* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(codes);
    FP8KV_UNROLL
    for (int i = 0; i < N / 2; ++i) {
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pairs[i], F == Fp8Format::E5M2 ? __NV_E5M2 : __NV_E4M3);
#if defined(__CUDA_ARCH__)
      const float2 f = __half22float2(__half2(h));
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
#else
      out[2 * i] = half_bits_to_float(h.x);
      out[2 * i + 1] = half_bits_to_float(h.y);
#endif
    }
#endif
  } else {
    FP8KV_UNROLL
    for (int i = 0; i < N; ++i) out[i] = fp8_decode<F>(codes[i]);
  }
}

// ---- what a kernel thread can do ---------------------------------------------------------------------

// The element type of a tensor-core tile's A and B operands (accumulation is always float).
enum class MmaType { kF16, kBF16 };

#if !defined(FP8KV_PLATFORM_HOST)
// The calling GPU thread. Kernel bodies take a `Thread` so the host emulation can stand in for it.
struct GpuThread {
  FP8KV_DEVICE int index() const { return threadIdx.x; }
  FP8KV_DEVICE int block_x() const { return blockIdx.x; }
  FP8KV_DEVICE int block_y() const { return blockIdx.y; }
  FP8KV_DEVICE int block_z() const { return blockIdx.z; }
  FP8KV_DEVICE void sync() const { __syncthreads(); }
  FP8KV_DEVICE void sync_warp() const {
#if defined(FP8KV_PLATFORM_ROCM)
    __builtin_amdgcn_wave_barrier();  // a wavefront runs in lockstep; this orders its shared-memory accesses
#else
    __syncwarp();
#endif
  }
  FP8KV_DEVICE float shfl_xor(float v, int lane_mask) const {
#if defined(FP8KV_PLATFORM_ROCM)
    return __shfl_xor(v, lane_mask);
#else
    return __shfl_xor_sync(0xFFFFFFFFu, v, lane_mask);
#endif
  }
#if defined(FP8KV_PLATFORM_CUDA)
  // What the tensor-core decode kernel (attention_tc_kernels.cuh) needs besides: CUDA only (HIP keeps the
  // CUDA-core kernel), the host emulation has its own.
  FP8KV_DEVICE float shfl(float v, int src_lane) const { return __shfl_sync(0xFFFFFFFFu, v, src_lane); }
  FP8KV_DEVICE uint32_t shfl_xor_bits(uint32_t v, int lane_mask) const {
    return __shfl_xor_sync(0xFFFFFFFFu, v, lane_mask);
  }
  FP8KV_DEVICE uint32_t ballot(bool pred) const { return __ballot_sync(0xFFFFFFFFu, pred); }

  // D = A * B + D for one m16n8k16 tile: A 16x16 (row-major fragment), B 16x8 (column-major), f32
  // accumulators; fragment layouts as PTX defines them for mma.m16n8k16.
  template <MmaType kType>
  FP8KV_DEVICE void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (kType == MmaType::kF16) {
      asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
      asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
#else
    __trap();  // the host picks this kernel only on sm_80+
#endif
  }

  // kBytes (8 or 16) from global memory into shared memory without passing through registers; the last
  // kBytes - src_bytes bytes are zero-filled (src_bytes 0: nothing is read, src only has to be a valid
  // address). Completes in order of copy_commit groups: copy_wait(n) leaves at most n groups in flight, and
  // then this thread sees its own copies (other threads' need a barrier too).
  template <int kBytes>
  FP8KV_DEVICE void copy_async(void* dst, const void* src, int src_bytes) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const auto to = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    if constexpr (kBytes == 16) {
      // .cg: the cache is streamed once, keep it out of L1; an L2 line of 128 bytes per request, as a warp's
      // requests cover whole lines between them.
      asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(src_bytes)
                   : "memory");
    } else {
      static_assert(kBytes == 8, "cp.async copies 4, 8 or 16 bytes; 8 and 16 are used");
      asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], 8, %2;\n" ::"r"(to), "l"(src), "r"(src_bytes)
                   : "memory");
    }
#else
    __trap();
#endif
  }
  FP8KV_DEVICE void copy_commit() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
  }
  FP8KV_DEVICE void copy_wait(int pending) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    switch (pending) {  // the count is an immediate
      case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
      case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
      case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
      default: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    }
#endif
  }
#endif
};
#endif

// ---- small vectors for wide loads and stores ----------------------------------------------------------

// N elements loaded or stored as one (16 bytes at most per access, which every GPU here can do).
template <typename T, int N>
struct alignas(sizeof(T) * N >= 16 ? 16 : sizeof(T) * N) Vec {
  T e[N];
};

template <typename T, int N>
FP8KV_DEVICE Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <typename T, int N>
FP8KV_DEVICE void store_vec(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

}  // namespace fp8kv::gpu
