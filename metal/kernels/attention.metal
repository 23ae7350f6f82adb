// Metal entry points of attention forward: thin [[kernel]] wrappers around attention.h, one pair
// per storage dtype under the names in kernel_names.h.
//   jax_sgl_attention_fwd_<t>:   grid (num_heads, q blocks >= 1, batch), kAttnThreads threads
//   jax_sgl_attention_clear_<t>: grid (ceil(total_q / kAttnClearThreads)), kAttnClearThreads
//                                threads; only needed for varlen q
#include "metal/kernels/attention.h"

using namespace metal;
using namespace jax_sgl;
using namespace jax_sgl::metal_kernels;

template <typename T>
[[kernel]] void attention_fwd(const device T* q [[buffer(kAttnQ)]],
                              const device T* k [[buffer(kAttnK)]],
                              const device T* v [[buffer(kAttnV)]],
                              device T* out [[buffer(kAttnOut)]],
                              device float* lse [[buffer(kAttnLse)]],
                              const device int* cu_seqlens_q [[buffer(kAttnCuSeqlensQ)]],
                              const device int* cu_seqlens_k [[buffer(kAttnCuSeqlensK)]],
                              const device int* seqused_k [[buffer(kAttnSequsedK)]],
                              const device int* page_table [[buffer(kAttnPageTable)]],
                              const device float* sinks [[buffer(kAttnSinks)]],
                              constant MetalAttentionParams& p [[buffer(kAttnParams)]],
                              uint3 group [[threadgroup_position_in_grid]],
                              uint3 groups [[threadgroups_per_grid]],
                              uint tid [[thread_index_in_threadgroup]],
                              uint simdgroup [[simdgroup_index_in_threadgroup]]) {
  JAX_SGL_THREADGROUP_ARRAY(float, q_tile, kAttnBlockM * kAttnMaxHeadDim);
  JAX_SGL_THREADGROUP_ARRAY(float, kv_tile, kAttnBlockN * kAttnMaxHeadDim);
  JAX_SGL_THREADGROUP_ARRAY(float, o_tile, kAttnBlockM * kAttnMaxHeadDim);
  JAX_SGL_THREADGROUP_ARRAY(float, s_tile, kAttnBlockM * kAttnBlockN);
  JAX_SGL_THREADGROUP_ARRAY(float, diag_tile, kAttnBlockM * kFrag);
  JAX_SGL_THREADGROUP_ARRAY(float, row_m, kAttnBlockM);
  JAX_SGL_THREADGROUP_ARRAY(float, row_l, kAttnBlockM);
  JAX_SGL_THREADGROUP_ARRAY(long, key_row, kAttnBlockN);
  AttentionTiles tiles = {q_tile, kv_tile, o_tile, s_tile, diag_tile, row_m, row_l, key_row};
  attention_fwd_impl<T>(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
                        sinks, p, tiles, group, groups, tid, simdgroup);
}

template <typename T>
[[kernel]] void attention_clear(device T* out [[buffer(kAttnOut)]],
                                device float* lse [[buffer(kAttnLse)]],
                                const device int* cu_seqlens_q [[buffer(kAttnCuSeqlensQ)]],
                                constant MetalAttentionParams& p [[buffer(kAttnParams)]],
                                uint3 group [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]]) {
  attention_clear_impl<T>(out, lse, cu_seqlens_q, p, long(group.x) * kAttnClearThreads + tid);
}

#define JAX_SGL_INSTANTIATE_ATTENTION(t)                                                     \
  JAX_SGL_INSTANTIATE_KERNEL(JAX_SGL_ATTENTION_FWD_KERNEL_NAME(t),                          \
                             attention_fwd<JAX_SGL_METAL_TYPE_##t>)                         \
  JAX_SGL_INSTANTIATE_KERNEL(JAX_SGL_ATTENTION_CLEAR_KERNEL_NAME(t),                        \
                             attention_clear<JAX_SGL_METAL_TYPE_##t>)
JAX_SGL_ATTENTION_KERNELS(JAX_SGL_INSTANTIATE_ATTENTION)
