// Helpers shared by every FFI handler (CPU and CUDA): element-type mapping and error returns.
// Handlers report bad runtime input as ffi::Error; they never throw, abort or synchronize.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "ffi/common/dispatch.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sgl {

namespace ffi = xla::ffi;

inline bool ToDType(xla::ffi::DataType t, DType* out) {
  switch (t) {
    case xla::ffi::DataType::F32: *out = DType::kF32; return true;
    case xla::ffi::DataType::F16: *out = DType::kF16; return true;
    case xla::ffi::DataType::BF16: *out = DType::kBF16; return true;
    case xla::ffi::DataType::F8E4M3FN: *out = DType::kF8E4M3; return true;
    case xla::ffi::DataType::F8E5M2: *out = DType::kF8E5M2; return true;
    default: return false;
  }
}

inline ffi::Error InvalidArgument(const std::string& what) {
  return ffi::Error::InvalidArgument(what);
}

// Element `index` of a call's operands (RemainingArgs, kind "operand") or results
// (RemainingRets, kind "result") as T, or an error naming the function `fn` and the element.
template <typename T, typename Remaining, typename Out>
ffi::Error GetIndexed(const char* fn, const Remaining& list, const char* kind, size_t index,
                      const char* name, std::optional<Out>* out) {
  auto value = list.template get<T>(index);
  if (value.has_error())
    return InvalidArgument(std::string(fn) + ": " + kind + " " + std::to_string(index) + " (" +
                           name + "): " + value.error().message());
  out->emplace(*value);
  return ffi::Error::Success();
}

}  // namespace jax_sgl
