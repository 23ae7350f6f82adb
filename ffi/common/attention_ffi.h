// The FFI signature of jax_sgl_attention_fwd, shared by the CPU and CUDA handlers: operands,
// results and attributes in one order, and one way to fill AttentionParams from them.
// Absent optional operands arrive as empty int32/float32 arrays (the Python layer passes them).
#pragma once

#include "ffi/common/attention_params.h"
#include "ffi/common/ffi_helpers.h"

namespace jax_sgl {

// The ten operands every attention target (forward and backward) starts with.
template <typename Binding>
auto BindAttentionOperands(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()           // q: [B, Sq, H, D] or [total_q, H, D]
      .template Arg<ffi::AnyBuffer>()           // k: [B, Sk, Hkv, D], [total_k, Hkv, D] or [P, page, Hkv, D]
      .template Arg<ffi::AnyBuffer>()           // v: as k, with head_dim_v
      .template Arg<ffi::Buffer<ffi::S32>>()    // cu_seqlens_q [B + 1] or [0]
      .template Arg<ffi::Buffer<ffi::S32>>()    // cu_seqlens_k [B + 1] or [0]
      .template Arg<ffi::Buffer<ffi::S32>>()    // seqused_k [B] or [0]
      .template Arg<ffi::Buffer<ffi::S32>>()    // page_table [B, max_pages] or [0]
      .template Arg<ffi::Buffer<ffi::F32>>()    // q_descale [B, Hkv] or [0]
      .template Arg<ffi::Buffer<ffi::F32>>()    // k_descale [B, Hkv] or [0]
      .template Arg<ffi::Buffer<ffi::F32>>();   // v_descale [B, Hkv] or [0]
}

// The attributes every attention target ends with.
template <typename Binding>
auto BindAttentionAttrs(Binding&& binding) {
  return std::move(binding)
      .template Attr<int64_t>("kv_layout")
      .template Attr<bool>("varlen_q")
      .template Attr<int64_t>("batch")
      .template Attr<int64_t>("max_seqlen_q")
      .template Attr<float>("softmax_scale")
      .template Attr<float>("softcap")
      .template Attr<bool>("causal")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right");
}

template <typename Binding>
auto BindAttentionFwd(Binding&& binding) {
  return BindAttentionAttrs(BindAttentionOperands(std::move(binding))
                                .template Ret<ffi::AnyBuffer>()            // out: q's layout, head_dim_v
                                .template Ret<ffi::Buffer<ffi::F32>>());  // lse: [B, H, Sq] or [H, total_q]
}

inline ffi::Error MakeAttentionParams(
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> cu_seqlens_q,
    ffi::Buffer<ffi::S32> cu_seqlens_k, ffi::Buffer<ffi::S32> seqused_k,
    ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::F32> q_descale,
    ffi::Buffer<ffi::F32> k_descale, ffi::Buffer<ffi::F32> v_descale,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse, int64_t kv_layout,
    bool varlen_q, int64_t batch, int64_t max_seqlen_q, float softmax_scale, float softcap,
    bool causal, int64_t window_left, int64_t window_right, AttentionParams* p) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto vd = v.dimensions();
  if (kv_layout < 0 || kv_layout > 2)
    return InvalidArgument("jax_sgl.attention: unknown kv_layout");
  const auto layout = static_cast<KvLayout>(kv_layout);
  const size_t q_rank = varlen_q ? 3 : 4;
  const size_t kv_rank = layout == KvLayout::kVarlen ? 3 : 4;
  if (qd.size() != q_rank || kd.size() != kv_rank || vd.size() != kv_rank)
    return InvalidArgument("jax_sgl.attention: operand ranks do not match the layout");
  if (!ToDType(q.element_type(), &p->q_type) || !ToDType(k.element_type(), &p->k_type) ||
      !ToDType(v.element_type(), &p->v_type) || !ToDType(out->element_type(), &p->out_type))
    return InvalidArgument("jax_sgl.attention: unsupported dtype");
  // SGLang's rule (flash_fwd_sm100): K shares Q's dtype; V may differ only as the fp8 v_dequant
  // path, which the Python checks gate on v_descale.
  if (p->k_type != p->q_type)
    return InvalidArgument(std::string("Type mismatch: ") + DTypeName(p->q_type) + " != " +
                           DTypeName(p->k_type));

  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->out = out->untyped_data();
  p->lse = lse->typed_data();
  p->kv_layout = layout;
  p->batch = int(batch);
  p->num_heads = int(qd[q_rank - 2]);
  p->head_dim = int(qd[q_rank - 1]);
  p->num_kv_heads = int(kd[kv_rank - 2]);
  p->head_dim_v = int(vd[kv_rank - 1]);
  if (p->num_kv_heads <= 0 || p->num_heads % p->num_kv_heads != 0)
    return InvalidArgument("jax_sgl.attention: num_heads must be a multiple of num_kv_heads");
  p->total_q = varlen_q ? qd[0] : qd[0] * qd[1];
  p->seqlen_q = int(varlen_q ? max_seqlen_q : qd[1]);
  p->cu_seqlens_q = varlen_q ? cu_seqlens_q.typed_data() : nullptr;
  if (varlen_q && int64_t(cu_seqlens_q.element_count()) != batch + 1)
    return InvalidArgument("jax_sgl.attention: cu_seqlens_q must have batch + 1 entries");

