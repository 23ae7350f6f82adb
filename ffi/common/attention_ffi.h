// The FFI signature of jax_sgl_attention_fwd and _bwd, shared by the CPU, CUDA and Metal handlers:
// the attributes as one struct (AttentionAttrs, decoded by XLA FFI), the operands bound as
// RemainingArgs / RemainingRets and decoded here, by index, in one place.
//
// Operands, in this order (absent optional ones arrive as empty int32/float32 arrays, which the
// Python layer passes):
//   0 q             [B, Sq, H, D] or [total_q, H, D]
//   1 k             [B, Sk, Hkv, D], [total_k, Hkv, D], [P, page, Hkv, D] or [slots, Hkv, D]
//   2 v             as k, with head_dim_v; with the kv_buffer attribute k and v are both the
//                   fused buffer [P, page, 2 * Hkv, head_dim_pad] (one array bound twice: the
//                   signature stays that of every layout, and XLA passes the same pointer)
//   3 cu_seqlens_q  int32 [B + 1] or [0]
//   4 cu_seqlens_k  int32 [B + 1] or [0]
//   5 seqused_k     int32 [B] or [0]
//   6 page_table    int32 [B, max_pages] or [0]
//   7 q_descale     float32 [B, Hkv], [Hkv], [1] or [0] (HeadDescale); with the qk_blockscaled
//                   attribute q's block scales, q's shape with head_dim / 32 last, float32 or
//                   float8_e8m0fnu
//   8 k_descale     float32 as q_descale; with qk_blockscaled k's block scales (k's shape, or
//                   a fused buffer's K view, with head_dim / 32 last), q_descale's dtype
//   9 v_descale     float32 as q_descale
//  10 sinks         float32 [H] or [0]
// Forward results: out (q's layout, head_dim_v), lse float32 [B, H, Sq] or [H, total_q].
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <tuple>

#include "ffi/common/attention_params.h"
#include "ffi/common/ffi_helpers.h"

