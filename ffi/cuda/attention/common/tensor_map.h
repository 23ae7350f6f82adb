// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda), for
// the kernels that build their own TMA maps: the TMA decode (decode/tma_kernel.cuh) and the
// paged sm90 forward's page maps (sm90/fwd/page_map.h).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

namespace jax_sgl::cuda {

// cuda.h's declaration as a pointer type (cudaTypedefs.h's name for it lands in namespace cutlass
// when CUTLASS's host adapter includes that header first).
using TensorMapEncodeFn = decltype(&::cuTensorMapEncodeTiled);

// The driver's encoder (version 12.0 of the entry point), looked up once; nullptr when the
// driver lacks it.
inline TensorMapEncodeFn TensorMapEncoder() {
  static TensorMapEncodeFn encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<TensorMapEncodeFn>(fn);
  }();
  return encode;
}

}  // namespace jax_sgl::cuda