  p->cu_seqlens_k = nullptr;
  p->page_table = nullptr;
  p->page_size = p->num_pages = p->max_pages = 0;
  p->seqlen_k = 0;
  switch (layout) {
    case KvLayout::kDense:
      if (kd[0] != batch || vd[0] != batch || vd[1] != kd[1])
        return InvalidArgument("jax_sgl.attention: dense k/v must be [batch, seqlen_k, Hkv, D]");
      p->seqlen_k = int(kd[1]);
      p->total_k = kd[0] * kd[1];
      break;
    case KvLayout::kVarlen:
      if (int64_t(cu_seqlens_k.element_count()) != batch + 1 || vd[0] != kd[0])
        return InvalidArgument("jax_sgl.attention: cu_seqlens_k must have batch + 1 entries");
      p->cu_seqlens_k = cu_seqlens_k.typed_data();
      p->total_k = kd[0];
      break;
    case KvLayout::kPaged: {
      auto pt = page_table.dimensions();
      if (pt.size() != 2 || pt[0] != batch || vd[0] != kd[0] || vd[1] != kd[1])
        return InvalidArgument("jax_sgl.attention: page_table must be [batch, max_pages]");
      p->page_table = page_table.typed_data();
      p->num_pages = int(kd[0]);
      p->page_size = int(kd[1]);
      p->max_pages = int(pt[1]);
      p->total_k = kd[0] * kd[1];
      break;
    }
  }
  p->seqused_k = seqused_k.element_count() > 0 ? seqused_k.typed_data() : nullptr;
  if (p->seqused_k && int64_t(seqused_k.element_count()) != batch)
    return InvalidArgument("jax_sgl.attention: seqused_k must have batch entries");
  const int64_t descale_size = batch * p->num_kv_heads;
  auto descale = [&](ffi::Buffer<ffi::F32> d) -> const float* {
    return int64_t(d.element_count()) == descale_size && descale_size > 0 ? d.typed_data()
                                                                          : nullptr;
  };
  p->q_descale = descale(q_descale);
  p->k_descale = descale(k_descale);
  p->v_descale = descale(v_descale);

  p->softmax_scale = softmax_scale;
  p->softcap = softcap;
  p->causal = causal;
  p->window_left = int(window_left);
  p->window_right = causal ? 0 : int(window_right);
  return ffi::Error::Success();
}

}  // namespace jax_sgl
