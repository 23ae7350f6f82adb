// Building blocks shared by jax_sgl's Metal kernels, and the one switch between the Metal compiler
// and the Linux emulator build (metal/shim/metal_shim.h, included by the emulator before this).
#pragma once

#if defined(__METAL_VERSION__)
#include <metal_stdlib>
// Threadgroup memory is declared at kernel scope; the emulator's spelling allocates the same
// block for every thread of a threadgroup.
#define JAX_SGL_THREADGROUP_ARRAY(T, name, n) threadgroup T name[n]
#else
#define JAX_SGL_THREADGROUP_ARRAY(T, name, n) \
  T* name = static_cast<T*>(::jax_sgl::metal_emu::ThreadgroupAlloc(sizeof(T) * (n)))
#endif

#include "metal/kernels/kernel_names.h"
#include "metal/kernels/params.h"

// Instantiates kernel template `fn<args>` under `name` (MLX's idiom). The emulator build ignores
// the attributes and keeps a plain explicit instantiation.
#define JAX_SGL_INSTANTIATE_KERNEL(name, ...) \
  template [[host_name(name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;

namespace jax_sgl {
namespace metal_kernels {

// Storage <-> float. Every load widens to float and every store narrows once, as the CPU kernels
// do, so results agree with them to the rounding of the final store.
template <typename T>
inline float LoadF(T x) {
  return static_cast<float>(x);
}
template <typename T>
inline T StoreF(float x) {
  return static_cast<T>(x);
}

}  // namespace metal_kernels
}  // namespace jax_sgl
