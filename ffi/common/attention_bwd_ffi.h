// The FFI signature of jax_sgl_attention_bwd, shared by the CPU and CUDA handlers. Operands are
// the forward's eleven (attention_ffi.h: same order, same empty-array convention for absent optional
// ones) followed by the forward's results and their cotangents; attributes are the forward's
// (AttentionAttrs). One way to fill AttentionBwdParams from them, with the shape checks every
// backend needs.
#pragma once

#include "ffi/common/attention_bwd_params.h"
#include "ffi/common/attention_ffi.h"

namespace jax_sgl {

inline bool SameDims(ffi::AnyBuffer::Dimensions a, ffi::AnyBuffer::Dimensions b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// Operands after the forward's eleven (page_table and descales must be [0]: paged KV and fp8 are
// forward-only): the forward's out, lse and their cotangents. Results: dq, dk, dv (as q, k, v).
constexpr size_t kAttentionBwdOperands = kAttentionOperands + 4;

// Fills *p, leaving p->softmax_d for the backend (its workspace).
inline ffi::Error MakeAttentionBwdParams(const ffi::RemainingArgs& args,
                                         const ffi::RemainingRets& rets,
                                         const AttentionAttrs& attrs, AttentionBwdParams* p) {
  if (attrs.kv_layout == int64_t(KvLayout::kPaged))
    return InvalidArgument(
        "jax_sgl.attention: gradients through paged KV are not supported");
  if (auto err = CheckCount("operands", args.size(), kAttentionBwdOperands); err.failure())
    return err;
  if (auto err = CheckCount("results", rets.size(), 3); err.failure()) return err;
  AttentionOperands o;
  if (auto err = DecodeAttentionOperands(args, &o); err.failure()) return err;
  std::optional<ffi::AnyBuffer> dout;
  std::optional<ffi::Buffer<ffi::F32>> dlse;
  std::optional<ffi::Result<ffi::AnyBuffer>> dq, dk, dv;
  ffi::Error errs[] = {
      GetOperand(args, kAttentionOperands + 0, "out", &o.out),
      GetOperand(args, kAttentionOperands + 1, "lse", &o.lse),
      GetOperand(args, kAttentionOperands + 2, "dout", &dout),
      GetOperand(args, kAttentionOperands + 3, "dlse", &dlse),
      GetResult(rets, 0, "dq", &dq),
      GetResult(rets, 1, "dk", &dk),
      GetResult(rets, 2, "dv", &dv),
  };
  for (ffi::Error& err : errs)
    if (err.failure()) return std::move(err);
  if (auto err = FillAttentionParams(o, attrs, &p->fwd); err.failure()) return err;
  const ffi::AnyBuffer& q = *o.q;
  const ffi::AnyBuffer& k = *o.k;
  const ffi::AnyBuffer& v = *o.v;
  const AttentionParams& f = p->fwd;
  if (f.q_type == DType::kF8E4M3 || f.q_type == DType::kF8E5M2 || f.v_type == DType::kF8E4M3 ||
      f.v_type == DType::kF8E5M2)
    return InvalidArgument("jax_sgl.attention: gradients through fp8 inputs are not supported");
  if (f.v_type != f.q_type || f.out_type != f.q_type)
    return InvalidArgument(std::string("Type mismatch: ") + DTypeName(f.q_type) + " != " +
                           DTypeName(f.v_type));
  if (!SameDims(dout->dimensions(), o.out->dimensions()) ||
      dout->element_type() != o.out->element_type())
    return InvalidArgument("jax_sgl.attention: dout must match out in shape and dtype");
  if (dlse->element_count() != o.lse->element_count())
    return InvalidArgument("jax_sgl.attention: dlse must match lse in shape");
  if (!SameDims((**dq).dimensions(), q.dimensions()) || (**dq).element_type() != q.element_type() ||
      !SameDims((**dk).dimensions(), k.dimensions()) || (**dk).element_type() != k.element_type() ||
      !SameDims((**dv).dimensions(), v.dimensions()) || (**dv).element_type() != v.element_type())
    return InvalidArgument("jax_sgl.attention: dq/dk/dv must match q/k/v in shape and dtype");
  p->dout = dout->untyped_data();
  p->dout_type = f.out_type;
  p->dlse = dlse->typed_data();
  p->dq = (**dq).untyped_data();
  p->dk = (**dk).untyped_data();
  p->dv = (**dv).untyped_data();
  p->softmax_d = nullptr;
  return ffi::Error::Success();
}

}  // namespace jax_sgl
