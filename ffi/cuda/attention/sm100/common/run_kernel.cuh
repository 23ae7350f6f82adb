// Launches one kernel of CUTLASS's Blackwell FMHA collectives (forward, backward, convert) from its
// Arguments: the sm100 launchers' one entry into the collectives' device layer.
#pragma once

#include <cuda_runtime_api.h>

#include <cute/tensor.hpp>  // before the collectives' device layer, which assumes it
#include <cutlass/device_kernel.h>

#include "device/fmha.hpp"

namespace jax_sgl::cuda::sm100 {

// The shared-memory opt-in is set on every call past the 48 KiB default: it is per device, and
// one attribute call is small next to the launch.
template <typename Kernel>
cudaError_t RunKernel(const typename Kernel::Arguments& args, cudaStream_t stream) {
  if (!Kernel::can_implement(args)) return cudaErrorInvalidValue;
  typename Kernel::Params params = Kernel::to_underlying_arguments(args, nullptr);
  if (Kernel::SharedStorageSize > 48 * 1024) {
    if (cudaError_t err = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               int(Kernel::SharedStorageSize));
        err != cudaSuccess)
      return err;
  }
  if (cutlass::fmha::device::FMHA<Kernel>::run(params, stream) != cutlass::Status::kSuccess) {
    const cudaError_t err = cudaGetLastError();
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
  return cudaSuccess;
}

}  // namespace jax_sgl::cuda::sm100
