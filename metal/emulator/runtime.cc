// Fiber scheduler behind metal/emulator/runtime.h. One Scheduler per OS worker runs one
// threadgroup at a time: N fibers, round-robin; a fiber that waits at a barrier yields back to
// the scheduler, the last one to arrive releases the others. A full pass in which nothing moved
// while fibers remain is a deadlock (a barrier not reached by every thread, as Metal requires).
#include "metal/emulator/runtime.h"

#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace jax_sgl::metal_emu {
namespace {

// Kernel threads keep only a few scalars and small arrays on their stacks.
constexpr size_t kFiberStack = 128 * 1024;
// Slack past Metal's limit so an overflowing kernel is reported, not a heap overrun.
constexpr size_t kArenaBytes = 4 * kMaxThreadgroupMemory;

struct Barrier {
  int expected = 0;
  int arrived = 0;
  uint64_t generation = 0;
};

struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  ThreadIds ids;
  size_t arena_cursor = 0;
  bool done = false;
};

class Scheduler {
 public:
  void Run(const ThreadIds& group, uint32_t threads, const std::function<void(const ThreadIds&)>& body);
  void Wait(Barrier& b);
  Fiber& Current() { return *fibers_[current_]; }
  Barrier& SimdBarrier() { return simd_barriers_[Current().ids.simd_group]; }
  float* SimdSlots() { return &simd_slots_[size_t(Current().ids.simd_group) * kSimdWidth]; }
  int SimdWidth() { return simd_barriers_[Current().ids.simd_group].expected; }
  Barrier group_barrier;
  std::vector<char> arena = std::vector<char>(kArenaBytes);
  size_t arena_high = 0;
  std::string error;

 private:
  static void Entry();
  std::vector<std::unique_ptr<Fiber>> fibers_;
  std::vector<Barrier> simd_barriers_;
  std::vector<float> simd_slots_;
  ucontext_t main_;
  size_t current_ = 0;
  uint64_t progress_ = 0;
  const std::function<void(const ThreadIds&)>* body_ = nullptr;
};

thread_local Scheduler* tls_scheduler = nullptr;

void Scheduler::Entry() {
  Scheduler* s = tls_scheduler;
  Fiber& f = s->Current();
  (*s->body_)(f.ids);
  f.done = true;
  ++s->progress_;
  if (s->group_barrier.arrived > 0 && s->error.empty())
    s->error = "a thread returned while others wait at threadgroup_barrier";
  // Returning resumes uc_link (the scheduler).
}

void Scheduler::Run(const ThreadIds& group, uint32_t threads,
                    const std::function<void(const ThreadIds&)>& body) {
  body_ = &body;
  while (fibers_.size() < threads) {
    fibers_.push_back(std::make_unique<Fiber>());
    fibers_.back()->stack.reset(new char[kFiberStack]);
  }
  const uint32_t simdgroups = (threads + kSimdWidth - 1) / kSimdWidth;
  simd_barriers_.assign(simdgroups, Barrier{});
  simd_slots_.assign(size_t(simdgroups) * kSimdWidth, 0.f);
  for (uint32_t g = 0; g < simdgroups; ++g)
    simd_barriers_[g].expected = int(std::min<uint32_t>(kSimdWidth, threads - g * kSimdWidth));
  group_barrier = Barrier{};
  group_barrier.expected = int(threads);
  arena_high = 0;

  for (uint32_t t = 0; t < threads; ++t) {
    Fiber& f = *fibers_[t];
    f.ids = group;
    f.ids.index = t;
    f.ids.simd_lane = t % kSimdWidth;
    f.ids.simd_group = t / kSimdWidth;
    f.arena_cursor = 0;
    f.done = false;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kFiberStack;
    f.ctx.uc_link = &main_;
    makecontext(&f.ctx, &Scheduler::Entry, 0);
  }
  uint32_t alive = threads;
  while (alive > 0) {
    const uint64_t before = progress_;
    for (uint32_t t = 0; t < threads; ++t) {
      if (fibers_[t]->done) continue;
      current_ = t;
      swapcontext(&main_, &fibers_[t]->ctx);
      if (fibers_[t]->done) --alive;
    }
    if (alive > 0 && progress_ == before) {
      // Every live fiber waits and none can be released: abandon them (their stacks hold only
      // trivially destructible kernel locals) and report.
      if (error.empty()) error = "deadlock: a barrier is not reached by every thread";
      return;
    }
  }
}

void Scheduler::Wait(Barrier& b) {
  const uint64_t gen = b.generation;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.generation;
    ++progress_;
    return;
  }
  Fiber& f = Current();
  while (b.generation == gen) swapcontext(&f.ctx, &main_);
}

}  // namespace

void ThreadgroupBarrier() { tls_scheduler->Wait(tls_scheduler->group_barrier); }

void SimdgroupBarrier() { tls_scheduler->Wait(tls_scheduler->SimdBarrier()); }

const float* SimdExchange(float v, int* lanes) {
  Scheduler* s = tls_scheduler;
  float* slots = s->SimdSlots();
  // The first barrier keeps a lane from overwriting a slot another lane has not read yet.
  s->Wait(s->SimdBarrier());
  slots[s->Current().ids.simd_lane] = v;
  s->Wait(s->SimdBarrier());
  *lanes = s->SimdWidth();
  return slots;
}

void* ThreadgroupAlloc(size_t bytes) {
  Scheduler* s = tls_scheduler;
  Fiber& f = s->Current();
  const size_t offset = f.arena_cursor;
  f.arena_cursor += (bytes + 15) / 16 * 16;
  s->arena_high = std::max(s->arena_high, f.arena_cursor);
  if (f.arena_cursor > kMaxThreadgroupMemory) {
    if (s->error.empty())
      s->error = "threadgroup memory " + std::to_string(f.arena_cursor) + " B exceeds Metal's " +
                 std::to_string(kMaxThreadgroupMemory) + " B";
    if (f.arena_cursor > kArenaBytes) std::abort();  // cannot continue without corrupting memory
  }
  return s->arena.data() + offset;
}

uint32_t CurrentSimdLane() { return tls_scheduler->Current().ids.simd_lane; }

void RunGrid(Dim3 grid, uint32_t threads, const std::function<void(const ThreadIds&)>& body) {
  if (threads == 0 || threads > uint32_t(kMaxThreadsPerThreadgroup))
    throw std::runtime_error("threads per threadgroup must be in [1, 1024]");
  const uint64_t groups = uint64_t(grid.x) * grid.y * grid.z;
  if (groups == 0) return;
  const unsigned workers =
      unsigned(std::min<uint64_t>(groups, std::max(1u, std::thread::hardware_concurrency())));
  std::atomic<uint64_t> next{0};
  std::mutex mu;
  std::string first_error;
  auto work = [&]() {
    Scheduler sched;
    tls_scheduler = &sched;
    for (uint64_t g = next++; g < groups; g = next++) {
      ThreadIds ids{};
      ids.group = Dim3{uint32_t(g % grid.x), uint32_t(g / grid.x % grid.y),
                             uint32_t(g / (uint64_t(grid.x) * grid.y))};
      ids.groups = grid;
      ids.size = threads;
      sched.Run(ids, threads, body);
      if (!sched.error.empty()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.empty()) first_error = sched.error;
        break;
      }
    }
    tls_scheduler = nullptr;
  };
  std::vector<std::thread> pool;
  for (unsigned w = 1; w < workers; ++w) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (!first_error.empty()) throw std::runtime_error("metal emulator: " + first_error);
}

}  // namespace jax_sgl::metal_emu
