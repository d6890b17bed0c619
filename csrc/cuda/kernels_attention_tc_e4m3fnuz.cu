// The tensor-core attention kernels of E4M3FNUZ paged caches, every head-size class, head-slot count and query
// split (attention_tc_kernels.cuh). One file per cache type, so that they compile in parallel. CUDA only: HIP
// builds keep the CUDA-core kernel. Torch-free.
#include "attention_launch.cuh"

namespace fp8kv::gpu {

#if defined(FP8KV_PLATFORM_CUDA)
FP8KV_INSTANTIATE_TC(uint8_t, Fp8Format::E4M3FNUZ)
#endif

}  // namespace fp8kv::gpu
