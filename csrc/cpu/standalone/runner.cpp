// Runs the portable CPU kernels outside torch, so that a build for another architecture can be tested under
// emulation (tests/ops/test_arm_emulation.py: aarch64 through qemu-user, against torch's float8 dtypes and the
// pure-torch reference ops on the host). What Arm machines run: fp8.h's scalar encoder and decoder, and the
// portable attention kernel (attention_generic.h) over each partition of a sequence.
//
// Not part of the op library (the build compiles csrc/cpu/*.cpp only). Built by the test with
//   aarch64-linux-gnu-g++ -std=c++20 -O3 -mcpu=... -static -I csrc -isystem <torch includes> runner.cpp
// It reads one request on stdin and writes its result on stdout, both little-endian binary:
//   encode:    int64 0, format, n; float32 scale, x[n]                    -> uint8 codes[n]
//   decode:    int64 1, format                                            -> float32 values[256]
//   attention: int64 2, format, cache dtype (0 float32, 1 bfloat16, 2 float16; FP8 formats: ignored),
//              num_seqs, num_heads, num_kv_heads, head_size, block_size, num_blocks, max_blocks, has_alibi;
//              float32 scale, k_scale[num_kv_heads], v_scale[num_kv_heads], alibi[num_heads] if has_alibi;
//              key_cache and value_cache (vLLM's layouts, raw elements); int32 block_tables[num_seqs][max_blocks],
//              seq_lens[num_seqs]; float32 query[num_seqs][num_heads][head_size]
//              -> per sequence, per partition of kPartitionSize tokens, per query head: float32 out[head_size],
//                 max_logit, exp_sum (the caller merges partitions as attention.cpp does)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/fp8.h"
#include "cpu/attention_generic.h"
#include "cpu/standalone/binary_io.h"

