// The contract between the attention backward FFI handlers and their kernels (CPU, CUDA).
//
// The backward sees the forward's whole problem (AttentionParams: q, k, v, out, lse, layouts,
// masks) plus the cotangents and the gradients, all in the forward's layouts:
//   dout:  out's layout and dtype                 (cotangent of out)
//   dlse:  lse's layout, float32                  (cotangent of lse; zeros when lse is unused)
//   dq/dk/dv: q's / k's / v's layout and dtype   (the results, accumulated in float32)
//   softmax_d: lse's layout, float32 workspace:   D = rowsum(dO * O) - dlse
// With D so defined, dS = P * (dP - D) is the gradient of the (softcapped, scaled) scores for a
// loss that depends on out and lse, because d lse_i / d s_ij = P_ij.
// Paged KV and fp8 inputs are forward-only: the handlers reject them.
#pragma once

#include <cstdint>

#include "ffi/common/attention_params.h"
#include "ffi/common/attention_seq.h"
#include "ffi/common/host_device.h"

namespace jax_sgl {

struct AttentionBwdParams {
  AttentionParams fwd;  // fwd.out and fwd.lse are read, never written

  const void* dout;   // out's layout, dout_type
  const float* dlse;  // lse's layout
  void* dq;           // q's layout and dtype
  void* dk;           // k's layout and dtype
  void* dv;           // v's layout and dtype
  float* softmax_d;   // lse's layout: workspace the handler provides

  DType dout_type;
};

// Index of (sequence b, head h, row i of that sequence) in an lse-shaped buffer:
// dense [batch, num_heads, seqlen_q], varlen [num_heads, total_q].
JAX_SGL_HD int64_t LseIndex(const AttentionParams& p, const SeqBounds& s, int b, int h, int i) {
  return p.cu_seqlens_q ? int64_t(h) * p.total_q + s.lse_row0 + i
                        : (int64_t(b) * p.num_heads + h) * p.seqlen_q + i;
}

}  // namespace jax_sgl
