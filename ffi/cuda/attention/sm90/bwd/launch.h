// Host contract of the sm_90a flash attention backward (wgmma + TMA, warp-specialized;
// sm90/bwd/kernel.cuh). No CUDA kernel syntax: bwd_dispatch.cc includes it.
//
// The sm90 backward replaces the sm80 dK/dV kernel and the sm80 dQ kernel: dQ comes from float32
// reductions into a workspace plus a convert kernel (default, not bitwise reproducible), or,
// with deterministic=True (AttentionParams::deterministic), from a separate sm90 dQ kernel
// without atomics. The kernels read the workspace
// the shared preprocess kernel writes (bwd_sm80/preprocess.cu), laid out [batch, num_heads,
// ws_rows] with ws_rows = seqlen_q rounded up to Sm90BwdRowBlock(), so each step's row values
// are one in-bounds bulk copy.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "ffi/cuda/attention/common/device.h"
#include "ffi/cuda/attention/flash_bwd_launch.h"

namespace jax_sgl::cuda {

// nullptr when the sm90 backward covers the call, else what it lacks (the fallback decision).
const char* Sm90BwdUnsupported(const AttentionParams& p);

// Whether a covered call runs on it: compute capability 9.0, unless JAX_SGL_DISABLE names
// sm90_bwd (p.disable).
bool Sm90BwdEnabled(const AttentionParams& p, const DeviceInfo& dev);

// Query rows per step of the kernel for p's head dim: the workspace's row padding.
int Sm90BwdRowBlock(const AttentionParams& p);

// Varlen q: rows per head of the padded workspace (flash_bwd_launch.h PaddedSeqRow0), every
// sequence's row blocks below total_q + batch x the row block.
int Sm90BwdVarlenWsRows(const AttentionParams& p);

// Float32 elements of the dQ accumulation buffer: [batch, num_heads, ws_rows, head_dim] (varlen
// q: [num_heads, ws_rows, head_dim]).
size_t Sm90BwdDqAccumFloats(const AttentionParams& p, int ws_rows);
// Whether a call takes the tail split: one without causal mask, window, seqused_k or softcap,
// whose key blocks all cost the same (measured +1-2% forward+backward). The key blocks of the
// last, partial wave then run as shares of their steps on every SM.
bool Sm90BwdTailSplitRequested(const AttentionParams& p);
// Scratch bytes of the tail split's float32 dK / dV shares: one 128-key block per SM each
// (0 when the device's SM count cannot be read).
size_t Sm90BwdTailBytes(const AttentionParams& p, int num_sms);

// The backward instantiations this build holds (" hdim128_bf16 ..."; leading space).
const char* Sm90BwdBuiltKernels();

// Runs the sm90 dK/dV kernel and dQ: with dq_accum != nullptr (Sm90BwdDqAccumFloats floats)
// through its float32 reductions (zeroing dq_accum first, converting it after), else with
// dq_kernel by the deterministic sm90 dQ kernel, else not at all (the caller runs the sm80 dQ
// kernel). args.ws_rows must be a multiple of Sm90BwdRowBlock(p) and the workspace filled by
// LaunchFlashBwdPreprocess.
cudaError_t RunFlashBwdSm90(const FlashBwdArgs& args, float* dq_accum, bool dq_kernel,
                            cudaStream_t stream);

// One instantiation per (storage type, head dim), in instantiations/sm90_bwd_*.cu.
template <typename T, int kHeadDim>
cudaError_t LaunchFlashBwdSm90(const FlashBwdArgs& args, float* dq_accum, bool dq_kernel,
                               cudaStream_t stream);

}  // namespace jax_sgl::cuda
