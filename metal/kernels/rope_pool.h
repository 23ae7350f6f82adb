// rope_pool_fused for Metal: rotates q and k of each token (NeoX or interleaved pairs over the
// first rotary_dim features, the rest copied) and writes rotated k and plain v into the pools at
// the token's slot, through the pool strides (separate pools or one fused kv_buffer). Same contract
// as ffi/cpu/rope_pool.cc: a slot < 0 (padding) or >= num_slots is never written. One threadgroup walks tokens (grid-stride); its threads split the token's
// (head, pair) work, so every element is one independent load-rotate-store with no barriers.
#pragma once

#include "ffi/common/rope_math.h"
#include "metal/kernels/utils.h"

namespace jax_sgl {
namespace metal_kernels {

template <typename T, typename I>
void rope_pool_impl(const device T* q, const device T* k, const device T* v,
                    const device I* positions, const device I* slots, device T* q_rot,
                    device T* k_rot, device T* k_pool, device T* v_pool,
                    const device float* inv_freq, constant MetalRopePoolParams& p,
                    uint first_token, uint token_step, uint tid) {
  const int half_rd = p.rotary_dim / 2;
  const int heads = p.num_qo_heads + p.num_kv_heads;
  const int tail = p.head_dim - p.rotary_dim;
  const long kv_row = long(p.num_kv_heads) * p.head_dim;
  device T* v_dst = (p.v_in_k_pool != 0 ? k_pool : v_pool) + p.v_offset;
  for (long t = first_token; t < p.num_tokens; t += token_step) {
    const float pos = float(positions[t]);
    const long slot = long(slots[t]);
    const bool write = slot >= 0 && slot < p.num_slots;
    const long pool_row = write ? slot * p.pool_row_stride : 0;
    // Heads [0, Hq) are q's, [Hq, Hq + Hkv) k's.
    for (int w = int(tid); w < heads * half_rd; w += kRopePoolThreads) {
      const int h = w / half_rd, i = w % half_rd;
      int a, b;
      RopePair(i, p.rotary_dim, p.is_neox != 0, &a, &b);
      const float angle = pos * inv_freq[i];
      const float c = metal::precise::cos(angle), s = metal::precise::sin(angle);
      const bool is_q = h < p.num_qo_heads;
      const long off = is_q ? (t * p.num_qo_heads + h) * p.head_dim
                            : t * kv_row + long(h - p.num_qo_heads) * p.head_dim;
      const device T* x = is_q ? q + off : k + off;
      device T* y = is_q ? q_rot + off : k_rot + off;
      const float xa = LoadF(x[a]), xb = LoadF(x[b]);
      const T ya = StoreF<T>(xa * c - xb * s), yb = StoreF<T>(xb * c + xa * s);
      y[a] = ya;
      y[b] = yb;
      if (!is_q && write) {
        device T* dst = k_pool + pool_row + long(h - p.num_qo_heads) * p.pool_head_stride;
        dst[a] = ya;
        dst[b] = yb;
      }
    }
    for (int w = int(tid); w < heads * tail; w += kRopePoolThreads) {
      const int h = w / tail, e = p.rotary_dim + w % tail;
      if (h < p.num_qo_heads) {
        const long off = (t * p.num_qo_heads + h) * p.head_dim + e;
        q_rot[off] = q[off];
      } else {
        const long hk = h - p.num_qo_heads, off = t * kv_row + hk * p.head_dim + e;
        k_rot[off] = k[off];
        if (write) k_pool[pool_row + hk * p.pool_head_stride + e] = k[off];
      }
    }
    if (write)
      for (long w = tid; w < kv_row; w += kRopePoolThreads)
        v_dst[pool_row + (w / p.head_dim) * p.pool_head_stride + w % p.head_dim] = v[t * kv_row + w];
  }
}

}  // namespace metal_kernels
}  // namespace jax_sgl
