// Runs a functor with the storage type that matches a jax_sgl::DType. Free of FFI and CUDA
// headers so handlers, CPU kernels and CUDA launchers all share it.
//
// Usage:
//   return DispatchFloat(p.dtype, [&](auto tag) { using T = typename decltype(tag)::type; ... });
#pragma once

#include "ffi/common/numeric.h"
#include "ffi/common/rope_pool_params.h"

namespace jax_sgl {

template <typename T>
struct TypeTag {
  using type = T;
};

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
    case DType::kF8E4M3: return "float8_e4m3fn";
    case DType::kF8E5M2: return "float8_e5m2";
  }
  return "unknown";
}

// Storage types that kernels read and write (float32, float16, bfloat16).
template <typename F>
decltype(auto) DispatchFloat(DType t, F&& f) {
  switch (t) {
    case DType::kF16: return f(TypeTag<f16_t>{});
    case DType::kBF16: return f(TypeTag<bf16_t>{});
    default: return f(TypeTag<float>{});
  }
}

// Storage types that kernels only read (the above plus fp8).
template <typename F>
decltype(auto) DispatchInput(DType t, F&& f) {
  switch (t) {
    case DType::kF16: return f(TypeTag<f16_t>{});
    case DType::kBF16: return f(TypeTag<bf16_t>{});
    case DType::kF8E4M3: return f(TypeTag<f8e4m3_t>{});
    case DType::kF8E5M2: return f(TypeTag<f8e5m2_t>{});
    default: return f(TypeTag<float>{});
  }
}

}  // namespace jax_sgl
