// The sm100 kernels of this build, for the host dispatch: instantiations/sm100_kernels.inc lists
// each (head dim, dtype) as JAX_SGL_SM100_FWD / JAX_SGL_SM100_BWD(head dim, bf16|fp16), each behind
// its JAX_SGL_SM100_DISABLE_HDIM<D>_<DTYPE> guard; the dispatchers include it with their own
// definitions of the macros they switch over, and map the dtype token with these names.
#pragma once

#include "ffi/common/attention_params.h"
#include "ffi/common/numeric.h"

namespace jax_sgl::cuda::sm100 {

using Type_bf16 = bf16_t;
using Type_fp16 = f16_t;
constexpr DType kDType_bf16 = DType::kBF16;
constexpr DType kDType_fp16 = DType::kF16;

}  // namespace jax_sgl::cuda::sm100