namespace {

using fp8kv::Fp8Format;
using fp8kv::KVFormat;

using fp8kv::standalone::fail;
using fp8kv::standalone::read;
using fp8kv::standalone::write;

int64_t read_int() { return read<int64_t>(1)[0]; }

// fn(std::integral_constant<Fp8Format, F>) for the FP8 format of a KVFormat code (1, 2 or 3).
template <typename Fn>
void with_fp8_format(int64_t code, Fn&& fn) {
  switch (static_cast<KVFormat>(code)) {
    case KVFormat::E4M3FN: return fn(std::integral_constant<Fp8Format, Fp8Format::E4M3FN>{});
    case KVFormat::E5M2: return fn(std::integral_constant<Fp8Format, Fp8Format::E5M2>{});
    case KVFormat::E4M3FNUZ: return fn(std::integral_constant<Fp8Format, Fp8Format::E4M3FNUZ>{});
    default: fail("not an FP8 format code");
  }
}

void encode() {
  const int64_t format = read_int(), n = read_int();
  const float scale = read<float>(1)[0];
  const std::vector<float> x = read<float>(n);
  std::vector<uint8_t> codes(static_cast<size_t>(n));
  with_fp8_format(format, [&](auto f) {
    for (int64_t i = 0; i < n; ++i) codes[i] = fp8kv::scaled_float_to_fp8<decltype(f)::value>(x[i], scale);
  });
  write(codes);
}

void decode() {
  std::vector<float> values(256);
  with_fp8_format(read_int(), [&](auto f) {
    for (int c = 0; c < 256; ++c) values[c] = fp8kv::fp8_to_float<decltype(f)::value>(static_cast<uint8_t>(c));
  });
  write(values);
}

struct AttentionRequest {
  int64_t num_seqs, num_heads, num_kv_heads, head_size, block_size, num_blocks, max_blocks;
  float scale;
  std::vector<float> k_scale, v_scale, alibi, query;
  std::vector<int32_t> block_tables, seq_lens;
};

template <typename cache_t, KVFormat kFormat>
void attention(AttentionRequest& r) {
  const int64_t cache_elems = r.num_blocks * r.num_kv_heads * r.head_size * r.block_size;
  const std::vector<cache_t> key_cache = read<cache_t>(cache_elems), value_cache = read<cache_t>(cache_elems);
  r.block_tables = read<int32_t>(r.num_seqs * r.max_blocks);
  r.seq_lens = read<int32_t>(r.num_seqs);
  r.query = read<float>(r.num_seqs * r.num_heads * r.head_size);
  const int G = static_cast<int>(r.num_heads / r.num_kv_heads), D = static_cast<int>(r.head_size);
  std::vector<float> scratch(static_cast<size_t>(fp8kv::cpu::scratch_floats(G, D, static_cast<int>(r.block_size))));
  std::vector<float> out(static_cast<size_t>(G * D)), max_logit(G), exp_sum(G), result;
  for (int64_t s = 0; s < r.num_seqs; ++s) {
    for (int start = 0; start < r.seq_lens[s]; start += fp8kv::cpu::kPartitionSize) {
      for (int kvh = 0; kvh < r.num_kv_heads; ++kvh) {
        fp8kv::cpu::PartitionWork w{};
        w.key_cache = key_cache.data();
        w.value_cache = value_cache.data();
        w.block_table = r.block_tables.data() + s * r.max_blocks;
        w.num_kv_heads = r.num_kv_heads;
        w.head_size = D;
        w.block_size = static_cast<int>(r.block_size);
        w.kv_head = kvh;
        w.group = G;
        w.start = start;
        w.end = std::min(r.seq_lens[s], start + fp8kv::cpu::kPartitionSize);
        w.last_pos = r.seq_lens[s] - 1;
        w.query = r.query.data() + (s * r.num_heads + kvh * G) * D;
        w.qk_scale = r.scale * r.k_scale[kvh];
        w.v_scale = r.v_scale[kvh];
        w.alibi = r.alibi.empty() ? nullptr : r.alibi.data() + kvh * G;
        w.out = out.data();
        w.max_logit = max_logit.data();
        w.exp_sum = exp_sum.data();
        w.scratch = scratch.data();
        fp8kv::cpu::generic::run_partition<cache_t, kFormat>(w);
        for (int h = 0; h < G; ++h) {
          result.insert(result.end(), out.begin() + h * D, out.begin() + (h + 1) * D);
          result.push_back(max_logit[h]);
          result.push_back(exp_sum[h]);
        }
      }
    }
  }
  write(result);
}

void attention() {
  const int64_t format = read_int(), dtype = read_int();
  AttentionRequest r{};
  r.num_seqs = read_int();
  r.num_heads = read_int();
  r.num_kv_heads = read_int();
  r.head_size = read_int();
  r.block_size = read_int();
  r.num_blocks = read_int();
  r.max_blocks = read_int();
  const bool has_alibi = read_int() != 0;
  r.scale = read<float>(1)[0];
  r.k_scale = read<float>(r.num_kv_heads);
  r.v_scale = read<float>(r.num_kv_heads);
  if (has_alibi) r.alibi = read<float>(r.num_heads);
  switch (static_cast<KVFormat>(format)) {
    case KVFormat::E4M3FN: return attention<uint8_t, KVFormat::E4M3FN>(r);
    case KVFormat::E5M2: return attention<uint8_t, KVFormat::E5M2>(r);
    case KVFormat::E4M3FNUZ: return attention<uint8_t, KVFormat::E4M3FNUZ>(r);
    case KVFormat::AUTO:
      if (dtype == 0) return attention<float, KVFormat::AUTO>(r);
      if (dtype == 1) return attention<c10::BFloat16, KVFormat::AUTO>(r);
      if (dtype == 2) return attention<c10::Half, KVFormat::AUTO>(r);
      fail("unknown cache dtype");
    default: fail("unknown format code");
  }
}

}  // namespace

int main() {
  switch (read_int()) {
    case 0: encode(); break;
    case 1: decode(); break;
    case 2: attention(); break;
    default: fail("unknown request");
  }
  return std::fflush(stdout) == 0 ? 0 : 2;
}
