// Host side of a Metal dispatch, in plain C++ so that the macOS glue (*.mm) and the Linux
// emulator share it: which kernel (by the names in kernel_names.h), with which kernel-side params,
// over which grid, and whether the Metal kernels support a call at all (else: CPU kernels).
#pragma once

#include <cstdint>
#include <vector>

#include "ffi/common/attention_params.h"
#include "ffi/common/rope_pool_params.h"
#include "metal/kernels/kernel_names.h"
#include "metal/kernels/params.h"

namespace jax_sgl::metal {

// The params travel by setBytes: host and MSL must lay them out alike (natural alignment, 64-bit
// fields first). A field added on one side only changes these sizes.
static_assert(sizeof(MetalRopePoolParams) == 64, "MetalRopePoolParams layout");
static_assert(sizeof(MetalAttentionParams) == 128, "MetalAttentionParams layout");

struct Grid {
  uint32_t groups[3];  // threadgroups per grid (x, y, z)
  uint32_t threads;    // threads per threadgroup (1-D)
};

// --- rope_pool -------------------------------------------------------------------------------

inline const char* RopePoolKernelName(DType t, IndexType i) {
#define JAX_SGL_ROPE_POOL_NAME_CASE(tt, it) \
  if (t == JAX_SGL_METAL_DTYPE_##tt && i == JAX_SGL_METAL_ITYPE_##it) return JAX_SGL_ROPE_POOL_KERNEL_NAME(tt, it);
  JAX_SGL_ROPE_POOL_KERNELS(JAX_SGL_ROPE_POOL_NAME_CASE)
#undef JAX_SGL_ROPE_POOL_NAME_CASE
  return nullptr;
}

// `fused`: the pools are one kv_buffer (v_pool points into k_pool's allocation).
inline MetalRopePoolParams ToMetalParams(const RopePoolParams& p, bool fused) {
  MetalRopePoolParams m;
  m.num_tokens = p.num_tokens;
  m.num_slots = p.num_slots;
  m.pool_row_stride = p.pool_row_stride;
  m.pool_head_stride = p.pool_head_stride;
  const int64_t element_bytes = p.dtype == DType::kF32 ? 4 : 2;
  m.v_offset = fused ? (static_cast<const char*>(p.v_pool) - static_cast<const char*>(p.k_pool)) /
                           element_bytes
                     : 0;
  m.v_in_k_pool = fused ? 1 : 0;
  m.num_qo_heads = p.num_qo_heads;
  m.num_kv_heads = p.num_kv_heads;
  m.head_dim = p.head_dim;
  m.rotary_dim = p.rotary_dim;
  m.is_neox = p.is_neox ? 1 : 0;
  return m;
}

// One threadgroup per token up to 65535; the kernel grid-strides over the rest.
inline Grid RopePoolGrid(const RopePoolParams& p) {
  const int64_t groups = p.num_tokens < 65535 ? p.num_tokens : 65535;
  return Grid{{uint32_t(groups), 1, 1}, uint32_t(kRopePoolThreads)};
}

// --- attention -------------------------------------------------------------------------------

inline const char* AttentionFwdKernelName(DType t) {
#define JAX_SGL_ATTENTION_NAME_CASE(tt) \
  if (t == JAX_SGL_METAL_DTYPE_##tt) return JAX_SGL_ATTENTION_FWD_KERNEL_NAME(tt);
  JAX_SGL_ATTENTION_KERNELS(JAX_SGL_ATTENTION_NAME_CASE)
#undef JAX_SGL_ATTENTION_NAME_CASE
  return nullptr;
}

inline const char* AttentionClearKernelName(DType t) {
#define JAX_SGL_ATTENTION_NAME_CASE(tt) \
  if (t == JAX_SGL_METAL_DTYPE_##tt) return JAX_SGL_ATTENTION_CLEAR_KERNEL_NAME(tt);
  JAX_SGL_ATTENTION_KERNELS(JAX_SGL_ATTENTION_NAME_CASE)
#undef JAX_SGL_ATTENTION_NAME_CASE
  return nullptr;
}

// Why the Metal kernels cannot run this call (the caller falls back to the CPU kernels), or
// nullptr when they can.
inline const char* AttentionUnsupported(const AttentionParams& p) {
  if (!AttentionFwdKernelName(p.q_type) || p.k_type != p.q_type || p.v_type != p.q_type ||
      p.out_type != p.q_type)
    return "fp8 or mixed dtypes";
  if (p.q_descale || p.k_descale || p.v_descale || p.q_block_scale)
    return "descales or block scales";
  if (p.head_dim > kAttnMaxHeadDim || p.head_dim_v > kAttnMaxHeadDim) return "head_dim > 128";
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) return "head counts";
  return nullptr;
}

// v_bound: the buffer bound at kAttnV (p.v itself, or the fused buffer that p.v points into).
inline MetalAttentionParams ToMetalParams(const AttentionParams& p, const void* v_bound) {
  MetalAttentionParams m;
  m.total_q = p.total_q;
  m.total_k = p.total_k;
  m.k_row_stride = p.k_row_stride;
  m.k_head_stride = p.k_head_stride;
  m.v_row_stride = p.v_row_stride;
  m.v_head_stride = p.v_head_stride;
  m.v_offset = (static_cast<const char*>(p.v) - static_cast<const char*>(v_bound)) /
               (p.v_type == DType::kF32 ? 4 : 2);
  m.kv_layout = int(p.kv_layout);
  m.varlen_q = p.cu_seqlens_q ? 1 : 0;
  m.has_seqused_k = p.seqused_k ? 1 : 0;
  m.has_sinks = p.sinks ? 1 : 0;
  m.batch = p.batch;
  m.seqlen_q = p.seqlen_q;
  m.seqlen_k = p.seqlen_k;
  m.num_heads = p.num_heads;
  m.num_kv_heads = p.num_kv_heads;
  m.head_dim = p.head_dim;
  m.head_dim_v = p.head_dim_v;
  m.page_size = p.page_size;
  m.num_pages = p.num_pages;
  m.max_pages = p.max_pages;
  m.softmax_scale = p.softmax_scale;
  m.softcap = p.softcap;
  m.window_left = p.window_left;
  m.window_right = p.causal ? 0 : p.window_right;
  return m;
}

// (q head, query block, sequence). For varlen q, seqlen_q is max_seqlen_q, a hint: the kernel
// grid-strides over query blocks, so a longer sequence is still covered (just by fewer groups).
inline Grid AttentionFwdGrid(const AttentionParams& p) {
  const int64_t blocks = (int64_t(p.seqlen_q) + kAttnBlockM - 1) / kAttnBlockM;
  return Grid{{uint32_t(p.num_heads), uint32_t(blocks > 0 ? (blocks < 65535 ? blocks : 65535) : 1),
               uint32_t(p.batch)},
              uint32_t(kAttnThreads)};
}

// Needed only for varlen q (rows no sequence covers).
inline Grid AttentionClearGrid(const AttentionParams& p) {
  return Grid{{uint32_t((p.total_q + kAttnClearThreads - 1) / kAttnClearThreads), 1, 1},
              uint32_t(kAttnClearThreads)};
}

}  // namespace jax_sgl::metal
