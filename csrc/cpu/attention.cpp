// CPU paged attention (decode): argument checks, splitting into (sequence, KV head, partition) units
// for OpenMP, and the merge of partitions (as in vLLM's paged_attention_v2).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "cpu/attention_generic.h"
#include "cpu/attention_kernel.h"
#include "cpu/checks.h"
#include "cpu/cpu_ops.h"
#include "cpu/isa.h"
#include "dispatch.h"
#if defined(FP8KV_ISA_AVX512)
#include "cpu/attention_avx512.h"
#endif

namespace fp8kv::cpu {
namespace {

struct Problem {
  int num_seqs, num_heads, num_kv_heads, head_size, block_size, max_partitions;
  std::vector<int32_t> seq_lens;
  const int32_t* block_tables;
  int64_t block_table_stride;
  const float* query;  // [num_seqs, num_heads, head_size]
  const float* alibi;  // [num_heads] or nullptr
  float scale;
  std::vector<float> k_scale, v_scale;  // per KV head
  const void* key_cache;
  const void* value_cache;
  float* out;            // [num_seqs, num_heads, head_size]
  float* partial_out;    // [num_seqs, max_partitions, num_heads, head_size]
  float* partial_max;    // [num_seqs, max_partitions, num_heads]
  float* partial_sum;    // [num_seqs, max_partitions, num_heads]
};

int num_partitions(int seq_len) { return (seq_len + kPartitionSize - 1) / kPartitionSize; }

template <typename cache_t, KVFormat kFormat>
void run_partition(const PartitionWork& w) {
#if defined(FP8KV_ISA_AVX512)
  if (avx512::supports(w.head_size, w.block_size)) return avx512::run_partition<cache_t, kFormat>(w);
#endif
  generic::run_partition<cache_t, kFormat>(w);
}

// KV heads per unit of work: one thread runs a partition's heads in turn, prefetching the next head's
// K/V into L2 while it computes one (so memory never idles), as long as there are units for every
// thread. Two heads' partitions must fit in L2 together.
int heads_per_unit(const Problem& p, int64_t cache_elem_bytes) {
  constexpr int64_t kL2Budget = 1 << 20;
  const int64_t per_head = int64_t{kPartitionSize} * 2 * p.head_size * cache_elem_bytes;
  int heads = kL2Budget >= 2 * per_head ? p.num_kv_heads : 1;
  int64_t partitions = 0;
  for (int s = 0; s < p.num_seqs; ++s) partitions += num_partitions(p.seq_lens[s]);
  const int64_t wanted = 4 * static_cast<int64_t>(at::get_num_threads());
  while (heads > 1 && partitions * ((p.num_kv_heads + heads - 1) / heads) < wanted) heads = (heads + 1) / 2;
  return heads;
}

template <typename cache_t, KVFormat kFormat>
void attention_impl(const Problem& p) {
  struct Unit {
    int seq, partition, kv_head, heads;
  };
  const int hpu = heads_per_unit(p, sizeof(cache_t));
  std::vector<Unit> units;
  for (int s = 0; s < p.num_seqs; ++s) {
    for (int part = 0; part < num_partitions(p.seq_lens[s]); ++part) {
      for (int kvh = 0; kvh < p.num_kv_heads; kvh += hpu) {
        units.push_back({s, part, kvh, std::min(hpu, p.num_kv_heads - kvh)});
      }
    }
  }
  const int G = p.num_heads / p.num_kv_heads, D = p.head_size;
  const int64_t scratch_size = scratch_floats(G, D, p.block_size);
  const int64_t n_units = static_cast<int64_t>(units.size());
#pragma omp parallel num_threads(std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(n_units))))
  {
    std::vector<float> scratch(static_cast<size_t>(scratch_size) + 16);
    float* aligned = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_units; ++i) {
      const Unit& u = units[i];
      const int seq_len = p.seq_lens[u.seq];
      const bool single = num_partitions(seq_len) == 1;
      for (int kvh = u.kv_head; kvh < u.kv_head + u.heads; ++kvh) {
        const int head0 = kvh * G;
        const int64_t part_row = (static_cast<int64_t>(u.seq) * p.max_partitions + u.partition) * p.num_heads + head0;
        PartitionWork w;
        w.key_cache = p.key_cache;
        w.value_cache = p.value_cache;
        w.block_table = p.block_tables + u.seq * p.block_table_stride;
        w.num_kv_heads = p.num_kv_heads;
        w.head_size = D;
        w.block_size = p.block_size;
        w.kv_head = kvh;
        w.group = G;
        w.start = u.partition * kPartitionSize;
        w.end = std::min(seq_len, w.start + kPartitionSize);
        w.seq_len = seq_len;
        w.query = p.query + (static_cast<int64_t>(u.seq) * p.num_heads + head0) * D;
        w.qk_scale = p.scale * p.k_scale[kvh];
        w.v_scale = p.v_scale[kvh];
        w.alibi = p.alibi ? p.alibi + head0 : nullptr;
        w.out = single ? p.out + (static_cast<int64_t>(u.seq) * p.num_heads + head0) * D : p.partial_out + part_row * D;
        w.max_logit = p.partial_max + part_row;
        w.exp_sum = p.partial_sum + part_row;
        w.scratch = aligned;
        // Pipeline: the unit's first pass fetches its own head and the next, later passes the next.
        const bool first = kvh == u.kv_head;
        w.prefetch_from = first ? 0 : 1;
        w.prefetch_heads = std::min(first ? 2 : 1, u.kv_head + u.heads - kvh - (first ? 0 : 1));
        run_partition<cache_t, kFormat>(w);
      }
    }
  }
  // Merge partitions: weight each partition's normalised output by its share of the softmax mass.
  at::parallel_for(0, static_cast<int64_t>(p.num_seqs) * p.num_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t sh = begin; sh < end; ++sh) {
      const int s = static_cast<int>(sh / p.num_heads), h = static_cast<int>(sh % p.num_heads);
      const int np = num_partitions(p.seq_lens[s]);
      float* dst = p.out + sh * D;
      if (np == 0) {
        std::fill(dst, dst + D, 0.f);  // empty sequence: defined as zeros
        continue;
      }
      if (np == 1) continue;
      auto row = [&](int part) { return (static_cast<int64_t>(s) * p.max_partitions + part) * p.num_heads + h; };
      float global_max = -INFINITY;
      for (int part = 0; part < np; ++part) global_max = std::fmax(global_max, p.partial_max[row(part)]);
      std::fill(dst, dst + D, 0.f);
      float total = 0.f;
      for (int part = 0; part < np; ++part) {
        const float weight = p.partial_sum[row(part)] * std::exp(p.partial_max[row(part)] - global_max);
        total += weight;
        const float* src = p.partial_out + row(part) * D;
        for (int d = 0; d < D; ++d) dst[d] += weight * src[d];
      }
      const float inv = 1.f / total;
      for (int d = 0; d < D; ++d) dst[d] *= inv;
    }
  });
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                     int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                     const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                     const at::Tensor& v_scale) {
  (void)max_seq_len;  // partitions are sized from seq_lens itself, so a stale max_seq_len cannot overflow
  const KVFormat format = parse_kv_cache_dtype(kv_cache_dtype, kCpuDefaultFp8);
  const CacheGeometry g = check_caches(key_cache, value_cache, format != KVFormat::AUTO);
  TORCH_CHECK(query.dim() == 3, "query must be [num_seqs, num_heads, head_size], got ", query.sizes());
  check_model_dtype(query, "query");
  check_model_dtype(out, "out");
  TORCH_CHECK(out.sizes() == query.sizes(), "out ", out.sizes(), " must have the shape of query ", query.sizes());
  TORCH_CHECK(query.device().is_cpu() && out.device().is_cpu(), "query and out must be CPU tensors");
  TORCH_CHECK(num_kv_heads == g.num_kv_heads, "num_kv_heads = ", num_kv_heads, " but the cache has ",
              g.num_kv_heads, " KV heads");
  TORCH_CHECK(block_size == g.block_size, "block_size = ", block_size, " but the cache's block size is ",
              g.block_size);
  TORCH_CHECK(query.size(2) == g.head_size, "query head_size ", query.size(2), " != cache head_size ",
              g.head_size);
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads (", num_heads, ") must be a multiple of num_kv_heads (",
              num_kv_heads, ")");
  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
              "block_tables must be [num_seqs=", num_seqs, ", max_blocks], got ", block_tables.sizes());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt, "block_tables must be int32, got ",
              block_tables.scalar_type());
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs, "seq_lens must be [num_seqs=", num_seqs,
              "], got ", seq_lens.sizes());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt, "seq_lens must be int32, got ", seq_lens.scalar_type());

  Problem p;
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.head_size = static_cast<int>(g.head_size);
  p.block_size = static_cast<int>(g.block_size);
  const at::Tensor lens = seq_lens.contiguous();
  p.seq_lens.assign(lens.data_ptr<int32_t>(), lens.data_ptr<int32_t>() + num_seqs);
  const at::Tensor tables = block_tables.contiguous();
  p.block_tables = tables.data_ptr<int32_t>();
  p.block_table_stride = tables.size(1);
  int max_len = 0;
  for (int s = 0; s < p.num_seqs; ++s) {
    const int len = p.seq_lens[s];
    TORCH_CHECK(len >= 0, "seq_lens[", s, "] = ", len, " is negative");
    const int64_t blocks = (len + g.block_size - 1) / g.block_size;
    TORCH_CHECK(blocks <= tables.size(1), "seq_lens[", s, "] = ", len, " needs ", blocks,
                " blocks but block_tables has only ", tables.size(1), " columns");
    for (int64_t b = 0; b < blocks; ++b) {
      const int32_t id = p.block_tables[s * p.block_table_stride + b];
      TORCH_CHECK(id >= 0 && id < g.num_blocks, "block_tables[", s, ", ", b, "] = ", id,
                  " is outside the cache's blocks [0, ", g.num_blocks, ")");
    }
    max_len = std::max(max_len, len);
  }
  p.max_partitions = std::max(1, num_partitions(max_len));

  const at::Tensor q = query.to(at::kFloat).contiguous();
  p.query = q.data_ptr<float>();
  at::Tensor alibi;
  p.alibi = nullptr;
  if (alibi_slopes.has_value()) {
    TORCH_CHECK(alibi_slopes->numel() == num_heads, "alibi_slopes must have num_heads = ", num_heads,
                " elements, got shape ", alibi_slopes->sizes());
    alibi = alibi_slopes->to(at::kFloat).contiguous();
    p.alibi = alibi.data_ptr<float>();
  }
  p.scale = static_cast<float>(scale);
  // Scales only mean something for FP8 caches; an "auto" cache holds the values themselves.
  const bool fp8 = format != KVFormat::AUTO;
  p.k_scale = fp8 ? check_scale(k_scale, num_kv_heads, "k_scale") : std::vector<float>(num_kv_heads, 1.f);
  p.v_scale = fp8 ? check_scale(v_scale, num_kv_heads, "v_scale") : std::vector<float>(num_kv_heads, 1.f);
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();

  const auto f32 = query.options().dtype(at::kFloat);
  at::Tensor out_f32 = (out.scalar_type() == at::kFloat && out.is_contiguous()) ? out : at::empty(out.sizes(), f32);
  at::Tensor partial_out = at::empty(p.max_partitions > 1 ? num_seqs * p.max_partitions * num_heads * g.head_size : 0, f32);
  at::Tensor partial_stats = at::empty({2, num_seqs * p.max_partitions * num_heads}, f32);
  p.out = out_f32.data_ptr<float>();
  p.partial_out = partial_out.data_ptr<float>();
  p.partial_max = partial_stats[0].data_ptr<float>();
  p.partial_sum = partial_stats[1].data_ptr<float>();

  // Auto caches are dispatched on their own dtype: the query is float32 here whatever it was.
  const at::ScalarType src = format == KVFormat::AUTO ? key_cache.scalar_type() : query.scalar_type();
#define FP8KV_CALL(scalar_t, cache_t, kFormat) attention_impl<cache_t, kFormat>(p)
  FP8KV_DISPATCH_BY_KV_CACHE_DTYPE_CPU(src, kv_cache_dtype, FP8KV_CALL);
#undef FP8KV_CALL
  if (!out_f32.is_same(out)) out.copy_(out_f32);
}

}  // namespace fp8kv::cpu
