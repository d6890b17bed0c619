// CUDA (and, through torch's hipify, ROCm) kernel of torch.ops.fp8kv.hadamard_transform: argument checks,
// then a launch of the torch-free kernel of hadamard_kernels.cu. Schema: ../cpu/hadamard.cpp.
#include "hadamard.cuh"  // first: under hipcc the HIP runtime must come before the common headers

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../hadamard_checks.h"
#include "torch_types.cuh"

namespace fp8kv::gpu {
namespace {

// The kernel loads 8 values at a time: 16-byte aligned for 16-bit types, and the row starts must keep it so.
bool rows_are_aligned(const at::Tensor& t, const HadamardRows& rows) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && rows.outer_stride % 8 == 0 &&
         rows.inner_stride % 8 == 0;
}

template <typename scalar_t>
void run(const at::Tensor& src, const at::Tensor& out, const HadamardRows& rows, int64_t d) {
  using S = kernel_t<scalar_t>;
  const int block = static_cast<int>(hadamard_block_size(d));
  const HadamardArgs<S> args{reinterpret_cast<const S*>(src.data_ptr()), reinterpret_cast<S*>(out.data_ptr()),
                             rows, d, block, hadamard_norm(block)};
  C10_CUDA_CHECK(launch_hadamard_transform<S>(args, c10::cuda::getCurrentCUDAStream()));
}

at::Tensor hadamard_transform(const at::Tensor& x) {
  const int64_t d = check_hadamard_input(x);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(hadamard_block_size(d) <= kHadamardMaxBlock, "hadamard_transform on the GPU handles Hadamard blocks "
              "of at most ", kHadamardMaxBlock, " values; head size ", d, " has blocks of ",
              hadamard_block_size(d), ": use kv rotation 'none' for this model");
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  const int64_t threads = x.numel() / 8;  // at most: a thread holds 8 or more values
  TORCH_CHECK((threads + kHadamardThreads - 1) / kHadamardThreads <= INT32_MAX,
              "hadamard_transform: too many rows in one call (", x.numel() / d, "); split x");
  at::Tensor src = x.stride(-1) == 1 ? x : x.contiguous();
  HadamardRows rows{};
  if (!collapse_rows(src.sizes().data(), src.strides().data(), static_cast<int>(src.dim()) - 1, &rows) ||
      !rows_are_aligned(src, rows)) {
    // Too scattered for two strides, or not aligned for 16-byte loads (e.g. a slice at an odd offset):
    // a fresh dense copy is both.
    src = src.clone(at::MemoryFormat::Contiguous);
    collapse_rows(src.sizes().data(), src.strides().data(), static_cast<int>(src.dim()) - 1, &rows);
  }
  switch (dtype) {
    case at::kFloat:
      run<float>(src, out, rows, d);
      break;
    case at::kBFloat16:
      run<c10::BFloat16>(src, out, rows, d);
      break;
    default:
      run<c10::Half>(src, out, rows, d);
      break;
  }
  return out;
}

}  // namespace
}  // namespace fp8kv::gpu

TORCH_LIBRARY_IMPL(fp8kv, CUDA, m) { m.impl("hadamard_transform", &fp8kv::gpu::hadamard_transform); }
