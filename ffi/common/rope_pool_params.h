// The contract between the rope_pool_fused FFI handlers and their kernels (CPU, CUDA, Metal).
// q/k/v and their outputs are row-major and contiguous. The pools are read through strides, so one
// kernel serves both pool layouts the handler accepts:
//   separate pools  k_pool, v_pool [num_slots, Hkv, D]: row stride Hkv * D, head stride D;
//   fused kv_buffer one buffer [num_slots, 2 * Hkv, Dp] (sglang-jax's pool, K and V interleaved on
//                   the head axis, Dp >= D): row stride 2 * Hkv * Dp, head stride 2 * Dp, and
//                   v_pool = k_pool + Dp. Features D..Dp of each head are never touched.
// An fp8 pool (pool_dtype kF8E4M3, q/k/v in `dtype`): the pool holds e4m3(x / scale) of rotated k
// and v (FromFloatE4m3: round to nearest even, saturating at +-448), one scale per KV head; read
// back as stored * scale, the same float32 arrays attention takes as k_descale / v_descale.
#pragma once

#include <cstdint>

namespace jax_sgl {

enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kF8E4M3 = 3, kF8E5M2 = 4 };
enum class IndexType : int { kI32 = 0, kI64 = 1 };

struct RopePoolParams {
  const void* q;          // [num_tokens, num_qo_heads, head_dim]
  const void* k;          // [num_tokens, num_kv_heads, head_dim]
  const void* v;          // [num_tokens, num_kv_heads, head_dim]
  const void* positions;  // [num_tokens], int32 or int64 (index_type)
  const void* slots;      // [num_tokens], int32 or int64; < 0 = padding, >= num_slots = dropped
  const float* inv_freq;  // [rotary_dim / 2]: angle_i = float(position) * inv_freq[i] (rope_math.h)
  void* q_rot;            // [num_tokens, num_qo_heads, head_dim]
  void* k_rot;            // [num_tokens, num_kv_heads, head_dim]
  // K of (slot s, KV head h) starts at k_pool + s * pool_row_stride + h * pool_head_stride, V at
  // the same offset from v_pool. The pools are aliased with the input pools.
  void* k_pool;
  void* v_pool;
  // fp8 pool only (else nullptr): float32 [num_kv_heads] each, the quantization scales.
  const float* k_scale;
  const float* v_scale;

  int64_t num_tokens;
  int64_t num_slots;
  int64_t pool_row_stride;   // elements from slot s to slot s + 1
  int64_t pool_head_stride;  // elements from KV head h to h + 1 within a slot
  int num_qo_heads;
  int num_kv_heads;
  int head_dim;
  int rotary_dim;   // even, <= head_dim; features [rotary_dim, head_dim) are copied unrotated
  bool is_neox;     // true: pairs (i, i + rotary_dim/2); false: pairs (2i, 2i+1)
  DType dtype;      // of q, k, v (and of the pools unless they are fp8)
  DType pool_dtype; // dtype, or kF8E4M3 with k_scale / v_scale
  IndexType index_type;
};

// The two pool layouts, written once for the FFI handlers and the Metal emulator. Both need
// num_kv_heads and head_dim set first.
inline void SetSeparatePools(RopePoolParams* p, void* k_pool, void* v_pool, int64_t num_slots) {
  p->k_pool = k_pool;
  p->v_pool = v_pool;
  p->num_slots = num_slots;
  p->pool_head_stride = p->head_dim;
  p->pool_row_stride = int64_t(p->num_kv_heads) * p->head_dim;
}

// A fused kv_buffer of `elements` elements of `element_bytes` bytes, rows of head_dim_pad.
inline void SetFusedPool(RopePoolParams* p, void* kv_buffer, int64_t elements,
                         int64_t head_dim_pad, int64_t element_bytes) {
  p->k_pool = kv_buffer;
  p->v_pool = static_cast<char*>(kv_buffer) + head_dim_pad * element_bytes;  // V h after K h
  p->pool_head_stride = 2 * head_dim_pad;
  p->pool_row_stride = 2 * int64_t(p->num_kv_heads) * head_dim_pad;
  p->num_slots = elements / p->pool_row_stride;
}

}  // namespace jax_sgl
