// The FFI signature of jax_sgl_attention_bwd, shared by the CPU and CUDA handlers. Operands are
// the forward's ten (same order, same empty-array convention for absent optional ones) followed by
// the forward's results and their cotangents; attributes are the forward's. One way to fill
// AttentionBwdParams from them, with the shape checks every backend needs.
#pragma once

#include "ffi/common/attention_bwd_params.h"
#include "ffi/common/attention_ffi.h"

namespace jax_sgl {

// The forward's operands (page_table and descales must be [0]: paged KV and fp8 are forward-only),
// then the forward's results and their cotangents.
template <typename Binding>
auto BindAttentionBwd(Binding&& binding) {
  return BindAttentionAttrs(BindAttentionOperands(std::move(binding))
                                .template Arg<ffi::AnyBuffer>()          // out: the forward's
                                .template Arg<ffi::Buffer<ffi::F32>>()   // lse: the forward's
                                .template Arg<ffi::AnyBuffer>()          // dout: as out
                                .template Arg<ffi::Buffer<ffi::F32>>()   // dlse: as lse
                                .template Ret<ffi::AnyBuffer>()          // dq: as q
                                .template Ret<ffi::AnyBuffer>()          // dk: as k
                                .template Ret<ffi::AnyBuffer>());        // dv: as v
}

inline bool SameDims(ffi::AnyBuffer::Dimensions a, ffi::AnyBuffer::Dimensions b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// Fills *p, leaving p->softmax_d for the backend (its workspace).
inline ffi::Error MakeAttentionBwdParams(
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> cu_seqlens_q,
    ffi::Buffer<ffi::S32> cu_seqlens_k, ffi::Buffer<ffi::S32> seqused_k,
    ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::F32> q_descale,
    ffi::Buffer<ffi::F32> k_descale, ffi::Buffer<ffi::F32> v_descale, ffi::AnyBuffer out,
    ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> dlse,
    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
    ffi::Result<ffi::AnyBuffer> dv, int64_t kv_layout, bool varlen_q, int64_t batch,
    int64_t max_seqlen_q, float softmax_scale, float softcap, bool causal, int64_t window_left,
    int64_t window_right, AttentionBwdParams* p) {
  if (kv_layout == int64_t(KvLayout::kPaged))
    return InvalidArgument(
        "jax_sgl.attention: gradients through paged KV are not supported");
  // The forward's parser reads out/lse through Result<>; here they are inputs.
  if (auto err = MakeAttentionParams(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
                                     q_descale, k_descale, v_descale, out, lse, kv_layout,
                                     varlen_q, batch, max_seqlen_q, softmax_scale, softcap,
                                     causal, window_left, window_right, &p->fwd);
      err.failure())
    return err;
  const AttentionParams& f = p->fwd;
  if (f.q_type == DType::kF8E4M3 || f.q_type == DType::kF8E5M2 || f.v_type == DType::kF8E4M3 ||
      f.v_type == DType::kF8E5M2)
    return InvalidArgument("jax_sgl.attention: gradients through fp8 inputs are not supported");
  if (f.v_type != f.q_type || f.out_type != f.q_type)
    return InvalidArgument(std::string("Type mismatch: ") + DTypeName(f.q_type) + " != " +
                           DTypeName(f.v_type));
  if (!SameDims(dout.dimensions(), out.dimensions()) || dout.element_type() != out.element_type())
    return InvalidArgument("jax_sgl.attention: dout must match out in shape and dtype");
  if (dlse.element_count() != lse.element_count())
    return InvalidArgument("jax_sgl.attention: dlse must match lse in shape");
  if (!SameDims(dq->dimensions(), q.dimensions()) || dq->element_type() != q.element_type() ||
      !SameDims(dk->dimensions(), k.dimensions()) || dk->element_type() != k.element_type() ||
      !SameDims(dv->dimensions(), v.dimensions()) || dv->element_type() != v.element_type())
    return InvalidArgument("jax_sgl.attention: dq/dk/dv must match q/k/v in shape and dtype");
  p->dout = dout.untyped_data();
  p->dout_type = f.out_type;
  p->dlse = dlse.typed_data();
  p->dq = dq->untyped_data();
  p->dk = dk->untyped_data();
  p->dv = dv->untyped_data();
  p->softmax_d = nullptr;
  return ffi::Error::Success();
}

}  // namespace jax_sgl
