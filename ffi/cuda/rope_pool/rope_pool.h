// Launcher of the CUDA rope_pool_fused kernel. The contract is RopePoolParams
// (ffi/common/rope_pool_params.h), filled by the FFI handler; this header carries no FFI or CUDA
// kernel syntax so the handler (plain C++) can include it.
#pragma once

#include <cuda_runtime_api.h>

#include "ffi/common/rope_pool_params.h"

namespace jax_sgl::cuda {

// Enqueues the kernel on `stream`: rotated q/k into q_rot/k_rot, rotated k and v into the pool rows
// at in-range slots. Writes nothing else (the handler copies the pools first when not donated).
// Returns the launch's error (cudaGetLastError), never synchronizes.
cudaError_t LaunchRopePool(cudaStream_t stream, const RopePoolParams& p);

}  // namespace jax_sgl::cuda
