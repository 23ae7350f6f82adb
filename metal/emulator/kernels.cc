// Compiles the Metal kernel sources as C++ against the shim and registers every instantiation
// under its kernel_names.h name, with a launcher that runs it on the emulator's grid.
// This translation unit sees the shim's address-space macros: it includes nothing after them
// except kernel sources.
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "metal/emulator/launch.h"
#include "metal/emulator/runtime.h"
#include "metal/shim/metal_shim.h"
// clang-format off: the kernel sources must come after the shim.
#include "metal/kernels/rope_pool.metal"
#include "metal/kernels/attention.metal"
#include "metal/emulator/selftest.metal"

namespace jax_sgl::metal_emu {
namespace {

using Launcher = void (*)(Dim3, uint32_t, void* const*, const void*);

inline uint3 ToUint3(Dim3 d) { return uint3{d.x, d.y, d.z}; }

template <typename T, typename I>
void LaunchRopePool(Dim3 grid, uint32_t threads, void* const* b, const void* params) {
  MetalRopePoolParams p = *static_cast<const MetalRopePoolParams*>(params);
  RunGrid(grid, threads, [&](const ThreadIds& id) {
    rope_pool<T, I>(static_cast<const T*>(b[kRopeQ]), static_cast<const T*>(b[kRopeK]),
                    static_cast<const T*>(b[kRopeV]), static_cast<const I*>(b[kRopePositions]),
                    static_cast<const I*>(b[kRopeSlots]), static_cast<T*>(b[kRopeQRot]),
                    static_cast<T*>(b[kRopeKRot]), static_cast<T*>(b[kRopeKPool]),
                    static_cast<T*>(b[kRopeVPool]), static_cast<const float*>(b[kRopeInvFreq]), p,
                    ToUint3(id.group),
                    ToUint3(id.groups), id.index);
  });
}

template <typename T>
void LaunchAttentionFwd(Dim3 grid, uint32_t threads, void* const* b, const void* params) {
  MetalAttentionParams p = *static_cast<const MetalAttentionParams*>(params);
  RunGrid(grid, threads, [&](const ThreadIds& id) {
    attention_fwd<T>(static_cast<const T*>(b[kAttnQ]), static_cast<const T*>(b[kAttnK]),
                     static_cast<const T*>(b[kAttnV]), static_cast<T*>(b[kAttnOut]),
                     static_cast<float*>(b[kAttnLse]), static_cast<const int*>(b[kAttnCuSeqlensQ]),
                     static_cast<const int*>(b[kAttnCuSeqlensK]),
                     static_cast<const int*>(b[kAttnSequsedK]),
                     static_cast<const int*>(b[kAttnPageTable]),
                     static_cast<const float*>(b[kAttnSinks]), p, ToUint3(id.group),
                     ToUint3(id.groups), id.index, id.simd_group);
  });
}

template <typename T>
void LaunchAttentionClear(Dim3 grid, uint32_t threads, void* const* b, const void* params) {
  MetalAttentionParams p = *static_cast<const MetalAttentionParams*>(params);
  RunGrid(grid, threads, [&](const ThreadIds& id) {
    attention_clear<T>(static_cast<T*>(b[kAttnOut]), static_cast<float*>(b[kAttnLse]),
                       static_cast<const int*>(b[kAttnCuSeqlensQ]), p, ToUint3(id.group),
                       id.index);
  });
}

// Self-test kernels: buffer 0 is a float output, params unused.
template <int kWhich>
void LaunchSelftest(Dim3 grid, uint32_t threads, void* const* b, const void*) {
  namespace st = jax_sgl::metal_emu_selftest;
  float* out = static_cast<float*>(b[0]);
  RunGrid(grid, threads, [&](const ThreadIds& id) {
    if (kWhich == 0) st::simd_ops(out, id.index, id.simd_lane);
    if (kWhich == 1) st::barrier_order(out, id.index, id.size);
    if (kWhich == 2) st::divergent_barrier(out, id.index);
    if (kWhich == 3) st::threadgroup_overflow(out, id.index);
  });
}

const std::map<std::string, Launcher>& Registry() {
  static const std::map<std::string, Launcher> registry = [] {
    std::map<std::string, Launcher> r;
#define JAX_SGL_REGISTER_ROPE_POOL(t, i) \
  r[JAX_SGL_ROPE_POOL_KERNEL_NAME(t, i)] = &LaunchRopePool<JAX_SGL_METAL_TYPE_##t, JAX_SGL_METAL_TYPE_##i>;
    JAX_SGL_ROPE_POOL_KERNELS(JAX_SGL_REGISTER_ROPE_POOL)
#undef JAX_SGL_REGISTER_ROPE_POOL
#define JAX_SGL_REGISTER_ATTENTION(t)                                                       \
  r[JAX_SGL_ATTENTION_FWD_KERNEL_NAME(t)] = &LaunchAttentionFwd<JAX_SGL_METAL_TYPE_##t>;   \
  r[JAX_SGL_ATTENTION_CLEAR_KERNEL_NAME(t)] = &LaunchAttentionClear<JAX_SGL_METAL_TYPE_##t>;
    JAX_SGL_ATTENTION_KERNELS(JAX_SGL_REGISTER_ATTENTION)
#undef JAX_SGL_REGISTER_ATTENTION
    r["emu_selftest_simd_ops"] = &LaunchSelftest<0>;
    r["emu_selftest_barrier_order"] = &LaunchSelftest<1>;
    r["emu_selftest_divergent_barrier"] = &LaunchSelftest<2>;
    r["emu_selftest_threadgroup_overflow"] = &LaunchSelftest<3>;
    return r;
  }();
  return registry;
}

}  // namespace

void Launch(const std::string& name, const uint32_t groups[3], uint32_t threads,
            void* const* buffers, const void* params) {
  auto it = Registry().find(name);
  if (it == Registry().end()) throw std::invalid_argument("no emulated Metal kernel " + name);
  it->second(Dim3{groups[0], groups[1], groups[2]}, threads, buffers, params);
}

std::vector<std::string> KernelNames() {
  std::vector<std::string> names;
  for (const auto& kv : Registry()) names.push_back(kv.first);
  return names;
}

}  // namespace jax_sgl::metal_emu
