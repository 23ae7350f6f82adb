// The contract between the attention FFI handlers and their kernels (CPU, CUDA, Metal).
//
// One struct describes the three layouts:
//   q:   dense  [batch, seqlen_q, num_heads, head_dim]          (cu_seqlens_q == nullptr)
//        varlen [total_q, num_heads, head_dim] + cu_seqlens_q [batch + 1]
//   k/v: dense  [batch, seqlen_k, num_kv_heads, head_dim(_v)]   (kv_layout == kDense)
//        varlen [total_k, num_kv_heads, head_dim(_v)] + cu_seqlens_k [batch + 1]
//        paged  [num_pages, page_size, num_kv_heads, head_dim(_v)] + page_table [batch, max_pages]
//               (a token pool [num_slots, Hkv, D] is the page_size == 1 case)
//        fused  one buffer [num_pages, page_size, 2 * num_kv_heads, head_dim_pad] holding K and V
//               interleaved on the head axis (K0, V0, K1, V1, ...; sglang-jax's pool,
//               jax_sgl/_kv_buffer.py), paged: k points at it, v at its first V head
//   out: q's layout with head_dim_v; lse float32 dense [batch, num_heads, seqlen_q] or
//        varlen [num_heads, total_q], the sink included when sinks != nullptr.
// K/V element (row r, kv head h, feature e) is k[r * k_row_stride + h * k_head_stride + e] (V
// alike): every kernel addresses K and V only through these strides, which the handler sets for
// every layout (contiguous ones get Hkv * D and D), so a fused buffer takes the same code path.
// A row is one key: a dense/varlen row, or page * page_size + slot of a paged pool.
// Block-scaled q/k (qk_block_scale != kNone; SGLang's qk_blockscaled, the OCP MX format): feature
// e of a q (k) row is x[e] * scale[e / kQkScaleBlock], the scales laid out as q (k) with
// head_dim / kQkScaleBlock features per head, contiguous: q's [q row, num_heads, blocks], k's
// [key row, num_kv_heads, blocks] with key rows as K's (paged: page * page_size + slot, also for
// a fused buffer). q_descale and k_descale are then nullptr.
// Index arrays come from user data: kernels clamp every range to the buffers they were given and
// treat page-table entries outside [0, num_pages) as masked keys, so they never read out of bounds.
#pragma once

#include <cstdint>

#include "ffi/common/host_device.h"
#include "ffi/common/rope_pool_params.h"  // DType

namespace jax_sgl {

enum class KvLayout : int { kDense = 0, kVarlen = 1, kPaged = 2 };

// Storage of q/k block scales: none (per-head descales or none), float32, or e8m0 exponent bytes.
enum class BlockScaleType : int { kNone = 0, kF32 = 1, kE8M0 = 2 };
// Features per q/k block scale: the MX block size (jax_sgl/_checks.py QK_SCALE_BLOCK).
constexpr int kQkScaleBlock = 32;

// Bits of AttentionParams::disable: kernel families a user turned off for debugging
// (JAX_SGL_DISABLE, parsed by jax_sgl/_disable.py, which names the same bits). A disabled family's
// calls run on the portable kernels.
enum AttentionDisable : int64_t {
  kDisableSm90 = int64_t(1) << 0,        // "sm90": the Hopper forward
  kDisableSm90Varlen = int64_t(1) << 1,  // "sm90_varlen": the Hopper forward's varlen/paged path
  kDisableSm90Bwd = int64_t(1) << 2,     // "sm90_bwd": the Hopper backward
  kDisableSm100 = int64_t(1) << 3,       // "sm100": the Blackwell forward
  kDisableSm100Bwd = int64_t(1) << 4,    // "sm100_bwd": the Blackwell backward (1 << 3: "sm100")
};

// A per-head descale, element (b, kv head) at data[b * batch_stride + kv_head * head_stride]: one
// per (batch, kv head) ([B, Hkv]: Hkv, 1), per kv head ([Hkv]: 0, 1) or per tensor ([1]: 0, 0).
// The zero strides let the [Hkv] and per-tensor scales a KV cache keeps (rope_pool_fused's k_scale
// / v_scale) reach the kernels as they are: a [B, Hkv] copy costs XLA two broadcast kernels a call.
struct HeadDescale {
  const float* data;  // nullptr: none (a factor of 1)
  int batch_stride;
  int head_stride;
  JAX_SGL_HD explicit operator bool() const { return data != nullptr; }
  JAX_SGL_HD float At(int b, int kv_head) const {
    return data ? data[int64_t(b) * batch_stride + kv_head * head_stride] : 1.0f;
  }
};

struct AttentionParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;

