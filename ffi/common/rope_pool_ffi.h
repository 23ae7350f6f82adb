// The FFI signature of jax_sgl_rope_pool_fwd, shared by the CPU, CUDA and Metal handlers so all
// bind the same operands, results and attributes in the same order, and all fill RopePoolParams
// one way. The pools come in one of two layouts (rope_pool_params.h): separate k_pool and v_pool,
// or one fused kv_buffer, told apart by whether a v_pool operand follows. kv_scales is float32
// [2, Hkv] (k's scales, then v's) with an fp8 e4m3 pool, else empty.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>

#include "ffi/common/ffi_helpers.h"
#include "ffi/common/rope_pool_params.h"

namespace jax_sgl {

// The attributes, decoded as one struct (registered below).
struct RopePoolAttrs {
  int64_t rotary_dim;
  bool is_neox;
};

// Operands, by index: q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], positions [T] and slots [T]
// (int32 / int64), inv_freq [rotary_dim / 2] float32, kv_scales [2, Hkv] float32 (fp8 pool) or
// [0], k_pool [N, Hkv, D] or the fused kv_buffer [..., 2 * Hkv, Dp] (aliased with result 2),
// then v_pool [N, Hkv, D] (aliased with result 3) unless the pool is fused. Results: q_rot, k_rot,
// k_pool / kv_buffer out, and v_pool out with separate pools.
constexpr size_t kRopePoolOperands = 8;
constexpr size_t kRopePoolResults = 3;

// Appends the operands, results and attributes to a binding that already holds the platform
// context: every handler then takes (context, args, rets, attrs).
template <typename Binding>
auto BindRopePool(Binding binding) {
  return std::move(binding).RemainingArgs().RemainingRets().template Attrs<RopePoolAttrs>();
}

// The pool buffers of a call, as the handlers copy them when XLA did not alias an output with its
// input (no donation): one fused buffer or the k and v pools.
struct RopePoolBuffers {
  int count = 0;
  const void* in[2] = {};
  void* out[2] = {};
  size_t bytes[2] = {};

