// A GPU thread block run on one host thread, for the host emulations (host_emulation.cpp, hadamard_kernels.cu).
//
// Each GPU thread of the block is a fiber (ucontext) with a stack of its own; a thread runs until it waits at a
// barrier (__syncthreads, or a warp's exchange), then the next thread that can run does. One OS thread per GPU
// thread, as the emulation had at first, spent most of a test's time in the kernel scheduler: a warp shuffle
// woke 32 threads twice, and a tensor-core step 128, on a machine with two cores. Fibers switch in user space.
// A block whose threads all wait on barriers that can never fill (a thread skipped one the others reached: on a
// GPU, undefined behaviour) is reported and the process aborts, where OS threads hung.
#pragma once

#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <vector>

namespace fp8kv::gpu::host {

class FiberBlock;

// A barrier of `expected` fibers of one block (the block, or one warp).
class FiberBarrier {
 public:
  explicit FiberBarrier(int expected) : expected_(expected) {}
  inline void arrive_and_wait();

 private:
  friend class FiberBlock;
  int expected_;
  int arrived_ = 0;
  unsigned generation_ = 0;
};

class FiberBlock {
 public:
  // The stack each GPU thread gets: the kernels keep their register arrays (a few KB) on it.
  static constexpr size_t kStackBytes = 256 * 1024;

  // Runs body(tid) for tid in [0, threads) as fibers, to the end of every one of them.
  static void run(int threads, const std::function<void(int)>& body) {
    FiberBlock block(threads, body);
    block.schedule();
  }

  static FiberBlock*& current() {
    static thread_local FiberBlock* block = nullptr;
    return block;
  }

  // The running fiber waits until `barrier` passes `generation`.
  void wait(const FiberBarrier& barrier, unsigned generation) {
    Fiber& me = fibers_[running_];
    me.barrier = &barrier;
    me.generation = generation;
    swapcontext(&me.context, &scheduler_);
  }

 private:
  struct Fiber {
    ucontext_t context;
    const FiberBarrier* barrier = nullptr;  // waited on, until its generation moves past `generation`
    unsigned generation = 0;
    bool done = false;
  };

  FiberBlock(int threads, const std::function<void(int)>& body) : body_(body), fibers_(threads) {}

  static void entry() {
    FiberBlock* block = current();
    block->body_(block->running_);
    block->fibers_[block->running_].done = true;
    // Returning switches to uc_link, the scheduler.
  }

  bool runnable(const Fiber& f) const {
    return !f.done && (f.barrier == nullptr || f.barrier->generation_ != f.generation);
  }

  void schedule() {
    FiberBlock* outer = current();
    current() = this;
    // Stacks are kept for the next block: a grid runs thousands of blocks of the same size.
    static thread_local std::vector<std::unique_ptr<char[]>> stacks;
    while (stacks.size() < fibers_.size()) stacks.emplace_back(new char[kStackBytes]);
    for (size_t i = 0; i < fibers_.size(); ++i) {
      Fiber& f = fibers_[i];
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = stacks[i].get();
      f.context.uc_stack.ss_size = kStackBytes;
      f.context.uc_link = &scheduler_;
      makecontext(&f.context, &FiberBlock::entry, 0);
    }
    size_t left = fibers_.size();
    while (left > 0) {
      bool ran = false;
      for (size_t i = 0; i < fibers_.size(); ++i) {
        Fiber& f = fibers_[i];
        if (!runnable(f)) continue;
        f.barrier = nullptr;
        running_ = static_cast<int>(i);
        swapcontext(&scheduler_, &f.context);
        ran = true;
        if (f.done) --left;
      }
      if (!ran) {
        std::fprintf(stderr, "fp8kv host emulation: deadlock, %zu of %zu GPU threads wait on barriers that cannot "
                     "fill (a thread skipped a barrier the others reached)\n", left, fibers_.size());
        std::abort();
      }
    }
    current() = outer;
  }

  const std::function<void(int)>& body_;
  std::vector<Fiber> fibers_;
  ucontext_t scheduler_{};
  int running_ = 0;
};

inline void FiberBarrier::arrive_and_wait() {
  const unsigned generation = generation_;
  if (++arrived_ == expected_) {
    arrived_ = 0;
    ++generation_;
    return;
  }
  FiberBlock::current()->wait(*this, generation);
}

}  // namespace fp8kv::gpu::host