  const int32_t* cu_seqlens_q;  // [batch + 1] or nullptr (dense q)
  const int32_t* cu_seqlens_k;  // [batch + 1], kv_layout == kVarlen
  const int32_t* seqused_k;     // [batch] or nullptr: keys actually used per sequence
  const int32_t* page_table;    // [batch, max_pages], kv_layout == kPaged
  HeadDescale q_descale;        // fp8 q only
  HeadDescale k_descale;        // fp8 k (or an fp8 KV cache)
  HeadDescale v_descale;        // fp8 v
  const float* sinks;           // [num_heads] or nullptr: per-head sink logit (attention_sink.h)
  const void* q_block_scale;    // [q rows, num_heads, head_dim / 32] or nullptr (see above)
  const void* k_block_scale;    // [key rows, num_kv_heads, head_dim / 32] or nullptr
  BlockScaleType qk_block_scale;  // the two's storage; kNone: no block scales

  KvLayout kv_layout;
  int batch;
  int seqlen_q;   // dense q: rows per sequence; varlen: max rows per sequence (a bound, clamped)
  int seqlen_k;   // dense k: keys per sequence
  int64_t total_q;  // rows of q in the buffer (batch * seqlen_q when dense)
  int64_t total_k;  // rows of k/v in the buffer (dense: batch * seqlen_k; paged: num_pages * page_size)
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int head_dim_v;
  int page_size;   // paged only
  int64_t k_row_stride;   // elements from key row r to r + 1 of k
  int64_t k_head_stride;  // elements from kv head h to h + 1 of k
  int64_t v_row_stride;   // as k's, for v
  int64_t v_head_stride;
  int num_pages;   // paged only
  int max_pages;   // paged only: page_table row length

  float softmax_scale;
  float softcap;     // 0: off; else s = softcap * tanh(s / softcap) on scaled scores
  bool causal;       // bottom-right aligned
  int window_left;   // -1: unbounded
  int window_right;  // -1: unbounded (causal forces 0)
  bool deterministic;  // backward: bitwise reproducible dQ (no float atomics)
  int64_t disable;     // AttentionDisable bits

  DType q_type;
  DType k_type;
  DType v_type;
  DType out_type;
};

// K/V strides of contiguous k and v: rows of num_kv_heads heads of head_dim (head_dim_v) features.
inline void SetContiguousKvStrides(AttentionParams* p) {
  p->k_row_stride = int64_t(p->num_kv_heads) * p->head_dim;
  p->k_head_stride = p->head_dim;
  p->v_row_stride = int64_t(p->num_kv_heads) * p->head_dim_v;
  p->v_head_stride = p->head_dim_v;
}

// k (already pointing at the buffer) and v as views of one fused buffer [P, page, heads_x2,
// d_pad]: K head h at 2h, V head h at 2h + 1 of each row, head_dim features read of d_pad
// (jax_sgl/_kv_buffer.py names this layout). Sets num_kv_heads, head_dim_v and the strides.
inline void SetFusedKvBuffer(AttentionParams* p, int64_t heads_x2, int64_t d_pad,
                             size_t elem_bytes) {
  p->num_kv_heads = int(heads_x2 / 2);
  p->head_dim_v = p->head_dim;
  p->k_row_stride = p->v_row_stride = heads_x2 * d_pad;
  p->k_head_stride = p->v_head_stride = 2 * d_pad;
  p->v = static_cast<const char*>(p->k) + d_pad * int64_t(elem_bytes);
}

// jax_sgl's fp8 KV cache: float32/16-bit q over e4m3 k and v (the pool rope_pool_fused writes),
// dequantized as stored * k_descale / v_descale; out in q's type.
inline bool Fp8KvCacheTypes(const AttentionParams& p) {
  return (p.q_type == DType::kF32 || p.q_type == DType::kBF16 || p.q_type == DType::kF16) &&
         p.k_type == DType::kF8E4M3 && p.v_type == DType::kF8E4M3;
}

// A sliding window beyond what causal itself sets (causal forces window_right = 0).
inline bool HasSlidingWindow(const AttentionParams& p) {
  return p.window_left >= 0 || (!p.causal && p.window_right >= 0);
}

// q is float16 or bfloat16 and k, v and out share its type: what every CUDA kernel computes.
inline bool HalfPrecisionOperands(const AttentionParams& p) {
  return (p.q_type == DType::kBF16 || p.q_type == DType::kF16) && p.k_type == p.q_type &&
         p.v_type == p.q_type && p.out_type == p.q_type;
}

}  // namespace jax_sgl
