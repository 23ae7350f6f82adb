// CUDA FFI handler of jax_sgl_attention_bwd: binds the signature shared with the CPU backward
// (attention_bwd_ffi.h), plans the call (PlanFlashBwd: which kernels, how much workspace), takes
// the float32 workspace (softmax_d, the log2-domain lse and, for the sm90 kernel's dQ, a float32
// accumulator) from XLA's scratch allocator and launches the kernels (bwd_dispatch.cc). No
// CUDA syntax here; errors come back as ffi::Error, nothing synchronizes.
#include <cuda_runtime_api.h>

#include "ffi/common/attention_bwd_ffi.h"
#include "ffi/cuda/attention/common/device.h"
#include "ffi/cuda/attention/flash_bwd_launch.h"

namespace jax_sgl::cuda {
namespace {

ffi::Error AttentionBwdCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                            ffi::RemainingArgs args, ffi::RemainingRets rets,
                            AttentionAttrs attrs) {
  AttentionBwdParams bp;
  if (auto err = MakeAttentionBwdParams(args, rets, attrs, &bp); err.failure()) return err;
  FlashBwdPlan plan;
  if (const char* why = PlanFlashBwd(bp.fwd, CurrentDeviceInfo(), &plan))
    return ffi::Error(ffi::ErrorCode::kUnimplemented, why);
  void* workspace = nullptr;
  if (const size_t bytes = plan.scratch_bytes; bytes > 0) {
    auto buffer = scratch.Allocate(bytes, 16);
    if (!buffer.has_value())
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "jax_sgl.attention: no scratch memory for the backward's workspace");
    workspace = *buffer;
  }
  if (const char* why = RunFlashBwd(bp, plan, workspace, stream)) return ffi::Error::Internal(why);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sgl::cuda

// Not kCmdBufferCompatible: the workspace comes from XLA's per-call allocator, whose address a
// captured CUDA graph would bake in.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxSglAttentionBwdCuda, jax_sgl::cuda::AttentionBwdCuda,
    jax_sgl::BindAttention(xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()));
