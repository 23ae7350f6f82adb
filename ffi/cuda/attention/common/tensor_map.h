// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda), for
// the kernels that build their own TMA maps: the TMA decode (decode/tma_kernel.cuh) and the
// paged sm90 forward's page maps (sm90/fwd/page_map.h).
#pragma once

#include <type_traits>

#include <cuda.h>
#include <cuda_runtime.h>

#include "ffi/common/numeric.h"

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

// A map's element type for a kernel of 16-bit type T: its own (bf16 or f16), or, where the
// tensor holds e4m3 bytes, UINT8 (a TMA copy moves bytes; nothing converts them).
template <typename T>
constexpr CUtensorMapDataType TensorMapType(bool e4m3_bytes) {
  return e4m3_bytes                  ? CU_TENSOR_MAP_DATA_TYPE_UINT8
         : std::is_same_v<T, bf16_t> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                     : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

}  // namespace jax_sgl::cuda
