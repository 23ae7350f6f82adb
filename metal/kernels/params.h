// Kernel-side parameters of the Metal kernels: pointer-free mirrors of RopePoolParams and
// AttentionParams (ffi/common), passed as a `constant` struct. Buffers are bound separately
// (indices below) because Metal kernel arguments carry their address space; metal/host/plan.h
// fills these from the host structs, for the macOS glue and the Linux emulator alike.
// Plain C++14 layout shared by host and GPU: 64-bit fields first, flags as int (MSL bool is not
// guaranteed to match the host's).
#pragma once

#if defined(__METAL_VERSION__)
#define JAX_SGL_METAL_I64 long
#define JAX_SGL_METAL_CONST static constant constexpr const
#else
#include <cstdint>
#define JAX_SGL_METAL_I64 int64_t
#define JAX_SGL_METAL_CONST static constexpr const
#endif

namespace jax_sgl {

// Buffer indices of jax_sgl_rope_pool_*.
enum RopePoolBuffer {
  kRopeQ = 0, kRopeK, kRopeV, kRopePositions, kRopeSlots,
  kRopeQRot, kRopeKRot, kRopeKPool,
  kRopeVPool,    // v_pool; a dummy with a fused kv_buffer (V lives in kRopeKPool, see v_in_k_pool)
  kRopeInvFreq,  // float [rotary_dim / 2]: the caller's inv_freq table (ffi/common/rope_math.h)
  kRopeParams
};

// 64 threads: a token has (Hq + Hkv) * rotary_dim / 2 pairs, a few hundred to a few thousand, so
// two simdgroups stay busy without idling lanes on small models.
JAX_SGL_METAL_CONST int kRopePoolThreads = 64;

struct MetalRopePoolParams {
  JAX_SGL_METAL_I64 num_tokens;
  JAX_SGL_METAL_I64 num_slots;
  JAX_SGL_METAL_I64 pool_row_stride;   // RopePoolParams' pool strides, in elements
  JAX_SGL_METAL_I64 pool_head_stride;
  JAX_SGL_METAL_I64 v_offset;          // elements from the V buffer's start to V of slot 0, head 0
  int num_qo_heads;
  int num_kv_heads;
  int head_dim;
  int rotary_dim;   // even, <= head_dim
  int is_neox;
  // 1 with a fused kv_buffer: V is written into the kRopeKPool buffer (at v_offset), because one
  // host allocation cannot be bound as two Metal buffers without staging one over the other.
  int v_in_k_pool;
};

// Buffer indices of jax_sgl_attention_fwd_* and jax_sgl_attention_clear_*. Absent index arrays
// (and sinks) are bound to a dummy buffer and flagged off in the params.
enum AttentionBuffer {
  kAttnQ = 0, kAttnK, kAttnV, kAttnOut, kAttnLse,
  kAttnCuSeqlensQ, kAttnCuSeqlensK, kAttnSequsedK, kAttnPageTable,
  kAttnSinks,  // float [num_heads] (attention_sink.h)
  kAttnParams
};

// Attention tiles (see metal/kernels/attention.h). 16 x 16 blocks: two rows and two columns of
// 8x8 simdgroup fragments. Q, K/V and O tiles of 16 x 128 floats are 8 KB each, 25 KB in all,
// under Metal's 32 KB of threadgroup memory; larger head dims take the CPU kernels.
JAX_SGL_METAL_CONST int kAttnBlockM = 16;
JAX_SGL_METAL_CONST int kAttnBlockN = 16;
JAX_SGL_METAL_CONST int kAttnMaxHeadDim = 128;
JAX_SGL_METAL_CONST int kAttnSimdgroups = 2;
JAX_SGL_METAL_CONST int kAttnThreads = kAttnSimdgroups * 32;
JAX_SGL_METAL_CONST int kAttnClearThreads = 64;

struct MetalAttentionParams {
  JAX_SGL_METAL_I64 total_q;  // rows of q/out
  JAX_SGL_METAL_I64 total_k;  // rows of k/v (paged: num_pages * page_size)
  // K/V element (row r, kv head h, feature e) at k[r * k_row_stride + h * k_head_stride + e] and
  // v[v_offset + r * v_row_stride + h * v_head_stride + e] (AttentionParams' strides; v_offset
  // is where V starts in the buffer bound as v: the fused buffer's first V head, else 0).
  JAX_SGL_METAL_I64 k_row_stride;
  JAX_SGL_METAL_I64 k_head_stride;
  JAX_SGL_METAL_I64 v_row_stride;
  JAX_SGL_METAL_I64 v_head_stride;
  JAX_SGL_METAL_I64 v_offset;
  int kv_layout;              // KvLayout: 0 dense, 1 varlen, 2 paged
  int varlen_q;               // cu_seqlens_q bound
  int has_seqused_k;
  int has_sinks;
  int batch;
  int seqlen_q;   // dense q rows per sequence (varlen: unused, lengths come from cu_seqlens_q)
  int seqlen_k;   // dense k rows per sequence
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int head_dim_v;
  int page_size;
  int num_pages;
  int max_pages;
  float softmax_scale;
  float softcap;      // 0: off
  int window_left;    // -1: unbounded
  int window_right;   // -1: unbounded; 0 when causal
};

}  // namespace jax_sgl
