// Division by a runtime divisor fixed for a whole kernel (a page size) by a multiply-high and a
// shift (Granlund-Montgomery): page lookups run per key or stage, where a division costs ~20
// instructions (IABS, I2F, MUFU.RCP, ...: three of them per K load were a quarter of the sm90
// page-1 gather's instructions, ncu, H100).
#pragma once

#include <cstdint>

namespace jax_sgl::cuda {

// n / d for 0 <= n < 2^31 and 1 <= d < 2^31. Built on the host (a kernel parameter) or once per
// thread on the device.
struct FastDiv {
  uint32_t mul, shift;
  __host__ __device__ explicit FastDiv(uint32_t d = 1) {
    shift = 0;
    while ((1u << shift) < d) ++shift;
    mul = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ uint32_t Div(uint32_t n) const {
    return (__umulhi(n, mul) + n) >> shift;
  }
};

}  // namespace jax_sgl::cuda
