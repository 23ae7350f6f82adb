// jax_sgl's 16-bit and e4m3 storage types (ffi/common/numeric.h) -> CUTLASS's element types of the same
// bits, for the kernel families built on CuTe / CUTLASS (sm90, sm100).
#pragma once

#include <cutlass/numeric_types.h>

#include "ffi/common/numeric.h"

namespace jax_sgl::cuda {

template <typename T> struct CutlassType;
template <> struct CutlassType<bf16_t> { using type = cutlass::bfloat16_t; };
template <> struct CutlassType<f16_t> { using type = cutlass::half_t; };
template <> struct CutlassType<f8e4m3_t> { using type = cutlass::float_e4m3_t; };

}  // namespace jax_sgl::cuda
