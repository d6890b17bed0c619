// Shared by the AVX-512 partition kernel's two paths (attention_avx512_auto.h, attention_avx512_fp8.h):
// unaligned loads, pointers of one partition into one KV head's caches, and a lane mask.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "common/fp8.h"
#include "cpu/attention_kernel.h"
#include "cpu/vector_exp.h"
#include "dispatch.h"

namespace fp8kv::cpu::avx512 {

FP8KV_INLINE __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
FP8KV_INLINE __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
FP8KV_INLINE __m256i join128(__m128i lo, __m128i hi) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

FP8KV_INLINE __mmask16 first_lanes(int n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

// Pointers of one partition into the caches of one KV head.
template <typename cache_t>
struct View {
  const cache_t* kcache;
  const cache_t* vcache;
  const int32_t* table;
  int64_t block_elems;  // elements per block of either cache
  int block_elems_head;  // head_size * block_size: one KV head's slice of a block

  View(const PartitionWork& w)
      : kcache(static_cast<const cache_t*>(w.key_cache) + static_cast<int64_t>(w.kv_head) * w.head_size * w.block_size),
        vcache(static_cast<const cache_t*>(w.value_cache) + static_cast<int64_t>(w.kv_head) * w.head_size * w.block_size),
        table(w.block_table),
        block_elems(w.num_kv_heads * w.head_size * w.block_size),
        block_elems_head(w.head_size * w.block_size) {}

  const cache_t* k_block(int b) const { return kcache + table[b] * block_elems; }
  const cache_t* v_block(int b) const { return vcache + table[b] * block_elems; }
};

// Dynamic scales (attention_kernel.h) of one partition, read a tile at a time: the 16 scales of tokens ts .. ts + 15
// (ts at a block boundary, as the FP8 kernel's tiles are; block size 8: two blocks) are one 32-byte load widened to
// floats, so a tile's logits or probabilities take them in one multiply. Lanes past the partition's end hold
// whatever those slots hold: callers never store them (logits) or zero them first (probabilities).
struct TileScales {
  const int32_t* table;
  int64_t block_stride;  // scales per block of a scale cache: num_kv_heads * block_size
  int bs_shift, end;

  explicit TileScales(const PartitionWork& w)
      : table(w.block_table), block_stride(w.num_kv_heads * w.block_size), bs_shift(__builtin_ctz(w.block_size)),
        end(w.end) {}

  // The first of tile ts's scales in `scales` (block size 8: of its first block).
  FP8KV_INLINE const uint16_t* at(const uint16_t* scales, int ts) const {
    return scales + table[ts >> bs_shift] * block_stride + (ts & ((1 << bs_shift) - 1));
  }

  FP8KV_INLINE __m512 load(const uint16_t* scales, int ts) const {
    __m256i bits;
    if (bs_shift == 3) {  // two blocks of 8; past the end the first one's again (the next may not exist)
      const __m128i lo = load128(at(scales, ts));
      bits = join128(lo, ts + 8 < end ? load128(at(scales, ts + 8)) : lo);
    } else {
      bits = load256(at(scales, ts));
    }
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));  // bfloat16 -> float32
  }
};

}  // namespace fp8kv::cpu::avx512
