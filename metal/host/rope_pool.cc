// macOS "cpu" handler of jax_sgl_rope_pool_fwd: runs the Metal kernel (metal/kernels/rope_pool.metal)
// on XLA's host buffers, or hands the call to the C++ CPU handler (JaxSglRopePoolFwdCpu) when Metal
// is off, absent or not worth it (see metal/host/context.h). Plain C++: the Objective-C++ lives in
// context.mm.
#include <cstring>
#include <string>
#include <vector>

#include "ffi/common/rope_pool_ffi.h"
#include "metal/host/context.h"
#include "metal/host/plan.h"

extern "C" XLA_FFI_Error* JaxSglRopePoolFwdCpu(XLA_FFI_CallFrame*);

namespace jax_sgl::metal {
namespace {

// Below ~64K rotated elements a command-buffer round trip costs more than the CPU kernel (a guess
// until measured on Apple hardware).
constexpr double kRopePoolAutoThreshold = 65536;

ffi::Error RopePoolFwdMetalImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                RopePoolAttrs attrs) {
  RopePoolParams p;
  RopePoolBuffers pools;
  RopePoolOperands o;
  if (auto err = MakeRopePoolParams(args, rets, attrs, &p, &pools, &o); err.failure())
    return err;
  const char* name = RopePoolKernelName(p.dtype, p.index_type);
  const double work = double(p.num_tokens) * (p.num_qo_heads + p.num_kv_heads) * p.head_dim;
  // The fp8 pool (quantize on write) has no Metal kernel: the CPU kernel writes it.
  if (name == nullptr || p.pool_dtype != p.dtype || p.num_tokens == 0 ||
      !UseMetal(work, kRopePoolAutoThreshold)) {
    MarkDeclined();
    return ffi::Error::Success();
  }
  // Without donation XLA gives the outputs their own buffers: start them from the input pools.
  for (int i = 0; i < pools.count; ++i)
    if (pools.out[i] != pools.in[i]) std::memcpy(pools.out[i], pools.in[i], pools.bytes[i]);

  const MetalRopePoolParams mp = ToMetalParams(p, pools.fused());
  // With a fused kv_buffer the kernel writes V into the kRopeKPool buffer; kRopeVPool only needs
  // something bound (Metal wants a buffer at every index the kernel declares).
  static float dummy = 0.f;
  void* v_binding = pools.fused() ? &dummy : pools.out[1];
  const size_t v_bytes = pools.fused() ? sizeof(dummy) : pools.bytes[1];
  const std::vector<HostArg> bindings = {
      {kRopeInvFreq, o.inv_freq->untyped_data(), o.inv_freq->size_bytes(), false},
      {kRopeQ, o.q->untyped_data(), o.q->size_bytes(), false},
      {kRopeK, o.k->untyped_data(), o.k->size_bytes(), false},
      {kRopeV, o.v->untyped_data(), o.v->size_bytes(), false},
      {kRopePositions, o.positions->untyped_data(), o.positions->size_bytes(), false},
      {kRopeSlots, o.slots->untyped_data(), o.slots->size_bytes(), false},
      {kRopeQRot, (*o.q_rot)->untyped_data(), (*o.q_rot)->size_bytes(), true},
      {kRopeKRot, (*o.k_rot)->untyped_data(), (*o.k_rot)->size_bytes(), true},
      {kRopeKPool, pools.out[0], pools.bytes[0], true},
      {kRopeVPool, v_binding, v_bytes, !pools.fused()},
  };
  const std::string error = Dispatch(name, RopePoolGrid(p), bindings, &mp, sizeof(mp), kRopeParams);
  if (!error.empty()) return ffi::Error::Internal("jax_sgl.rope_pool_fused (Metal): " + error);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sgl::metal

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSglRopePoolFwdMetal, jax_sgl::metal::RopePoolFwdMetalImpl,
                              jax_sgl::BindRopePool(xla::ffi::Ffi::Bind()));

// The handler registered for platform "cpu" on macOS: Metal first, the CPU kernel when the Metal
// handler declines. Both decode the same call frame, so the fallback sees the call unchanged.
extern "C" XLA_FFI_Error* JaxSglRopePoolFwdApple(XLA_FFI_CallFrame* frame) {
  if (jax_sgl::metal::SelectedMode() == jax_sgl::metal::Mode::kOff)
    return JaxSglRopePoolFwdCpu(frame);
  XLA_FFI_Error* err = JaxSglRopePoolFwdMetal(frame);
  if (err == nullptr && jax_sgl::metal::TakeDeclined()) return JaxSglRopePoolFwdCpu(frame);
  return err;
}
