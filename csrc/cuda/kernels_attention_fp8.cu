// The attention kernels of the FP8 paged caches, instantiated for every head-size class and GQA slot count
// (attention_launch.cuh). Torch-free.
#include "attention_launch.cuh"

namespace fp8kv::gpu {

FP8KV_FOR_EACH_FP8_SOURCE(FP8KV_INSTANTIATE_SOURCE)

}  // namespace fp8kv::gpu
