// Host contract of the sm_100a flash attention backward, built on CUTLASS's Blackwell FMHA
// backward collective (77_blackwell_fmha: kernel/sm100_fmha_bwd_kernel_tma_warpspecialized.hpp,
// tcgen05 MMA into TMEM, TMA loads, dQ by TMA reduce-add into a float32 accumulator, then
// kernel/fmha_kernel_bwd_convert.hpp). No CUDA kernel syntax: bwd_dispatch.cc includes it.
//
// The launch sequence reuses jax_sgl's own preprocess (bwd_sm80/preprocess.cu) in the collective's
// sign convention (FlashBwdArgs::negated: -D and -lse * log2(e)) instead of the collective's
// sum_OdO kernel, because jax_sgl's D subtracts dlse (a loss on the LSE) and maps a fully masked
// row's lse = -inf to P = 0; the collective's preprocess does neither.
//
// What stays elsewhere, and why (Sm100BwdUnsupported names it per call):
//   - varlen / seqused_k: the collective's VariableLength trusts cu_seqlens (no clamp to the
//     buffers), which jax_sgl's contract forbids; those calls run on the portable backward.
//   - window and softcap: the collective's mask hook (collective/fmha_fusion.hpp) has no local
//     mask for the backward, and softcap changes dS, which no hook reaches: portable backward.
//   - deterministic=True: the collective's dQ is a float32 TMA reduce-add (order not fixed):
//     portable backward, whose dQ kernel has no atomics.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "ffi/cuda/attention/common/device.h"
#include "ffi/cuda/attention/flash_bwd_launch.h"

namespace jax_sgl::cuda {

// nullptr when the sm100 backward covers the call, else what it lacks (the fallback decision).
const char* Sm100BwdUnsupported(const AttentionParams& p);

// Whether a covered call runs on it: the device is compute capability 10.0, the only one
// sm_100a SASS runs on, and JAX_SGL_DISABLE does not name sm100_bwd (p.disable).
bool Sm100BwdEnabled(const AttentionParams& p, const DeviceInfo& dev);

// Rows of the dQ accumulator per (batch, head): seqlen_q rounded up to the convert kernel's 8.
inline int Sm100BwdDqAccumRows(const AttentionParams& p) { return (p.seqlen_q + 7) / 8 * 8; }

// Float32 elements of the dQ accumulator: [batch, num_heads, Sm100BwdDqAccumRows, head_dim]
// (the convert kernel's layout).
size_t Sm100BwdDqAccumFloats(const AttentionParams& p);

// The backward instantiations this build holds (" hdim128_bf16 ..."; leading space).
const char* Sm100BwdBuiltKernels();

// Runs dK/dV and dQ (zeroing dq_accum first, converting it into dq after). args: the workspace
// LaunchFlashBwdPreprocess filled with args.negated set, ws_rows == seqlen_q.
cudaError_t RunFlashBwdSm100(const FlashBwdArgs& args, float* dq_accum, cudaStream_t stream);

// One instantiation per (storage type, head dim), in instantiations/sm100_bwd_*.cu.
template <typename T, int kHeadDim>
cudaError_t LaunchFlashBwdSm100(const FlashBwdArgs& args, float* dq_accum, cudaStream_t stream);

}  // namespace jax_sgl::cuda
