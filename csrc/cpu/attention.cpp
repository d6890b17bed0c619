// CPU paged attention (decode): argument checks, splitting into (sequence, KV head, partition) units
// for OpenMP, and the merge of partitions (as in vLLM's paged_attention_v2).
//
// paged_attention_window reads positions [0, window_start) from the paged cache and the newest ones
// [window_start, seq_len) from the model-dtype window ring; both become partitions of the same softmax,
// so the window costs a few extra units and merge terms, not a second pass. With window_sinks S > 0 the
// first S positions (attention sinks) come from the ring's own S seats as one more run of partitions.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
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
#elif defined(FP8KV_ISA_AVX2)
#include "cpu/attention_avx2.h"
#endif

namespace fp8kv::cpu {
namespace {

template <typename cache_t, KVFormat kFormat, bool kBf16Query = false>
void run_partition(const PartitionWork& w) {
#if defined(FP8KV_ISA_AVX512)
  if (avx512::supports(w)) return avx512::run_partition<cache_t, kFormat, kBf16Query>(w);
#elif defined(FP8KV_ISA_AVX2)
  if (avx2::supports(w)) return avx2::run_partition<cache_t, kFormat>(w);
#endif
  generic::run_partition<cache_t, kFormat>(w);
}

using PartitionFn = void (*)(const PartitionWork&);

// A cache attention reads: the paged cache (FP8 or auto) or the window ring (model dtype).
struct CacheSource {
  const void* key_cache = nullptr;
  const void* value_cache = nullptr;
  const int32_t* block_tables = nullptr;
  int64_t block_table_stride = 0;
  std::vector<float> k_scale, v_scale;  // per KV head; ones for model-dtype caches and dynamic scales
  ScaleCaches dynamic;                   // the scale caches of dynamic scales, else nullptr
  PartitionFn run = nullptr;            // run_partition of the cache's format
  int64_t elem_bytes = 0;
};

enum Source : int { kPaged = 0, kWindow = 1 };

// One partition of a sequence's softmax: tokens [start, end) of one cache, at most kPartitionSize.
struct Span {
  int seq;
  Source source;
  int start, end;
  int last_pos;  // token index of the sequence's newest position in this cache's indexing (ALiBi)
};

struct Problem {
  int num_seqs, num_heads, num_kv_heads, head_size, block_size;
  const float* query;  // [num_seqs, num_heads, head_size]
  const float* alibi;  // [num_heads] or nullptr
  float scale;
  float softcap = 0.f;            // > 0: logit soft-capping (PartitionWork::softcap)
  const float* sinks = nullptr;   // [num_heads]: one more logit per head in the softmax's denominator (gpt-oss)
  int sliding_window = 0;         // > 0: a sequence attends to its newest sliding_window positions only
  CacheSource sources[2];
  std::vector<Span> spans;      // grouped by sequence, in order
  std::vector<int> first_span;  // [num_seqs + 1]: sequence s owns spans [first_span[s], first_span[s + 1])
  float* out;                   // [num_seqs, num_heads, head_size]
  float* partial_out;           // [spans, num_heads, head_size]: used by sequences with several spans
  float* partial_max;           // [spans, num_heads]
  float* partial_sum;           // [spans, num_heads]

