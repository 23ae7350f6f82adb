// Metal entry points of rope_pool_fused: thin [[kernel]] wrappers around rope_pool_impl
// (rope_pool.h), instantiated per (dtype, index type) under the names in kernel_names.h.
// Dispatch: threadgroups_per_grid.x >= 1 (tokens are grid-strided), kRopePoolThreads threads each.
#include "metal/kernels/rope_pool.h"

using namespace metal;
using namespace jax_sgl;
using namespace jax_sgl::metal_kernels;

template <typename T, typename I>
[[kernel]] void rope_pool(const device T* q [[buffer(kRopeQ)]],
                          const device T* k [[buffer(kRopeK)]],
                          const device T* v [[buffer(kRopeV)]],
                          const device I* positions [[buffer(kRopePositions)]],
                          const device I* slots [[buffer(kRopeSlots)]],
                          device T* q_rot [[buffer(kRopeQRot)]],
                          device T* k_rot [[buffer(kRopeKRot)]],
                          device T* k_pool [[buffer(kRopeKPool)]],
                          device T* v_pool [[buffer(kRopeVPool)]],
                          const device float* inv_freq [[buffer(kRopeInvFreq)]],
                          constant MetalRopePoolParams& p [[buffer(kRopeParams)]],
                          uint3 group [[threadgroup_position_in_grid]],
                          uint3 groups [[threadgroups_per_grid]],
                          uint tid [[thread_index_in_threadgroup]]) {
  rope_pool_impl<T, I>(q, k, v, positions, slots, q_rot, k_rot, k_pool, v_pool, inv_freq, p,
                       group.x, groups.x, tid);
}

#define JAX_SGL_INSTANTIATE_ROPE_POOL(t, i)                          \
  JAX_SGL_INSTANTIATE_KERNEL(JAX_SGL_ROPE_POOL_KERNEL_NAME(t, i),     \
                             rope_pool<JAX_SGL_METAL_TYPE_##t, JAX_SGL_METAL_TYPE_##i>)
JAX_SGL_ROPE_POOL_KERNELS(JAX_SGL_INSTANTIATE_ROPE_POOL)