namespace jax_sgl {

// Every attribute of an attention call, forward and backward alike (jax_sgl/attention.py
// _ffi_attrs builds them once). XLA FFI decodes the call's whole attribute dictionary into it, so
// the names here and there must be the same set. One list, X(type, name), gives the struct, its
// decoding (the end of this file) and module.cc's plan dictionary, in one order (XLA's struct
// decoding builds the struct from the members in the order listed).
#define JAX_SGL_ATTENTION_ATTRS(X)                                                             \
  X(int64_t, kv_layout)     /* KvLayout */                                                     \
  X(bool, varlen_q)         /* q is [total_q, H, D] with cu_seqlens_q */                       \
  X(int64_t, batch)                                                                            \
  X(int64_t, max_seqlen_q)  /* varlen q: a bound on rows per sequence */                       \
  X(float, softmax_scale)                                                                      \
  X(float, softcap)                                                                            \
  X(bool, causal)                                                                              \
  X(int64_t, window_left)                                                                      \
  X(int64_t, window_right)                                                                     \
  X(bool, deterministic)    /* backward: bitwise reproducible dQ */                            \
  X(int64_t, disable)       /* AttentionDisable bits */                                        \
  X(bool, kv_buffer)        /* k and v are one fused buffer [P, page, 2 * Hkv, head_dim_pad] */ \
  X(bool, qk_blockscaled)   /* q_descale / k_descale are block scales (AttentionParams says how) */

struct AttentionAttrs {
#define JAX_SGL_ATTR_MEMBER(T, NAME) T NAME;
  JAX_SGL_ATTENTION_ATTRS(JAX_SGL_ATTR_MEMBER)
#undef JAX_SGL_ATTR_MEMBER
};

constexpr size_t kAttentionOperands = 11;

template <typename T>
ffi::Error GetOperand(const ffi::RemainingArgs& args, size_t index, const char* name,
                      std::optional<T>* out) {
  return GetIndexed<T>("jax_sgl.attention", args, "operand", index, name, out);
}

template <typename T>
ffi::Error GetResult(const ffi::RemainingRets& rets, size_t index, const char* name,
                     std::optional<ffi::Result<T>>* out) {
  return GetIndexed<T>("jax_sgl.attention", rets, "result", index, name, out);
}

inline ffi::Error CheckCount(const char* what, size_t got, size_t expected) {
  if (got == expected) return ffi::Error::Success();
  return InvalidArgument(std::string("jax_sgl.attention: expected ") + std::to_string(expected) +
                         " " + what + ", got " + std::to_string(got));
}

// The eleven operands every attention target starts with, decoded.
struct AttentionOperands {
  std::optional<ffi::AnyBuffer> q, k, v;
  std::optional<ffi::Buffer<ffi::S32>> cu_seqlens_q, cu_seqlens_k, seqused_k, page_table;
  std::optional<ffi::AnyBuffer> q_descale, k_descale;  // float32, or e8m0 block scales
  std::optional<ffi::Buffer<ffi::F32>> v_descale, sinks;
  // The forward's out and lse: its results, the backward's inputs.
  std::optional<ffi::AnyBuffer> out;
  std::optional<ffi::Buffer<ffi::F32>> lse;
};

inline ffi::Error DecodeAttentionOperands(const ffi::RemainingArgs& args, AttentionOperands* o) {
  ffi::Error errs[] = {
      GetOperand(args, 0, "q", &o->q),
      GetOperand(args, 1, "k", &o->k),
      GetOperand(args, 2, "v", &o->v),
      GetOperand(args, 3, "cu_seqlens_q", &o->cu_seqlens_q),
      GetOperand(args, 4, "cu_seqlens_k", &o->cu_seqlens_k),
      GetOperand(args, 5, "seqused_k", &o->seqused_k),
      GetOperand(args, 6, "page_table", &o->page_table),
      GetOperand(args, 7, "q_descale", &o->q_descale),
      GetOperand(args, 8, "k_descale", &o->k_descale),
      GetOperand(args, 9, "v_descale", &o->v_descale),
      GetOperand(args, 10, "sinks", &o->sinks),
  };
  for (ffi::Error& err : errs)
    if (err.failure()) return std::move(err);
  return ffi::Error::Success();
}

// q's and k's block scales (qk_blockscaled) into *p, whose geometry is set: one scale per
// kQkScaleBlock features of every q row and every key row, in one storage type.
inline ffi::Error SetBlockScales(const ffi::AnyBuffer& sq, const ffi::AnyBuffer& sk,
                                 AttentionParams* p) {
  const ffi::DataType t = sq.element_type();
  if (sk.element_type() != t || (t != ffi::DataType::F32 && t != ffi::DataType::F8E8M0FNU))
    return InvalidArgument("jax_sgl.attention: q_descale/k_descale block scales must both be "
                           "float32 or both float8_e8m0fnu");
  if (p->q_type != DType::kF8E4M3 || p->head_dim % kQkScaleBlock != 0)
    return InvalidArgument("jax_sgl.attention: block-scaled q/k must be float8_e4m3fn with "
                           "head_dim a multiple of 32");
  const int64_t blocks = p->head_dim / kQkScaleBlock;
  if (int64_t(sq.element_count()) != p->total_q * p->num_heads * blocks ||
      int64_t(sk.element_count()) != p->total_k * p->num_kv_heads * blocks)
    return InvalidArgument("jax_sgl.attention: q_descale/k_descale block scales must have q's "
                           "and k's rows and heads with head_dim / 32 scales each");
  p->q_block_scale = sq.untyped_data();
  p->k_block_scale = sk.untyped_data();
  p->qk_block_scale = t == ffi::DataType::F32 ? BlockScaleType::kF32 : BlockScaleType::kE8M0;
  return ffi::Error::Success();
}

// Fills *p from the decoded operands (out and lse included) and the attributes.
inline ffi::Error FillAttentionParams(const AttentionOperands& o, const AttentionAttrs& attrs,
                                      AttentionParams* p) {
  const ffi::AnyBuffer& out = *o.out;
  const ffi::Buffer<ffi::F32>& lse = *o.lse;
  const ffi::AnyBuffer& q = *o.q;
  const ffi::AnyBuffer& k = *o.k;
  const ffi::AnyBuffer& v = *o.v;
  const ffi::Buffer<ffi::S32>& cu_seqlens_q = *o.cu_seqlens_q;
  const ffi::Buffer<ffi::S32>& cu_seqlens_k = *o.cu_seqlens_k;
  const ffi::Buffer<ffi::S32>& seqused_k = *o.seqused_k;
  const ffi::Buffer<ffi::S32>& page_table = *o.page_table;
  const int64_t kv_layout = attrs.kv_layout;
  const bool varlen_q = attrs.varlen_q;
  const int64_t batch = attrs.batch;
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto vd = v.dimensions();
  if (kv_layout < 0 || kv_layout > 2)
    return InvalidArgument("jax_sgl.attention: unknown kv_layout");
  const auto layout = static_cast<KvLayout>(kv_layout);
  const size_t q_rank = varlen_q ? 3 : 4;
  // Paged k/v may be a token pool [num_slots, Hkv, D] (page size 1), passed at its own rank: a
  // unit page axis added in JAX makes older XLA copy the pool.
  const bool token_pool = layout == KvLayout::kPaged && kd.size() == 3;
  const size_t kv_rank = layout == KvLayout::kVarlen || token_pool ? 3 : 4;
  if (qd.size() != q_rank || kd.size() != kv_rank || vd.size() != kv_rank)
    return InvalidArgument("jax_sgl.attention: operand ranks do not match the layout");
  if (!ToDType(q.element_type(), &p->q_type) || !ToDType(k.element_type(), &p->k_type) ||
      !ToDType(v.element_type(), &p->v_type) || !ToDType(out.element_type(), &p->out_type))
    return InvalidArgument("jax_sgl.attention: unsupported dtype");
  // SGLang's rule (flash_fwd_sm100): K shares Q's dtype; V may differ only as the fp8 v_dequant
  // path, which the Python checks gate on v_descale. jax_sgl's fp8 KV cache (e4m3 k/v under
  // 16/32-bit q) is the exception; its descales are checked with the others below.
  if (p->k_type != p->q_type && !Fp8KvCacheTypes(*p))
    return InvalidArgument(std::string("Type mismatch: ") + DTypeName(p->q_type) + " != " +
                           DTypeName(p->k_type));

  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->out = out.untyped_data();
  p->lse = lse.typed_data();
  p->kv_layout = layout;
  p->batch = int(batch);
  p->num_heads = int(qd[q_rank - 2]);
  p->head_dim = int(qd[q_rank - 1]);
  p->num_kv_heads = int(kd[kv_rank - 2]);
  p->head_dim_v = int(vd[kv_rank - 1]);
  SetContiguousKvStrides(p);
  if (attrs.kv_buffer) {
    // One fused buffer, K and V interleaved on its head axis; both pointers come from k (the
    // Python layer binds the same array as v).
    const int64_t heads_x2 = kd[kv_rank - 2], d_pad = kd[kv_rank - 1];
    // head_dim_pad % 8: every row and the V offset stay 16-byte aligned (the GPU kernels'
    // vector and TMA loads), as the Python check guarantees.
    if (layout != KvLayout::kPaged || heads_x2 % 2 != 0 || p->head_dim > d_pad || d_pad % 8 != 0)
      return InvalidArgument("jax_sgl.attention: kv_buffer must be one paged buffer "
                             "[P, page, 2 * Hkv, head_dim_pad >= head_dim, a multiple of 8] "
                             "bound as k and v");
    SetFusedKvBuffer(p, heads_x2, d_pad, ffi::ByteWidth(k.element_type()));
  }
  if (p->num_kv_heads <= 0 || p->num_heads % p->num_kv_heads != 0)
    return InvalidArgument("jax_sgl.attention: num_heads must be a multiple of num_kv_heads");
  p->total_q = varlen_q ? qd[0] : qd[0] * qd[1];
  p->seqlen_q = int(varlen_q ? attrs.max_seqlen_q : qd[1]);
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
      p->page_size = token_pool ? 1 : int(kd[1]);
      p->max_pages = int(pt[1]);
      p->total_k = kd[0] * p->page_size;
      break;
    }
  }
  p->seqused_k = seqused_k.element_count() > 0 ? seqused_k.typed_data() : nullptr;
  if (p->seqused_k && int64_t(seqused_k.element_count()) != batch)
    return InvalidArgument("jax_sgl.attention: seqused_k must have batch entries");
  // A descale's layout from its size ([B, Hkv], [Hkv] or [1]; where two agree, so do their
  // strides' values), none when empty.
  auto descale = [&](const char* name, const float* data, size_t count,
                     HeadDescale* out) -> ffi::Error {
    const int64_t n = int64_t(count);
    *out = HeadDescale{nullptr, 0, 0};
    if (n == 0) return ffi::Error::Success();
    if (n == batch * p->num_kv_heads) *out = HeadDescale{data, p->num_kv_heads, 1};
    else if (n == p->num_kv_heads) *out = HeadDescale{data, 0, 1};
    else if (n == 1) *out = HeadDescale{data, 0, 0};
    else
      return InvalidArgument(std::string("jax_sgl.attention: ") + name +
                             " must have [batch, num_kv_heads], [num_kv_heads] or 1 entries, got " +
                             std::to_string(n));
    return ffi::Error::Success();
  };
  p->q_descale = p->k_descale = HeadDescale{nullptr, 0, 0};
  p->q_block_scale = p->k_block_scale = nullptr;
  p->qk_block_scale = BlockScaleType::kNone;
  if (attrs.qk_blockscaled) {
    if (auto err = SetBlockScales(*o.q_descale, *o.k_descale, p); err.failure()) return err;
  } else {
    for (auto [name, d, out] : {std::tuple{"q_descale", &*o.q_descale, &p->q_descale},
                                std::tuple{"k_descale", &*o.k_descale, &p->k_descale}}) {
      if (d->element_type() != ffi::DataType::F32)
        return InvalidArgument("jax_sgl.attention: q_descale/k_descale must be float32 "
                               "per-head descales without qk_blockscaled");
      if (auto err = descale(name, static_cast<const float*>(d->untyped_data()),
                             d->element_count(), out);
          err.failure())
        return err;
    }
  }
  if (auto err = descale("v_descale", o.v_descale->typed_data(), o.v_descale->element_count(),
                         &p->v_descale);
      err.failure())
    return err;
  if (Fp8KvCacheTypes(*p) && (!p->k_descale || !p->v_descale))
    return InvalidArgument("jax_sgl.attention: an fp8 KV cache (e4m3 k/v under 16/32-bit q) "
                           "needs k_descale and v_descale");
  const ffi::Buffer<ffi::F32>& sinks = *o.sinks;
  if (sinks.element_count() > 0 && int64_t(sinks.element_count()) != p->num_heads)
    return InvalidArgument("jax_sgl.attention: sinks must have num_heads entries");
  p->sinks = sinks.element_count() > 0 ? sinks.typed_data() : nullptr;

  p->softmax_scale = attrs.softmax_scale;
  p->softcap = attrs.softcap;
  p->causal = attrs.causal;
  p->window_left = int(attrs.window_left);
  p->window_right = attrs.causal ? 0 : int(attrs.window_right);
  p->deterministic = attrs.deterministic;
  p->disable = attrs.disable;
  return ffi::Error::Success();
}

