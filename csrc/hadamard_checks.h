// The argument checks of hadamard_transform that every backend shares (torch-dependent, unlike
// common/hadamard.h).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "common/hadamard.h"

namespace fp8kv {

// x's head size, after checking that x is [..., head_size] of a float dtype whose head size splits into
// Hadamard blocks.
inline int64_t check_hadamard_input(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "hadamard_transform needs x of shape [..., head_size], got a 0-dim tensor");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "hadamard_transform needs a float32, bfloat16 or float16 x, got ", dtype,
              "; convert it first, e.g. x.float()");
  const int64_t d = x.size(-1);
  TORCH_CHECK(hadamard_supports(d), "hadamard_transform: head size ", d, " allows Hadamard blocks of ",
              hadamard_block_size(d), " only (the largest power of two dividing it) and blocks need at least ",
              kHadamardMinBlock, ": use kv rotation 'none' for this model");
  return d;
}

}  // namespace fp8kv
