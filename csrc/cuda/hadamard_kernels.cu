// Launcher of the Hadamard kernel (hadamard.cuh) and its instantiations. Torch-free, so
// scripts/compile_check.sh builds it for sm_80/89/90 with nvcc and for gfx90a with hipcc.
//
// Compiled as C++20 with -DFP8KV_HOST_EMULATION it is instead a small host library that runs the same kernel
// body with each GPU thread a fiber (host_fibers.h; a warp shuffle is an exchange between two barriers of the
// warp's threads, as in host_emulation.cpp), so tests/ops/test_hadamard_op.py can check the kernel's logic
// against x @ H on machines without a GPU:
//   g++ -std=c++20 -O1 -shared -fPIC -pthread -DFP8KV_HOST_EMULATION -x c++ hadamard_kernels.cu
#include "hadamard.cuh"

#if defined(FP8KV_HOST_EMULATION)
#include <memory>
#include <vector>

#include "host_fibers.h"
#endif

namespace fp8kv::gpu {

#if !defined(FP8KV_HOST_EMULATION)

template <typename scalar_t, int E>
Error launch_with(const HadamardArgs<scalar_t>& args, Stream stream) {
  const int64_t threads = args.rows.num_rows * (args.d / E);
  const auto blocks = static_cast<unsigned>((threads + kHadamardThreads - 1) / kHadamardThreads);
  hadamard_transform_kernel<scalar_t, E><<<dim3(blocks), dim3(kHadamardThreads), 0, stream>>>(args);
  return last_launch_error();
}

template <typename scalar_t>
Error launch_hadamard_transform(const HadamardArgs<scalar_t>& args, Stream stream) {
  if (args.rows.num_rows == 0) return kSuccess;
  switch (hadamard_values_per_thread(args.block)) {
    case 8:
      return launch_with<scalar_t, 8>(args, stream);
    case 16:
      return launch_with<scalar_t, 16>(args, stream);
    case 32:
      return launch_with<scalar_t, 32>(args, stream);
    default:
      return kInvalidValue;
  }
}

#define FP8KV_INSTANTIATE(scalar_t) \
  template Error launch_hadamard_transform<scalar_t>(const HadamardArgs<scalar_t>&, Stream);
FP8KV_FOR_EACH_HADAMARD_TYPE(FP8KV_INSTANTIATE)
#undef FP8KV_INSTANTIATE

#else  // FP8KV_HOST_EMULATION

namespace {

struct EmulatedBlock {
  EmulatedBlock() : exchange(kHadamardThreads) {
    for (int w = 0; w < kHadamardThreads / kWarpSize; ++w) warps.push_back(std::make_unique<host::FiberBarrier>(kWarpSize));
  }
  std::vector<std::unique_ptr<host::FiberBarrier>> warps;
  std::vector<float> exchange;  // one slot per thread
};

// Stands in for GpuThread (platform.cuh).
struct EmulatedThread {
  int tid, bx;
  EmulatedBlock* block;

  int index() const { return tid; }
  int block_x() const { return bx; }
  float shfl_xor(float v, int lane_mask) const {
    const int warp = tid / kWarpSize, lane = tid % kWarpSize;
    float* lanes = &block->exchange[warp * kWarpSize];
    lanes[lane] = v;
    block->warps[warp]->arrive_and_wait();
    const float other = lanes[lane ^ lane_mask];
    block->warps[warp]->arrive_and_wait();
    return other;
  }
};

template <typename scalar_t, int E>
void run_with(const HadamardArgs<scalar_t>& args) {
  const int64_t threads = args.rows.num_rows * (args.d / E);
  for (int64_t bx = 0; bx * kHadamardThreads < threads; ++bx) {
    EmulatedBlock block;
    host::FiberBlock::run(kHadamardThreads, [&](int t) {
      hadamard_transform_body<scalar_t, E>(args, EmulatedThread{t, static_cast<int>(bx), &block});
    });
  }
}

template <typename scalar_t>
int run(const void* in, void* out, const HadamardRows& rows, int64_t d) {
  if (!hadamard_supports(d) || hadamard_block_size(d) > kHadamardMaxBlock) return 1;
  const int block = static_cast<int>(hadamard_block_size(d));
  const HadamardArgs<scalar_t> args{static_cast<const scalar_t*>(in), static_cast<scalar_t*>(out), rows, d, block,
                                    hadamard_norm(block)};
  switch (hadamard_values_per_thread(block)) {
    case 8:
      run_with<scalar_t, 8>(args);
      return 0;
    case 16:
      run_with<scalar_t, 16>(args);
      return 0;
    case 32:
      run_with<scalar_t, 32>(args);
      return 0;
    default:
      return 1;
  }
}

}  // namespace

#endif  // FP8KV_HOST_EMULATION

}  // namespace fp8kv::gpu

#if defined(FP8KV_HOST_EMULATION)
// dtype: 0 float32, 1 float16, 2 bfloat16. Rows as HadamardRows; `out` is [num_rows, d]. 0 = done.
extern "C" int fp8kv_hadamard_transform_emulated(int dtype, const void* in, void* out, int64_t num_rows,
                                                 int64_t inner_rows, int64_t outer_stride, int64_t inner_stride,
                                                 int64_t d) {
  using namespace fp8kv::gpu;
  const fp8kv::HadamardRows rows{num_rows, inner_rows, outer_stride, inner_stride};
  switch (dtype) {
    case 0:
      return run<float>(in, out, rows, d);
    case 1:
      return run<half_t>(in, out, rows, d);
    case 2:
      return run<bf16_t>(in, out, rows, d);
    default:
      return 2;
  }
}
#endif
