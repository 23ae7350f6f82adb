// The sm90 kernels of this build, for the host dispatch: instantiations/sm90_kernels.inc lists
// each (head dim, dtype) as JAX_SGL_SM90_FWD(head dim, bf16|fp16|e4m3) and JAX_SGL_SM90_BWD(...), each
// behind its JAX_SGL_SM90_DISABLE_HDIM<D>_<DTYPE> guard; the dispatchers include it with their own
// definitions of the two macros, and map the dtype token with these names.
#pragma once

#include "ffi/common/attention_params.h"
#include "ffi/common/numeric.h"

namespace jax_sgl::cuda::sm90 {

using Type_bf16 = bf16_t;
using Type_fp16 = f16_t;
constexpr DType kDType_bf16 = DType::kBF16;
constexpr DType kDType_fp16 = DType::kF16;
// The forward over e4m3 q/k/v (instantiations.json kind sm90_fwd_e4m3; bf16 out).
using Type_e4m3 = f8e4m3_t;
constexpr DType kDType_e4m3 = DType::kF8E4M3;

}  // namespace jax_sgl::cuda::sm90
