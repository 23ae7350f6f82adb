// Parallel loops on XLA's intra-op thread pool (the FFI ThreadPool context), so jax_sgl shares
// XLA's threads instead of oversubscribing the machine with its own.
//
// The calling thread works too and the loop state is reference counted: a task that the pool starts
// after every index was claimed finds nothing to do and touches nothing the caller owns, so the
// loop can never deadlock on a busy pool nor use freed state.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jax_sgl::cpu {

// Calls fn(i) for every i in [0, n), spread over the pool's threads and the caller.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, F&& fn) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(pool.num_threads(), n - 1);
  if (threads <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t n = 0;
    std::function<void(int64_t)> fn;
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  state->n = n;
  state->fn = std::ref(fn);
  auto work = [state] {
    for (;;) {
      const int64_t i = state->next.fetch_add(1);
      if (i >= state->n) return;
      state->fn(i);
      if (state->done.fetch_add(1) + 1 == state->n) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  for (int64_t t = 0; t < threads; ++t) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == state->n; });
}

// Number of work items to cut a loop of n units into: a few per thread for load balance.
inline int64_t NumChunks(xla::ffi::ThreadPool& pool, int64_t n, int64_t min_units_per_chunk) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads() + 1);
  const int64_t by_size = std::max<int64_t>(1, n / std::max<int64_t>(1, min_units_per_chunk));
  return std::max<int64_t>(1, std::min<int64_t>(by_size, 4 * threads));
}

}  // namespace jax_sgl::cpu
