// The launch every attention kernel here shares: opt the kernel into its dynamic shared memory,
// launch it, report the launch's error. Kernels above 48 KiB of dynamic shared memory must raise
// their limit first, and the attribute is per kernel, so it is set before each launch (cheap).
#pragma once

#include <cuda_runtime_api.h>

namespace jax_sgl::cuda {

// Launches kernel<<<grid, threads, smem, stream>>>(args...) after setting its dynamic shared
// memory limit to smem; returns the first error.
template <typename... Params, typename... Args>
cudaError_t LaunchWithSmem(void (*kernel)(Params...), dim3 grid, int threads, int smem,
                           cudaStream_t stream, const Args&... args) {
  if (cudaError_t err =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      err != cudaSuccess)
    return err;
  kernel<<<grid, threads, smem, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace jax_sgl::cuda
