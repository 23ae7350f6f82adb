// Test-only kernels for the emulator itself (tests/test_metal_emulated.py::test_emulator_*):
// the shim's simd reductions, a barrier that must really order threads, and the two errors the
// emulator must report instead of hanging or overrunning (divergent barrier, > 32 KB threadgroup
// memory). Compiled only into jax_sgl._metal_emu, never into the metallib.
#include "metal/kernels/utils.h"

using namespace metal;

namespace jax_sgl {
namespace metal_emu_selftest {

// out[3 * tid + {0, 1, 2}] = simd_sum(lane), simd_max(lane), simd_shuffle_xor(lane, 1)
inline void simd_ops(device float* out, uint tid, uint lane) {
  const float x = float(lane);
  const float s = simd_sum(x), m = simd_max(x), x1 = simd_shuffle_xor(x, ushort(1));
  out[3 * tid] = s;
  out[3 * tid + 1] = m;
  out[3 * tid + 2] = x1;
}

// out[tid] = the value thread (tid + 1) % n wrote before the barrier; without a real barrier the
// emulator's sequential fibers would read the poison.
inline void barrier_order(device float* out, uint tid, uint n) {
  JAX_SGL_THREADGROUP_ARRAY(float, shared, 1024);
  shared[tid] = -1.f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  shared[tid] = float(tid) + 0.5f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = shared[(tid + 1) % n];
}

inline void divergent_barrier(device float* out, uint tid) {
  if (tid == 0) return;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = 1.f;
}

inline void threadgroup_overflow(device float* out, uint tid) {
  JAX_SGL_THREADGROUP_ARRAY(float, big, 9 * 1024);  // 36 KB
  big[tid] = 1.f;
  out[tid] = big[tid];
}

}  // namespace metal_emu_selftest
}  // namespace jax_sgl