  int spans_of(int seq) const { return first_span[seq + 1] - first_span[seq]; }
};

// Tokens [start, end) of one cache as spans that cover at most kPartitionSize tokens counted from the block
// boundary at or before their start: the AVX-512 kernels' tiles start at block boundaries (an unaligned
// first span masks the tokens before its start), and both kernels' scratch holds kPartitionSize logits.
void add_spans(Problem& p, int seq, Source source, int start, int end, int last_pos) {
  for (int t = start; t < end;) {
    const int stop = std::min(end, t / p.block_size * p.block_size + kPartitionSize);
    p.spans.push_back({seq, source, t, stop, last_pos});
    t = stop;
  }
}

// KV heads per unit of work: one thread runs a partition's heads in turn, prefetching the next head's
// K/V into L2 while it computes one (so memory never idles), as long as there are units for every
// thread. Two heads' partitions must fit in L2 together; paged partitions are counted whole, window
// spans (short) as they are.
int heads_per_unit(const Problem& p) {
  constexpr int64_t kL2Budget = 1 << 20;
  int64_t per_head = 0;
  for (const Span& s : p.spans) {
    const int64_t tokens = s.source == kPaged ? kPartitionSize : s.end - s.start;
    per_head = std::max(per_head, tokens * 2 * p.head_size * p.sources[s.source].elem_bytes);
  }
  int heads = kL2Budget >= 2 * per_head ? p.num_kv_heads : 1;
  const int64_t partitions = static_cast<int64_t>(p.spans.size());
  const int64_t wanted = 4 * static_cast<int64_t>(at::get_num_threads());
  while (heads > 1 && partitions * ((p.num_kv_heads + heads - 1) / heads) < wanted) heads = (heads + 1) / 2;
  return heads;
}

void run_spans(const Problem& p) {
  struct Unit {
    int span, kv_head, heads;
  };
  const int hpu = heads_per_unit(p);
  std::vector<Unit> units;
  for (int i = 0; i < static_cast<int>(p.spans.size()); ++i) {
    for (int kvh = 0; kvh < p.num_kv_heads; kvh += hpu) units.push_back({i, kvh, std::min(hpu, p.num_kv_heads - kvh)});
  }
  const int G = p.num_heads / p.num_kv_heads, D = p.head_size;
  const int64_t scratch_size = scratch_floats(G, D, p.block_size);
  const int64_t n_units = static_cast<int64_t>(units.size());
  const int threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(n_units)));
  // Units are claimed by hand (dynamic scheduling), one ahead where there are units enough that no thread
  // starves for it: a unit's last head then prefetches the next unit's first head, which otherwise waited
  // on memory.
  const bool claim_ahead = n_units >= 4 * threads;
  std::atomic<int64_t> next_unit{0};
#pragma omp parallel num_threads(threads)
  {
    const FlushDenormals flush;
    // Uninitialised: every kernel writes what it reads there (zeroing 60 KB a thread a call cost more than a
    // short sequence's attention).
    const std::unique_ptr<float[]> scratch(new float[static_cast<size_t>(scratch_size) + 16]);
    float* aligned = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.get()) + 63) & ~uintptr_t(63));
    auto work_of = [&](const Unit& u, int kvh) {
      const Span& span = p.spans[u.span];
      const CacheSource& src = p.sources[span.source];
      const bool single = p.spans_of(span.seq) == 1 && p.sinks == nullptr;  // sinks join in the merge
      const int head0 = kvh * G;
      const int64_t part_row = static_cast<int64_t>(u.span) * p.num_heads + head0;
      const int64_t out_row = static_cast<int64_t>(span.seq) * p.num_heads + head0;
      PartitionWork w;
      w.key_cache = src.key_cache;
      w.value_cache = src.value_cache;
      w.block_table = src.block_tables + span.seq * src.block_table_stride;
      w.num_kv_heads = p.num_kv_heads;
      w.head_size = D;
      w.block_size = p.block_size;
      w.kv_head = kvh;
      w.group = G;
      w.start = span.start;
      w.end = span.end;
      w.last_pos = span.last_pos;
      w.query = p.query + out_row * D;
      w.qk_scale = p.scale * src.k_scale[kvh];
      w.v_scale = src.v_scale[kvh];
      if (src.dynamic.dynamic()) {
        w.k_scales = src.dynamic.k + static_cast<int64_t>(kvh) * p.block_size;
        w.v_scales = src.dynamic.v + static_cast<int64_t>(kvh) * p.block_size;
      }
      w.alibi = p.alibi ? p.alibi + head0 : nullptr;
      w.softcap = p.softcap;
      w.out = single ? p.out + out_row * D : p.partial_out + part_row * D;
      w.max_logit = p.partial_max + part_row;
      w.exp_sum = p.partial_sum + part_row;
      w.scratch = aligned;
      return w;
    };
    // The scale lines of a unit's pass, when its cache has dynamic scales (work_of only then: it costs a pass 1-2%)
    auto scales_of = [&](const Unit& u, int kvh) {
      return p.sources[p.spans[u.span].source].dynamic.dynamic() ? scale_lines(work_of(u, kvh)) : NextScales{};
    };
    bool fetched = false;  // the current unit's first head was prefetched by the unit before
    bool scales_fetched = false;  // the current pass's dynamic scales were fetched by the pass before
    for (int64_t i = next_unit.fetch_add(1); i < n_units;) {
      const int64_t j = claim_ahead ? next_unit.fetch_add(1) : n_units;
      const Unit& u = units[i];
      const CacheSource& src = p.sources[p.spans[u.span].source];
      const bool chain = j < n_units && src.elem_bytes == 1 &&  // FP8 (SlabPrefetcher), same cache
                         p.spans[units[j].span].source == p.spans[u.span].source;
      PartitionWork next_first;
      if (chain) next_first = work_of(units[j], units[j].kv_head);
      for (int kvh = u.kv_head; kvh < u.kv_head + u.heads; ++kvh) {
        PartitionWork w = work_of(u, kvh);
        // Pipeline: the unit's first pass fetches its own head (unless the unit before did) and the next,
        // later passes the next, and the last pass of an FP8 unit the first head of the thread's next unit.
        const bool first = kvh == u.kv_head && !fetched;
        w.prefetch_from = first ? 0 : 1;
        w.prefetch_heads = std::min(first ? 2 : 1, u.kv_head + u.heads - kvh - (first ? 0 : 1));
        const bool last = kvh == u.kv_head + u.heads - 1;
        if (last && chain && w.prefetch_heads == 0) w.then = &next_first;
        // Dynamic scales: the pass fetches the next pass's (NextScales); its own were fetched by the pass before
        // (unless it is the thread's first, or the unit before could not know it)
        if (w.k_scales && kvh == u.kv_head && !scales_fetched) scale_lines(w).fetch_all();
        if (!last) w.next_scales = scales_of(u, kvh + 1);
        else if (j < n_units) w.next_scales = scales_of(units[j], units[j].kv_head);
        scales_fetched = !last || j < n_units;
        if (last) fetched = w.then != nullptr;
        src.run(w);
      }
      i = claim_ahead ? j : next_unit.fetch_add(1);
    }
  }
  // Merge partitions: weight each partition's normalised output by its share of the softmax mass; a sink is one
  // more share, with no value. Sequences of one span and no sinks wrote their output directly.
  bool single_spans = p.sinks == nullptr;
  for (int s = 0; s < p.num_seqs; ++s) single_spans &= p.spans_of(s) == 1;
  if (single_spans) return;
  at::parallel_for(0, static_cast<int64_t>(p.num_seqs) * p.num_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t sh = begin; sh < end; ++sh) {
      const int s = static_cast<int>(sh / p.num_heads), h = static_cast<int>(sh % p.num_heads);
      const int np = p.spans_of(s);
      float* dst = p.out + sh * D;
      if (np == 0) {
        std::fill(dst, dst + D, 0.f);  // empty sequence: defined as zeros
        continue;
      }
      if (np == 1 && p.sinks == nullptr) continue;
      auto row = [&](int part) { return static_cast<int64_t>(p.first_span[s] + part) * p.num_heads + h; };
      float global_max = p.sinks != nullptr ? p.sinks[h] : -INFINITY;
      for (int part = 0; part < np; ++part) global_max = std::fmax(global_max, p.partial_max[row(part)]);
      std::fill(dst, dst + D, 0.f);
      float total = p.sinks != nullptr ? std::exp(p.sinks[h] - global_max) : 0.f;
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

// Every block id that tokens [begin, end) of row `seq` read lies in [0, num_blocks).
void check_block_ids(const int32_t* row, int seq, int64_t begin, int64_t end, int64_t block_size,
                     int64_t num_blocks, const char* table_name, const char* cache_name) {
  if (begin >= end) return;
  for (int64_t b = begin / block_size; b <= (end - 1) / block_size; ++b) {
    TORCH_CHECK(row[b] >= 0 && row[b] < num_blocks, table_name, "[", seq, ", ", b, "] = ", row[b],
                " is outside the ", cache_name, " blocks [0, ", num_blocks, ")");
  }
}

void check_table(const at::Tensor& t, int64_t num_seqs, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == num_seqs, name, " must be [num_seqs=", num_seqs, ", max_blocks], got ",
              t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
}

void check_seq_vector(const at::Tensor& t, int64_t num_seqs, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == num_seqs, name, " must be [num_seqs=", num_seqs, "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
}

// The arguments both ops share, checked, with the float32 / contiguous copies the raw pointers of
// Problem point into; finish() runs the partitions and writes `out`.
class Launch {
 public:
  Launch(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         int64_t num_kv_heads, double scale, const at::Tensor& block_tables, const at::Tensor& seq_lens,
         int64_t block_size, const std::optional<at::Tensor>& alibi_slopes, int64_t kv_cache_format,
         const at::Tensor& k_scale, const at::Tensor& v_scale, int64_t sliding_window, double logit_softcap,
         const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& k_scale_cache,
         const std::optional<at::Tensor>& v_scale_cache)
      : out_(out) {
    const KVFormat format = kv_format_from_code(kv_cache_format);
    paged_ = check_caches(key_cache, value_cache, format != KVFormat::AUTO);
    TORCH_CHECK(query.dim() == 3, "query must be [num_seqs, num_heads, head_size], got ", query.sizes());
    check_model_dtype(query, "query");
    check_model_dtype(out, "out");
    TORCH_CHECK(out.sizes() == query.sizes(), "out ", out.sizes(), " must have the shape of query ", query.sizes());
    TORCH_CHECK(query.device().is_cpu() && out.device().is_cpu(), "query and out must be CPU tensors");
    TORCH_CHECK(num_kv_heads == paged_.num_kv_heads, "num_kv_heads = ", num_kv_heads, " but the cache has ",
                paged_.num_kv_heads, " KV heads");
    TORCH_CHECK(block_size == paged_.block_size, "block_size = ", block_size, " but the cache's block size is ",
                paged_.block_size);
    TORCH_CHECK(query.size(2) == paged_.head_size, "query head_size ", query.size(2), " != cache head_size ",
                paged_.head_size);
    const int64_t num_seqs = query.size(0), num_heads = query.size(1);
    TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads (", num_heads, ") must be a multiple of num_kv_heads (",
                num_kv_heads, ")");
    TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
    check_table(block_tables, num_seqs, "block_tables");
    check_seq_vector(seq_lens, num_seqs, "seq_lens");

    Problem& p = problem_;
    p.num_seqs = static_cast<int>(num_seqs);
    p.num_heads = static_cast<int>(num_heads);
    p.num_kv_heads = static_cast<int>(num_kv_heads);
    p.head_size = static_cast<int>(paged_.head_size);
    p.block_size = static_cast<int>(paged_.block_size);
    seq_lens_ = seq_lens.contiguous();
    for (int s = 0; s < p.num_seqs; ++s) {
      TORCH_CHECK(seq_len(s) >= 0, "seq_lens[", s, "] = ", seq_len(s), " is negative");
    }
    q_ = query.to(at::kFloat).contiguous();
    p.query = q_.data_ptr<float>();
    p.alibi = nullptr;
    if (alibi_slopes.has_value()) {
      TORCH_CHECK(alibi_slopes->numel() == num_heads, "alibi_slopes must have num_heads = ", num_heads,
                  " elements, got shape ", alibi_slopes->sizes());
      alibi_ = alibi_slopes->to(at::kFloat).contiguous();
      p.alibi = alibi_.data_ptr<float>();
    }
    p.scale = static_cast<float>(scale);
    TORCH_CHECK(sliding_window >= 0, "sliding_window = ", sliding_window, " must be >= 0 (0: no sliding window)");
    TORCH_CHECK(std::isfinite(logit_softcap) && logit_softcap >= 0, "logit_softcap = ", logit_softcap,
                " must be a finite number >= 0 (0: no soft-capping)");
    p.sliding_window = static_cast<int>(std::min<int64_t>(sliding_window, INT32_MAX));
    p.softcap = static_cast<float>(logit_softcap);
    if (sinks.has_value()) {
      TORCH_CHECK(sinks->numel() == num_heads && sinks->device().is_cpu(), "sinks must be a CPU tensor of num_heads = ",
                  num_heads, " values, got shape ", sinks->sizes(), " on ", sinks->device());
      sinks_ = sinks->to(at::kFloat).contiguous();
      p.sinks = sinks_.data_ptr<float>();
    }
    // Scales only mean something for FP8 caches; an "auto" cache holds the values themselves.
    const bool fp8 = format != KVFormat::AUTO;
    CacheSource& src = p.sources[kPaged];
    src.dynamic = check_scale_caches(k_scale_cache, v_scale_cache, paged_, fp8, at::Device(at::kCPU));
    const bool static_scales = fp8 && !src.dynamic.dynamic();  // dynamic scales replace k_scale and v_scale
    src.k_scale = static_scales ? check_scale(k_scale, num_kv_heads, "k_scale") : std::vector<float>(num_kv_heads, 1.f);
    src.v_scale = static_scales ? check_scale(v_scale, num_kv_heads, "v_scale") : std::vector<float>(num_kv_heads, 1.f);
    tables_ = block_tables.contiguous();
    src.block_tables = tables_.data_ptr<int32_t>();
    src.block_table_stride = tables_.size(1);
    src.key_cache = key_cache.data_ptr();
    src.value_cache = value_cache.data_ptr();
    src.elem_bytes = static_cast<int64_t>(key_cache.element_size());
    // Auto caches are dispatched on their own dtype: the query is float32 here whatever it was.
    const at::ScalarType dtype = format == KVFormat::AUTO ? key_cache.scalar_type() : query.scalar_type();
    // bfloat16 queries over an FP8 cache take the bfloat16 dot-product path where the CPU has one: the codes
    // decode exactly to bfloat16, and P.V in bfloat16 is what vLLM's GPU kernels do for 16-bit models.
#define FP8KV_PICK(scalar_t, cache_t, kFormat)                                                            \
  src.run = &run_partition<cache_t, kFormat, std::is_same_v<scalar_t, c10::BFloat16> && kFormat != KVFormat::AUTO>
    FP8KV_DISPATCH_BY_KV_FORMAT(dtype, format, FP8KV_PICK);
#undef FP8KV_PICK
    p.first_span.assign(1, 0);
  }

  Problem& problem() { return problem_; }
  int seq_len(int s) const { return seq_lens_.data_ptr<int32_t>()[s]; }

  // The oldest position sequence `seq` attends to: 0, or its newest sliding_window positions' first.
  int first_position(int seq) const {
    const int w = problem_.sliding_window;
    return w > 0 ? std::max(0, seq_len(seq) - w) : 0;
  }

  // Positions [max(first_position, begin), n) of sequence `seq` from the paged cache (only their blocks are read
  // and checked: a sliding window's older blocks may be gone); `what` names where n came from in errors.
  void add_paged(int seq, int begin, int n, const char* what) {
    const CacheSource& src = problem_.sources[kPaged];
    const int64_t blocks = (n + paged_.block_size - 1) / paged_.block_size;
    TORCH_CHECK(blocks <= src.block_table_stride, what, "[", seq, "] = ", n, " needs ", blocks,
                " blocks but block_tables has only ", src.block_table_stride, " columns");
    const int first = std::min(std::max(first_position(seq), begin), n);
    check_block_ids(src.block_tables + seq * src.block_table_stride, seq, first, n, paged_.block_size,
                    paged_.num_blocks, "block_tables", "cache's");
    add_spans(problem_, seq, kPaged, first, n, seq_len(seq) - 1);
  }

  // The window ring of paged_attention_window: checked, and its kernel picked from its dtype.
  void set_window(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& window_starts, int64_t window_size, int64_t window_sinks) {
    Problem& p = problem_;
    check_model_dtype(key_cache, "window_key_cache");
    window_ = check_caches(key_cache, value_cache, false, "window_");
    TORCH_CHECK(window_.num_kv_heads == paged_.num_kv_heads && window_.head_size == paged_.head_size &&
                    window_.block_size == paged_.block_size,
                "window_key_cache ", key_cache.sizes(), " must have the cache's num_kv_heads = ", paged_.num_kv_heads,
                ", head_size = ", paged_.head_size, " and block_size = ", paged_.block_size);
    check_table(block_tables, p.num_seqs, "window_block_tables");
    check_seq_vector(window_starts, p.num_seqs, "window_starts");
    TORCH_CHECK(window_sinks >= 0, "window_sinks = ", window_sinks, " must be >= 0 (0: no attention sinks kept)");
    TORCH_CHECK(window_size <= INT32_MAX && window_sinks <= INT32_MAX - window_size, "window_sinks = ", window_sinks,
                " plus window_size = ", window_size, " seats do not fit in int32");
    const int64_t seats = window_sinks + window_size;
    const int64_t ring_blocks = (seats + window_.block_size - 1) / window_.block_size;
    TORCH_CHECK(block_tables.size(1) >= ring_blocks, "window_block_tables has ", block_tables.size(1),
                " columns but a ring of window_sinks + window_size = ", window_sinks, " + ", window_size, " = ", seats,
                " seats needs ", ring_blocks, " blocks of ", window_.block_size,
                ": give each sequence that many window blocks (or lower window_sinks / window_size)");
    window_size_ = window_size;
    window_sinks_ = window_sinks;
    window_starts_ = window_starts.contiguous();
    window_tables_ = block_tables.contiguous();
    CacheSource& ring = p.sources[kWindow];
    ring.key_cache = key_cache.data_ptr();
    ring.value_cache = value_cache.data_ptr();
    ring.block_tables = window_tables_.data_ptr<int32_t>();
    ring.block_table_stride = window_tables_.size(1);
    ring.k_scale.assign(p.num_kv_heads, 1.f);  // model-dtype values: no scales
    ring.v_scale.assign(p.num_kv_heads, 1.f);
    ring.elem_bytes = static_cast<int64_t>(key_cache.element_size());
#define FP8KV_PICK(scalar_t, cache_t, kFormat) ring.run = &run_partition<cache_t, kFormat>
    FP8KV_DISPATCH_BY_KV_FORMAT(key_cache.scalar_type(), KVFormat::AUTO, FP8KV_PICK);
#undef FP8KV_PICK
  }

  // window_starts[seq], checked against seq_lens[seq] and the window size.
  int window_start(int seq) const {
    const int64_t len = seq_len(seq), start = window_starts_.data_ptr<int32_t>()[seq];
    const int64_t lowest = std::max<int64_t>(0, len - window_size_);
    TORCH_CHECK(lowest <= start && start <= len, "window_starts[", seq, "] = ", start, " must lie in [max(0, seq_lens[",
                seq, "] - window_size), seq_lens[", seq, "]] = [", lowest, ", ", len, "]");
    return static_cast<int>(start);
  }

  // The positions sequence `seq` reads from the window ring: the sinks [first_position, min(S, seq_len)) at
  // seats equal to their positions (all of them, also those past window_start: a position below S is never in
  // the ring proper), and the recent ones [max(first_position, start, S), seq_len) at seat S + q % window_size,
  // at most two runs of seats. Without ALiBi a seat's position matters only for which seats are read, so the sink
  // seats and a recent run that starts at seat S (the ring's first lap seat) are read as one run: in such steps
  // the sinks cost no partition of their own.
  void add_window(int seq, int start) {
    const CacheSource& ring = problem_.sources[kWindow];
    const int32_t* row = ring.block_tables + seq * ring.block_table_stride;
    const int64_t len = seq_len(seq), sinks = window_sinks_, first = first_position(seq);
    int64_t sink_begin = first, sink_end = std::min(sinks, len);  // empty once read
    for (int64_t pos = std::max({static_cast<int64_t>(start), first, sinks}); pos < len;) {
      const int64_t lap = pos / window_size_ * window_size_;  // the position seat S holds in this lap
      const int64_t end = std::min(len, lap + window_size_);
      int64_t begin = sinks + pos - lap;
      if (problem_.alibi == nullptr && sink_begin < sink_end && sink_end == begin) {
        begin = sink_begin;
        sink_begin = sink_end;
      }
      add_seats(seq, row, begin, sinks + end - lap, sinks + len - 1 - lap);
      pos = end;
    }
    if (sink_begin < sink_end) add_seats(seq, row, sink_begin, sink_end, len - 1);
  }

  // Seats [begin, end) of a sequence's window ring, whose newest position sits at seat last (ALiBi).
  void add_seats(int seq, const int32_t* row, int64_t begin, int64_t end, int64_t last) {
    check_block_ids(row, seq, begin, end, window_.block_size, window_.num_blocks, "window_block_tables",
                    "window cache's");
    add_spans(problem_, seq, kWindow, static_cast<int>(begin), static_cast<int>(end), static_cast<int>(last));
  }

  // Closes the current sequence's list of spans (sequences are added in order).
  void end_sequence() { problem_.first_span.push_back(static_cast<int>(problem_.spans.size())); }

  void finish() {
    Problem& p = problem_;
    const int64_t num_spans = static_cast<int64_t>(p.spans.size());
    bool merged = p.sinks != nullptr;
    for (int s = 0; s < p.num_seqs; ++s) merged |= p.spans_of(s) > 1;
    const auto f32 = q_.options();
    at::Tensor out_f32 =
        (out_.scalar_type() == at::kFloat && out_.is_contiguous()) ? out_ : at::empty(out_.sizes(), f32);
    at::Tensor partial_out = at::empty(merged ? num_spans * p.num_heads * p.head_size : 0, f32);
    at::Tensor partial_stats = at::empty({2, std::max<int64_t>(1, num_spans) * p.num_heads}, f32);
    p.out = out_f32.data_ptr<float>();
    p.partial_out = partial_out.data_ptr<float>();
    p.partial_max = partial_stats[0].data_ptr<float>();
    p.partial_sum = partial_stats[1].data_ptr<float>();
    run_spans(p);
    if (!out_f32.is_same(out_)) out_.copy_(out_f32);
  }

 private:
  at::Tensor& out_;
  CacheGeometry paged_, window_{};
  int64_t window_size_ = 0, window_sinks_ = 0;
  Problem problem_;
  at::Tensor seq_lens_, q_, alibi_, sinks_, tables_, window_starts_, window_tables_;
};

}  // namespace