  bool fused() const { return count == 1; }
};

// Validates what abstract eval cannot guarantee for a direct FFI caller, fills the params and
// names the pool buffers.
// The call's operands and results, decoded (for handlers that need more than their data
// pointers: Metal's buffer sizes).
struct RopePoolOperands {
  std::optional<ffi::AnyBuffer> q, k, v, positions, slots, inv_freq, kv_scales, pool, v_pool;
  std::optional<ffi::Result<ffi::AnyBuffer>> q_rot, k_rot, pool_out, v_pool_out;
};

inline ffi::Error MakeRopePoolParams(const ffi::RemainingArgs& args,
                                     const ffi::RemainingRets& rets, const RopePoolAttrs& attrs,
                                     RopePoolParams* p, RopePoolBuffers* pools,
                                     RopePoolOperands* o) {
  constexpr const char* kFn = "jax_sgl.rope_pool_fused";
  const bool separate = args.size() == kRopePoolOperands + 1;
  if ((args.size() != kRopePoolOperands && !separate) ||
      rets.size() != kRopePoolResults + (separate ? 1 : 0))
    return InvalidArgument("rope_pool_fused: expects k_pool and v_pool, or one kv_buffer");
  auto arg = [&](size_t i, const char* name, std::optional<ffi::AnyBuffer>* out) {
    return GetIndexed<ffi::AnyBuffer>(kFn, args, "operand", i, name, out);
  };
  auto ret = [&](size_t i, const char* name, std::optional<ffi::Result<ffi::AnyBuffer>>* out) {
    return GetIndexed<ffi::AnyBuffer>(kFn, rets, "result", i, name, out);
  };
  ffi::Error errs[] = {
      arg(0, "q", &o->q),
      arg(1, "k", &o->k),
      arg(2, "v", &o->v),
      arg(3, "positions", &o->positions),
      arg(4, "slots", &o->slots),
      arg(5, "inv_freq", &o->inv_freq),
      arg(6, "kv_scales", &o->kv_scales),
      arg(7, "pool", &o->pool),
      ret(0, "q_rot", &o->q_rot),
      ret(1, "k_rot", &o->k_rot),
      ret(2, "pool", &o->pool_out),
      separate ? arg(8, "v_pool", &o->v_pool) : ffi::Error::Success(),
      separate ? ret(3, "v_pool", &o->v_pool_out) : ffi::Error::Success(),
  };
  for (ffi::Error& err : errs)
    if (err.failure()) return std::move(err);
  const ffi::AnyBuffer &q = *o->q, &k = *o->k, &v = *o->v, &positions = *o->positions,
                       &slots = *o->slots, &inv_freq = *o->inv_freq,
                       &kv_scales = *o->kv_scales, &pool_in = *o->pool;
  ffi::Result<ffi::AnyBuffer> &q_rot = *o->q_rot, &k_rot = *o->k_rot, &pool_out = *o->pool_out;
  const int64_t rotary_dim = attrs.rotary_dim;
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto pd = pool_in.dimensions();
  if (qd.size() != 3 || kd.size() != 3)
    return InvalidArgument("rope_pool_fused expects q/k/v to be 3-D");
  DType dt;
  if (!ToDType(q.element_type(), &dt) || dt == DType::kF8E4M3 || dt == DType::kF8E5M2)
    return InvalidArgument("rope_pool_fused: unsupported dtype");
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return InvalidArgument("q/k/v dtypes must match");
  // The pool: q's dtype without scales, e4m3 with them (jax_sgl's fp8 KV cache).
  const bool fp8_pool = kv_scales.element_count() > 0;
  const ffi::DataType pool_type = fp8_pool ? ffi::DataType::F8E4M3FN : q.element_type();
  if (pool_in.element_type() != pool_type)
    return InvalidArgument(fp8_pool ? "rope_pool_fused: kv_scales need a float8_e4m3fn pool"
                                    : "pool dtypes must match q/k/v dtype");
  auto it = positions.element_type();
  if (it != slots.element_type() ||
      (it != ffi::DataType::S32 && it != ffi::DataType::S64))
    return InvalidArgument("rope_pool_fused: positions and slots must both be int32 or int64");
  const int64_t head_dim = qd[2], hkv = kd[1];
  if (rotary_dim <= 0 || rotary_dim > head_dim || rotary_dim % 2 != 0)
    return InvalidArgument("rope_pool_fused: rotary_dim must be even and in (0, head_dim]");
  if (inv_freq.element_type() != ffi::DataType::F32 ||
      int64_t(inv_freq.element_count()) != rotary_dim / 2)
    return InvalidArgument("rope_pool_fused: inv_freq must be float32 [rotary_dim / 2]");
  if (fp8_pool && (kv_scales.element_type() != ffi::DataType::F32 ||
                   int64_t(kv_scales.element_count()) != 2 * hkv))
    return InvalidArgument("rope_pool_fused: kv_scales must be float32 [2, num_kv_heads]");

  p->num_kv_heads = int(hkv);
  p->head_dim = int(head_dim);
  void* pool = pool_out->untyped_data();
  pools->in[0] = pool_in.untyped_data();
  pools->out[0] = pool;
  pools->bytes[0] = pool_in.size_bytes();
  if (separate) {  // separate pools [N, Hkv, D]
    const ffi::AnyBuffer& v_in = *o->v_pool;
    ffi::Result<ffi::AnyBuffer>& v_out = *o->v_pool_out;
    if (pd.size() != 3 || v_in.dimensions().size() != 3)
      return InvalidArgument("rope_pool_fused expects pool tensors to be 3-D");
    if (pd[1] != hkv || pd[2] != head_dim || v_in.element_count() != pool_in.element_count() ||
        v_in.element_type() != pool_type)
      return InvalidArgument("rope_pool_fused: k_pool/v_pool must both be [num_slots, Hkv, D]");
    pools->count = 2;
    pools->in[1] = v_in.untyped_data();
    pools->out[1] = v_out->untyped_data();
    pools->bytes[1] = v_in.size_bytes();
    SetSeparatePools(p, pool, pools->out[1], pd[0]);
  } else {  // fused [..., 2 * Hkv, Dp]: any rank, read as [num_slots, 2 * Hkv, Dp]
    const int64_t d_pad = pd.size() >= 3 ? pd.back() : 0;
    if (pd.size() < 3 || d_pad < head_dim || d_pad == 0 || hkv == 0 ||
        int64_t(pool_in.element_count()) % (2 * hkv * d_pad) != 0)
      return InvalidArgument("rope_pool_fused: kv_buffer must be [..., 2 * num_kv_heads, "
                             "head_dim_pad] with head_dim_pad >= head_dim");
    pools->count = 1;
    SetFusedPool(p, pool, int64_t(pool_in.element_count()), d_pad,
                 int64_t(ffi::ByteWidth(pool_in.element_type())));
  }

  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->positions = positions.untyped_data();
  p->slots = slots.untyped_data();
  p->inv_freq = static_cast<const float*>(inv_freq.untyped_data());
  p->q_rot = q_rot->untyped_data();
  p->k_rot = k_rot->untyped_data();
  p->num_tokens = qd[0];
  p->num_qo_heads = int(qd[1]);
  p->rotary_dim = int(rotary_dim);
  p->is_neox = attrs.is_neox;
  p->dtype = dt;
  p->pool_dtype = fp8_pool ? DType::kF8E4M3 : dt;
  const float* scales = static_cast<const float*>(kv_scales.untyped_data());
  p->k_scale = fp8_pool ? scales : nullptr;
  p->v_scale = fp8_pool ? scales + hkv : nullptr;
  p->index_type = it == ffi::DataType::S32 ? IndexType::kI32 : IndexType::kI64;
  return ffi::Error::Success();
}

inline ffi::Error MakeRopePoolParams(const ffi::RemainingArgs& args,
                                     const ffi::RemainingRets& rets, const RopePoolAttrs& attrs,
                                     RopePoolParams* p, RopePoolBuffers* pools) {
  RopePoolOperands operands;
  return MakeRopePoolParams(args, rets, attrs, p, pools, &operands);
}

}  // namespace jax_sgl

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_sgl::RopePoolAttrs,
                                      xla::ffi::StructMember<int64_t>("rotary_dim"),
                                      xla::ffi::StructMember<bool>("is_neox"));
