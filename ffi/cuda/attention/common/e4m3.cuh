// e4m3 (float8_e4m3fn) bytes widened to the mma's 16-bit types: the one conversion every CUDA
// attention kernel that reads fp8 operands uses (the fp8-KV decode's register fragments, the
// portable forward's shared-memory tiles). e4m3 -> f16 is exact (every e4m3 value, subnormals
// included, is a normal f16) and so is f16 -> f32 -> bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "ffi/common/numeric.h"
#include "ffi/cuda/attention/common/mma.cuh"

namespace jax_sgl::cuda::flash {

// Two e4m3 values (low byte first) as two of T (bf16 / fp16), low half first: the sm_89+
// conversion instruction, else (sm_80) the exact decode of the bits.
template <typename T>
__device__ __forceinline__ uint32_t E4m3x2To(uint32_t two) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  return Elem<T>::Pack(ToFloat(f8e4m3_t{uint8_t(two & 0xffu)}),
                       ToFloat(f8e4m3_t{uint8_t((two >> 8) & 0xffu)}));
#else
  uint32_t h;
  asm("{\n .reg .b16 x;\n cvt.u16.u32 x, %1;\n cvt.rn.f16x2.e4m3x2 %0, x;\n}\n"
      : "=r"(h)
      : "r"(two));
  if constexpr (std::is_same_v<T, f16_t>) {
    return h;
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    return Elem<bf16_t>::Pack(f.x, f.y);
  }
#endif
}

// Eight e4m3 values (one 8-byte word pair, element 0 in the low byte of x) as eight of T: the
// 16-byte chunk a 16-bit tile row holds where the fp8 row held 8 bytes.
template <typename T>
__device__ __forceinline__ uint4 E4m3x8To(uint2 w) {
  return make_uint4(E4m3x2To<T>(w.x & 0xffffu), E4m3x2To<T>(w.x >> 16),
                    E4m3x2To<T>(w.y & 0xffffu), E4m3x2To<T>(w.y >> 16));
}

}  // namespace jax_sgl::cuda::flash
