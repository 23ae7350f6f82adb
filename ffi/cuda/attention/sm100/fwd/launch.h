// Host contract of the sm_100a flash forward (CUTLASS's Blackwell FMHA collectives: tcgen05 MMA
// into TMEM, TMA loads and stores, warp-specialized; sm100/fwd/config.h). No CUDA kernel syntax:
// fwd_dispatch.cc includes it.
//
// The dispatcher uses this kernel on a compute capability 10.0 device when JAX_SGL_DISABLE does not
// name sm100 (p.disable), the build has the (dtype, head dim) instantiation
// (JAX_SGL_SM100_HEAD_DIMS x JAX_SGL_SM100_DTYPES) and Sm100FwdUnsupported() finds nothing
// missing. Anything else runs on the portable kernels.
#pragma once

#include <cuda_runtime_api.h>

#include "ffi/common/attention_params.h"
#include "ffi/cuda/attention/common/device.h"

namespace jax_sgl::cuda {

// nullptr when the sm100 forward covers the call, else what it lacks (the fallback decision).
const char* Sm100FwdUnsupported(const AttentionParams& p);

// Whether a call the sm100 forward covers runs on it: `dev` is compute capability 10.0 (IsSm100:
// sm_100a code runs on no other device; a 10.3 one runs the portable kernels) and
// JAX_SGL_DISABLE does not name sm100.
bool Sm100FwdEnabled(const AttentionParams& p, const DeviceInfo& dev);

// The instantiations this build holds, space separated with a leading space: each (head dim,
// dtype) (" hdim128_bf16"), for jax_sgl.attention_backend_info().
const char* Sm100FwdBuiltKernels();

// Launches the sm100 forward; the caller checked Sm100FwdUnsupported(p) == nullptr. No scratch.
cudaError_t RunFlashFwdSm100(const AttentionParams& p, cudaStream_t stream);

// One instantiation per (storage type, head dim), in instantiations/sm100_fwd_*.cu.
template <typename T, int kHeadDim>
cudaError_t LaunchFlashFwdSm100(const AttentionParams& p, cudaStream_t stream);

}  // namespace jax_sgl::cuda
