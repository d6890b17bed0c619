// How fast plain reads go over the FP8 decode-attention bench's cache (fp8kv bench kernels 8x8192: 8 sequences x
// 512 blocks of 16 tokens, 8 KV heads x d128, one byte a value, K and V) when nothing else is done with the data:
// the ceiling the access pattern sets for the kernel, beside the same bytes read in address order.
//
//   g++ -O2 -march=native -fopenmp scripts/block_read_probe.cpp -o /tmp/block_read_probe && /tmp/block_read_probe
//
// Two threads (THREADS), as the targets state. Blocks are placed as the bench places them (a random permutation).
// Each pass reads one of two copies of the caches in turn, so no pass finds the one before it in the L3 cache, as
// the bench's untimed twin calls make sure. Every order prefetches into L2 16 KB ahead, as the kernel does; a
// read is a 64-byte load xor-ed into a register (AVX-512 where the compiler has it). Portable C++ and GCC vector
// extensions only, so it builds on Arm too.
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int kSeqs = 8, kBlocksPerSeq = 512, kHeads = 8, kSlab = 16 * 128;  // a head's slice of a block
constexpr int kBlock = kHeads * kSlab;
constexpr int64_t kCacheBytes = int64_t{kSeqs} * kBlocksPerSeq * kBlock;
constexpr int kAhead = 16384;

using Lines = uint64_t __attribute__((vector_size(64)));

struct Chunk {
  const char* p;
  int bytes;
};

char* allocate() {
  void* p = nullptr;
  if (posix_memalign(&p, 1 << 21, kCacheBytes) != 0) std::abort();
  madvise(p, kCacheBytes, MADV_HUGEPAGE);
  std::memset(p, 1, kCacheBytes);
  return static_cast<char*>(p);
}

uint64_t read_chunks(const std::vector<Chunk>& chunks) {
  Lines acc{};
  const size_t ahead = kAhead / chunks[0].bytes;
  for (size_t c = 0; c < chunks.size(); ++c) {
    if (c + ahead < chunks.size()) {
      for (int i = 0; i < chunks[c].bytes; i += 64) __builtin_prefetch(chunks[c + ahead].p + i, 0, 2);  // prefetcht1 on x86
    }
    for (int i = 0; i < chunks[c].bytes; i += 64) acc ^= *reinterpret_cast<const Lines*>(chunks[c].p + i);
  }
  uint64_t sum = 0;
  for (int i = 0; i < 8; ++i) sum += acc[i];
  return sum;
}

}  // namespace

int main() {
  const int threads = getenv("THREADS") ? std::atoi(getenv("THREADS")) : 2;
  std::vector<int> table(kSeqs * kBlocksPerSeq);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int>(i);
  std::mt19937 gen(0);
  std::shuffle(table.begin(), table.end(), gen);

  const char* names[] = {"random blocks, a head's 2 KB slab at a time (the kernel's order)",
                         "random blocks, a whole 16 KB block at a time",
                         "the same bytes in address order"};
  constexpr int kOrders = 3;
  // walks[copy][order][thread]: sequences are dealt to threads in turn
  std::vector<std::vector<std::vector<Chunk>>> walks[2];
  for (int copy = 0; copy < 2; ++copy) {
    const char* k = allocate();
    const char* v = allocate();
    walks[copy].assign(kOrders, std::vector<std::vector<Chunk>>(threads));
    for (int s = 0; s < kSeqs; ++s) {
      const int t = s % threads;
      const int* row = &table[s * kBlocksPerSeq];
      for (int h = 0; h < kHeads; ++h) {
        for (const char* cache : {k, v}) {
          for (int b = 0; b < kBlocksPerSeq; ++b) walks[copy][0][t].push_back({cache + int64_t{row[b]} * kBlock + h * kSlab, kSlab});
        }
      }
      for (const char* cache : {k, v}) {
        for (int b = 0; b < kBlocksPerSeq; ++b) walks[copy][1][t].push_back({cache + int64_t{row[b]} * kBlock, kBlock});
        for (int b = 0; b < kBlocksPerSeq; ++b) walks[copy][2][t].push_back({cache + (int64_t{s} * kBlocksPerSeq + b) * kBlock, kBlock});
      }
    }
  }

  std::vector<double> best(kOrders, 1e30);
  volatile uint64_t sink = 0;
  for (int pass = 0; pass < 2 + 2 * 7; ++pass) {  // the orders take turns; the first two passes warm up
    for (int order = 0; order < kOrders; ++order) {
      const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
      sink = sink + read_chunks(walks[pass % 2][order][omp_get_thread_num()]);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (pass >= 2) best[order] = std::min(best[order], s);
    }
  }
  std::printf("plain reads of 2 x %.0f MB (K and V), %d threads, best of 7:\n", kCacheBytes / 1e6, threads);
  for (int order = 0; order < kOrders; ++order) {
    std::printf("  %5.1f GB/s  %s\n", 2 * kCacheBytes / best[order] / 1e9, names[order]);
  }
  return 0;
}
