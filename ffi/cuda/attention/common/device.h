// The current CUDA device's properties the attention host code sizes its grids and scratch by.
// No CUDA kernel syntax: host .cc files and launchers include it alike.
#pragma once

#include <cuda_runtime_api.h>

namespace jax_sgl::cuda {

// Streaming multiprocessors of the current device into *sms, or the error that kept them unread.
inline cudaError_t CurrentSmCount(int* sms) {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  return cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
}

}  // namespace jax_sgl::cuda
