// CUDA FFI handler of jax_sgl_attention_fwd: binds the shared signature (attention_ffi.h), plans the
// kernel (fwd_dispatch.cc), takes split-KV scratch from XLA's allocator and launches. No CUDA
// syntax here; errors come back as ffi::Error, nothing synchronizes.
#include <cuda_runtime_api.h>

#include <string>

#include "ffi/common/attention_ffi.h"
#include "ffi/cuda/attention/common/device.h"
#include "ffi/cuda/attention/flash_fwd_launch.h"

namespace jax_sgl::cuda {
namespace {

ffi::Error AttentionFwdCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                            ffi::RemainingArgs args, ffi::RemainingRets rets,
                            AttentionAttrs attrs) {
  AttentionParams p;
  if (auto err = MakeAttentionParams(args, rets, attrs, &p); err.failure()) return err;
  FlashPlan plan;
  if (const char* why = PlanFlashFwd(p, CurrentDeviceInfo(), &plan))
    return ffi::Error(ffi::ErrorCode::kUnimplemented, why);
  void* workspace = nullptr;
  if (plan.scratch_bytes > 0) {
    // 16 bytes: the most XLA's FFI allocator grants, and what the float4 accesses need.
    auto buffer = scratch.Allocate(plan.scratch_bytes, 16);
    if (!buffer.has_value())
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "jax_sgl.attention: no scratch memory for the split-KV partials");
    workspace = *buffer;
  }
  if (const char* why = RunFlashFwd(p, plan, workspace, stream)) return ffi::Error::Internal(why);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sgl::cuda

// Not kCmdBufferCompatible: the split-KV scratch comes from XLA's per-call allocator, whose
// address a captured CUDA graph would bake in.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxSglAttentionFwdCuda, jax_sgl::cuda::AttentionFwdCuda,
    jax_sgl::BindAttention(xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()));