void paged_attention(FP8KV_PAGED_ATTENTION_PARAMS) {
  (void)max_seq_len;  // partitions are sized from seq_lens itself, so a stale max_seq_len cannot overflow
  Launch launch(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
                alibi_slopes, kv_cache_format, k_scale, v_scale, sliding_window, logit_softcap, sinks, k_scale_cache,
                v_scale_cache);
  for (int s = 0; s < launch.problem().num_seqs; ++s) {
    launch.add_paged(s, 0, launch.seq_len(s), "seq_lens");
    launch.end_sequence();
  }
  launch.finish();
}

void paged_attention_window(FP8KV_PAGED_ATTENTION_WINDOW_PARAMS) {
  (void)max_seq_len;
  TORCH_CHECK(window_size >= 1, "window_size = ", window_size,
              " must be >= 1; call paged_attention when there is no window");
  Launch launch(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
                alibi_slopes, kv_cache_format, k_scale, v_scale, sliding_window, logit_softcap, sinks, k_scale_cache,
                v_scale_cache);
  launch.set_window(window_key_cache, window_value_cache, window_block_tables, window_starts, window_size,
                    window_sinks);
  for (int s = 0; s < launch.problem().num_seqs; ++s) {
    const int start = launch.window_start(s);
    // Paged: [max(first, sink_end), start), sink_end = min(S, start); the ring has the rest.
    launch.add_paged(s, static_cast<int>(std::min<int64_t>(window_sinks, start)), start, "window_starts");
    launch.add_window(s, start);
    launch.end_sequence();
  }
  launch.finish();
}

}  // namespace fp8kv::cpu
