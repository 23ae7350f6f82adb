// FFI handler of jax_sgl_rope_pool_fwd on the CUDA platform: binds the buffers (shared signature in
// ffi/common/rope_pool_ffi.h), starts the output pools from the input pools when XLA did not alias
// them (no donation), and launches the kernel. No CUDA kernel syntax here; errors are returned.
#include <cuda_runtime_api.h>

#include <string>

#include "ffi/common/rope_pool_ffi.h"
#include "ffi/cuda/rope_pool/rope_pool.h"

namespace jax_sgl::cuda {
namespace {

ffi::Error CudaError(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("jax_sgl.rope_pool_fused: ") + what + ": " +
                              cudaGetErrorString(err));
}

// With donation the output pool is the input pool and nothing is copied: only the written rows
// are touched. Without it XLA hands us a fresh buffer that must start as a copy of the input.
ffi::Error RopePoolFwdImpl(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                           RopePoolAttrs attrs) {
  RopePoolParams p;
  RopePoolBuffers pools;
  if (auto err = MakeRopePoolParams(args, rets, attrs, &p, &pools); err.failure())
    return err;
  for (int i = 0; i < pools.count; ++i) {
    if (pools.out[i] == pools.in[i] || pools.bytes[i] == 0) continue;
    if (cudaError_t e = cudaMemcpyAsync(pools.out[i], pools.in[i], pools.bytes[i],
                                        cudaMemcpyDeviceToDevice, stream);
        e != cudaSuccess)
      return CudaError("copying the pool", e);
  }
  if (cudaError_t e = LaunchRopePool(stream, p); e != cudaSuccess)
    return CudaError("kernel launch", e);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sgl::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxSglRopePoolFwdCuda, jax_sgl::cuda::RopePoolFwdImpl,
    jax_sgl::BindRopePool(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
