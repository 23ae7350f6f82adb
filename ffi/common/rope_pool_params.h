// The contract between the rope_pool_fused FFI handlers and their kernels (CPU, CUDA, Metal).
// All tensors are row-major and contiguous; the handler fills this from the bound buffers.
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
  void* q_rot;            // [num_tokens, num_qo_heads, head_dim]
  void* k_rot;            // [num_tokens, num_kv_heads, head_dim]
  void* k_pool;           // [num_slots, num_kv_heads, head_dim], aliased with the input pool
  void* v_pool;           // [num_slots, num_kv_heads, head_dim], aliased with the input pool

  int64_t num_tokens;
  int64_t num_slots;
  int num_qo_heads;
  int num_kv_heads;
  int head_dim;
  int rotary_dim;   // even, <= head_dim; features [rotary_dim, head_dim) are copied unrotated
  bool is_neox;     // true: pairs (i, i + rotary_dim/2); false: pairs (2i, 2i+1)
  double log2_base;  // log2(rope_base), in double: see rope_math.h
  DType dtype;      // of q, k, v and both pools
  IndexType index_type;
};

}  // namespace jax_sgl
