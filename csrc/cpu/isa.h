// Which CPU code path this translation unit compiles, chosen by the compiler flags (see _build.py):
// -march=native on an AVX-512 machine with VBMI (Ice Lake and later, Zen 4) gives the AVX-512 path;
// FP8KV_CPU_ISA=avx2 adds -mno-avx512f; FP8KV_CPU_ISA=scalar defines FP8KV_FORCE_SCALAR (the portable
// path, also what non-x86 machines get).
#pragma once

#if defined(FP8KV_FORCE_SCALAR)
#define FP8KV_ISA_SCALAR 1
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VBMI__) && defined(__F16C__) && defined(__FMA__)
#define FP8KV_ISA_AVX512 1
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define FP8KV_ISA_AVX2 1
#else
#define FP8KV_ISA_SCALAR 1
#endif

#if defined(FP8KV_ISA_AVX512) || defined(FP8KV_ISA_AVX2)
#include <immintrin.h>
#endif

namespace fp8kv::cpu {

// Flushes denormal results and inputs to zero on this thread while in scope. Softmax weights of far
// logits and their products with small values fall below FLT_MIN; each such FMA takes a microcode assist
// on x86 (scripts/attention_wide_logits.py: 6.7 ms instead of 0.24 ms per call). Such terms are below a
// float's resolution of the sum they join, so the output changes by less than its rounding.
class FlushDenormals {
 public:
#if defined(FP8KV_ISA_AVX512) || defined(FP8KV_ISA_AVX2)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#else
  FlushDenormals() {}
#endif
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

inline const char* isa_name() {
#if defined(FP8KV_ISA_AVX512)
  return "avx512";
#elif defined(FP8KV_ISA_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// Whether the AVX-512 path also has the AVX512-BF16 dot product (linear_bf16's fast kernel, Bf16Dot).
inline bool has_bf16_dot() {
#if defined(FP8KV_ISA_AVX512) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace fp8kv::cpu
