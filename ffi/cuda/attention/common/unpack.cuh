// 16-bit storage values to float32 on the device, eight (one 16-byte vector) at a time: the
// decode kernels' dot products and the backward preprocess. numeric.h's ToFloat is the portable
// bit-level form, a dozen instructions per f16 element.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "ffi/common/numeric.h"

namespace jax_sgl::cuda {

template <typename T>
__device__ __forceinline__ void Unpack8(const uint4& u, float (&f)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, bf16_t>) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
}

}  // namespace jax_sgl::cuda
