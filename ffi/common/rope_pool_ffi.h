// The FFI signature of jax_sgl_rope_pool_fwd, shared by the CPU and CUDA handlers so both bind the
// same operands, results and attributes in the same order, and both fill RopePoolParams one way.
#pragma once

#include <cmath>

#include "ffi/common/ffi_helpers.h"
#include "ffi/common/rope_pool_params.h"

namespace jax_sgl {

// Appends the operands, results and attributes to a binding that already holds the platform context.
template <typename Binding>
auto BindRopePool(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()        // q [T, Hq, D]
      .template Arg<ffi::AnyBuffer>()        // k [T, Hkv, D]
      .template Arg<ffi::AnyBuffer>()        // v [T, Hkv, D]
      .template Arg<ffi::AnyBuffer>()        // positions [T] int32/int64
      .template Arg<ffi::AnyBuffer>()        // slots [T] int32/int64
      .template Arg<ffi::AnyBuffer>()        // k_pool [N, Hkv, D] (aliased with result 2)
      .template Arg<ffi::AnyBuffer>()        // v_pool [N, Hkv, D] (aliased with result 3)
      .template Ret<ffi::AnyBuffer>()        // q_rot
      .template Ret<ffi::AnyBuffer>()        // k_rot
      .template Ret<ffi::AnyBuffer>()        // k_pool out
      .template Ret<ffi::AnyBuffer>()        // v_pool out
      .template Attr<float>("rope_base")
      .template Attr<int64_t>("rotary_dim")
      .template Attr<bool>("is_neox");
}

// Validates what abstract eval cannot guarantee for a direct FFI caller and fills the params.
inline ffi::Error MakeRopePoolParams(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                     ffi::AnyBuffer positions, ffi::AnyBuffer slots,
                                     ffi::Result<ffi::AnyBuffer> q_rot,
                                     ffi::Result<ffi::AnyBuffer> k_rot,
                                     ffi::Result<ffi::AnyBuffer> k_pool,
                                     ffi::Result<ffi::AnyBuffer> v_pool, float rope_base,
                                     int64_t rotary_dim, bool is_neox, RopePoolParams* p) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto pd = k_pool->dimensions();
  if (qd.size() != 3 || kd.size() != 3 || pd.size() != 3)
    return InvalidArgument("rope_pool_fused expects q/k/v and pools to be 3-D");
  DType dt;
  if (!ToDType(q.element_type(), &dt) || dt == DType::kF8E4M3 || dt == DType::kF8E5M2)
    return InvalidArgument("rope_pool_fused: unsupported dtype");
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      k_pool->element_type() != q.element_type() || v_pool->element_type() != q.element_type())
    return InvalidArgument("q/k/v dtypes must match");
  auto it = positions.element_type();
  if (it != slots.element_type() ||
      (it != ffi::DataType::S32 && it != ffi::DataType::S64))
    return InvalidArgument("rope_pool_fused: positions and slots must both be int32 or int64");
  const int64_t head_dim = qd[2];
  if (rotary_dim <= 0 || rotary_dim > head_dim || rotary_dim % 2 != 0)
    return InvalidArgument("rope_pool_fused: rotary_dim must be even and in (0, head_dim]");

  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->positions = positions.untyped_data();
  p->slots = slots.untyped_data();
  p->q_rot = q_rot->untyped_data();
  p->k_rot = k_rot->untyped_data();
  p->k_pool = k_pool->untyped_data();
  p->v_pool = v_pool->untyped_data();
  p->num_tokens = qd[0];
  p->num_slots = pd[0];
  p->num_qo_heads = int(qd[1]);
  p->num_kv_heads = int(kd[1]);
  p->head_dim = int(head_dim);
  p->rotary_dim = int(rotary_dim);
  p->is_neox = is_neox;
  p->log2_base = std::log2(double(rope_base));
  p->dtype = dt;
  p->index_type = it == ffi::DataType::S32 ? IndexType::kI32 : IndexType::kI64;
  return ffi::Error::Success();
}

}  // namespace jax_sgl
