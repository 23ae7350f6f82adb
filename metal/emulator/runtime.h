// CPU grid emulator for Metal compute kernels (test infrastructure, not a backend).
//
// RunGrid runs every thread of every threadgroup of a dispatch. The threads of one threadgroup
// are fibers (ucontext) on one OS thread, scheduled cooperatively: a fiber runs until it waits
// at a barrier, so threadgroup_barrier and the simdgroup exchanges really synchronize, and a
// barrier that not every thread reaches is reported as an error instead of hanging. Threadgroups
// are spread over a few OS threads. Kernel code reaches the runtime only through the functions
// below (called by metal/shim/metal_shim.h), so this header is free of Metal macros.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace jax_sgl::metal_emu {

// Metal's limits that the emulator enforces, so a kernel that passes here fits a real GPU.
constexpr int kSimdWidth = 32;
constexpr size_t kMaxThreadgroupMemory = 32 * 1024;
constexpr int kMaxThreadsPerThreadgroup = 1024;

struct Dim3 {
  uint32_t x = 1, y = 1, z = 1;
};

// What a kernel thread may ask about its position (Metal's thread attributes). The names avoid
// the words the shim turns into macros (thread, threadgroup).
struct ThreadIds {
  Dim3 group;          // [[threadgroup_position_in_grid]]
  Dim3 groups;         // [[threadgroups_per_grid]]
  uint32_t index;      // [[thread_index_in_threadgroup]] (1-D threadgroups)
  uint32_t size;       // [[threads_per_threadgroup]]
  uint32_t simd_lane;  // [[thread_index_in_simdgroup]]
  uint32_t simd_group; // [[simdgroup_index_in_threadgroup]]
};

// Runs body once per thread of a grid of 1-D threadgroups. Throws std::runtime_error after the
// grid if any threadgroup deadlocked at a barrier or overflowed threadgroup memory.
void RunGrid(Dim3 threadgroups, uint32_t threads_per_threadgroup,
             const std::function<void(const ThreadIds&)>& body);

// --- called from kernel code through the shim -------------------------------------------------
void ThreadgroupBarrier();
// Every lane of the calling simdgroup waits for the others (lockstep points of simd operations).
void SimdgroupBarrier();
// Publishes v for the calling lane and returns the values of all lanes of its simdgroup
// (valid until the next exchange); *lanes receives the simdgroup's width.
const float* SimdExchange(float v, int* lanes);
// Threadgroup memory: every thread of a threadgroup makes the same sequence of calls and gets
// the same addresses (the shim's spelling of a `threadgroup T name[n]` declaration).
void* ThreadgroupAlloc(size_t bytes);
uint32_t CurrentSimdLane();

}  // namespace jax_sgl::metal_emu
