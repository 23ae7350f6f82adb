// Attention sinks (FlashAttention-4 / FlashInfer semantics, as gpt-oss uses them): head h has a
// logit sinks[h] that joins every row's softmax denominator, not multiplied by softmax_scale, with
// no value vector. For a row whose scores (scaled, softcapped, masked) have log-sum-exp lse:
//   lse' = logaddexp(lse, sink)        the row's LSE, sink included (what kernels write)
//   O'   = O * exp(lse - lse')         = O / (1 + exp(sink - lse))
// A fully masked row (lse = -inf) keeps O = 0 and gets lse' = sink.
//
// Why finalization only: the sink is one more term of the denominator, so every kernel applies it
// where it already has the row's final LSE (after all key blocks, and after merging the splits of
// a split-KV call: never per split, which would count it once per split). The backward needs no
// change: with lse' saved, P = exp(s - lse') are the probabilities of the sinked softmax, and
// D = rowsum(dO * O') - dlse is still the right correction (the sink has no value vector).
//
// Plain C++14 without includes under Metal, as attention_geometry.h, so the CPU, CUDA and Metal
// kernels run this one function.
#pragma once

#include "ffi/common/attention_geometry.h"

#if defined(__METAL_VERSION__)
#define JAX_SGL_SINK_EXP metal::exp
#define JAX_SGL_SINK_LOG metal::log
#else
#include <math.h>
#define JAX_SGL_SINK_EXP expf
#define JAX_SGL_SINK_LOG logf
#endif

namespace jax_sgl {

struct SinkedRow {
  float scale;  // multiplies the row's normalized output
  float lse;    // the row's LSE with the sink
};

// lse: the row's LSE without the sink (-inf: fully masked). Computed around the larger of the two
// logits so neither exp overflows, and with no arithmetic on -inf.
JAX_SGL_GEOM SinkedRow ApplySink(float lse, float sink) {
  SinkedRow r;
  if (!(lse > -INFINITY)) {  // fully masked: O stays 0; only the sink is left in the softmax
    r.scale = 0.f;
    r.lse = sink;
    return r;
  }
  if (!(sink > -INFINITY)) {  // a -inf sink is no sink
    r.scale = 1.f;
    r.lse = lse;
    return r;
  }
  const float hi = lse > sink ? lse : sink;
  r.lse = hi + JAX_SGL_SINK_LOG(JAX_SGL_SINK_EXP(lse - hi) + JAX_SGL_SINK_EXP(sink - hi));
  r.scale = JAX_SGL_SINK_EXP(lse - r.lse);
  return r;
}

#if !defined(__METAL_VERSION__)
// The finalization of one row of q head `head` in the CPU and CUDA kernels: sinks == nullptr (no
// sinks, or a split-KV partial, whose combine applies the sink once) leaves the row as it is.
JAX_SGL_GEOM SinkedRow ApplySinkOf(const float* sinks, int head, float lse) {
  if (sinks == nullptr) {
    SinkedRow r;
    r.scale = 1.f;
    r.lse = lse;
    return r;
  }
  return ApplySink(lse, sinks[head]);
}
#endif

}  // namespace jax_sgl