// The forward's operands and results (out, lse) into *p; *operands keeps the decoded buffers for
// handlers that need more than their data pointers (Metal's buffer sizes).
inline ffi::Error MakeAttentionParams(const ffi::RemainingArgs& args,
                                      const ffi::RemainingRets& rets, const AttentionAttrs& attrs,
                                      AttentionParams* p, AttentionOperands* operands) {
  if (auto err = CheckCount("operands", args.size(), kAttentionOperands); err.failure())
    return err;
  if (auto err = CheckCount("results", rets.size(), 2); err.failure()) return err;
  if (auto err = DecodeAttentionOperands(args, operands); err.failure()) return err;
  std::optional<ffi::Result<ffi::AnyBuffer>> out;
  std::optional<ffi::Result<ffi::Buffer<ffi::F32>>> lse;
  if (auto err = GetResult(rets, 0, "out", &out); err.failure()) return err;
  if (auto err = GetResult(rets, 1, "lse", &lse); err.failure()) return err;
  operands->out.emplace(**out);
  operands->lse.emplace(**lse);
  return FillAttentionParams(*operands, attrs, p);
}

inline ffi::Error MakeAttentionParams(const ffi::RemainingArgs& args,
                                      const ffi::RemainingRets& rets, const AttentionAttrs& attrs,
                                      AttentionParams* p) {
  AttentionOperands operands;
  return MakeAttentionParams(args, rets, attrs, p, &operands);
}

}  // namespace jax_sgl

// The list's commas must reach XLA's macro as separate arguments: one more expansion splits them.
#define JAX_SGL_REGISTER_ATTRS(...) XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(__VA_ARGS__)
#define JAX_SGL_ATTR_DECODING(T, NAME) , xla::ffi::StructMember<T>(#NAME)
JAX_SGL_REGISTER_ATTRS(jax_sgl::AttentionAttrs JAX_SGL_ATTENTION_ATTRS(JAX_SGL_ATTR_DECODING));
#undef JAX_SGL_ATTR_DECODING
#undef JAX_SGL_REGISTER_ATTRS

namespace jax_sgl {

// Every attention target binds this: the operands and results by index (decoded above), the
// attributes as one struct.
template <typename Binding>
auto BindAttention(Binding&& binding) {
  return std::move(binding).RemainingArgs().RemainingRets().template Attrs<AttentionAttrs>();
}

}  // namespace jax_sgl
