// Host launcher of the sm_90a flash attention backward for the wide head dims (192, 256;
// wide_kernel.cuh): TMA descriptors for one call, then zero dq_accum, the dK/dV kernel (+ dQ
// reductions) with one CTA per (64 keys, kv head, batch), and the dQ convert; or, for the
// deterministic dQ, the dK/dV kernel alone and then dq_kernel.cuh's kernel with 32-key tiles
// (dq_config.h). No tail split (its scratch is sized for config.h's 128-key
// blocks). Varlen calls (cu_seqlens_q and cu_seqlens_k) run the kVarlen instantiation over the
// linear key blocks of all sequences, and the convert over the padded workspace's row blocks, as
// config.h's kernel does at 64 / 96 / 128. Included by launch.cuh.
#pragma once

#include "ffi/cuda/attention/common/launch.cuh"
#include "ffi/cuda/attention/sm90/bwd/dq_launch.cuh"
#include "ffi/cuda/attention/sm90/bwd/launch.h"
#include "ffi/cuda/attention/sm90/bwd/make_params.cuh"
#include "ffi/cuda/attention/sm90/bwd/wide_kernel.cuh"
#include "ffi/cuda/attention/sm90/fwd/launch.cuh"  // CutlassType

namespace jax_sgl::cuda::sm90 {

template <typename T, int kHeadDim>
cudaError_t LaunchFlashBwdSm90Wide(const FlashBwdArgs& args, float* dq_accum, bool dq_kernel,
                                   cudaStream_t stream) {
  using Cfg = BwdWideConfig<typename CutlassType<T>::type, kHeadDim>;
  const AttentionBwdParams& bp = args.bp;
  const AttentionParams& p = bp.fwd;
  // Exactly one dQ: reductions, or the deterministic kernel.
  if ((dq_accum == nullptr) != dq_kernel) return cudaErrorInvalidValue;
  // Varlen: cu_seqlens_q with cu_seqlens_k (Sm90BwdUnsupported).
  const bool varlen = p.cu_seqlens_q != nullptr;
  if (varlen != (args.ws_seq_align == Cfg::kBlockM) ||
      varlen != (p.kv_layout == KvLayout::kVarlen))
    return cudaErrorInvalidValue;
  const int m_blocks = args.ws_rows / Cfg::kBlockM;
  const int n_blocks = (p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
  // Varlen: the key blocks of all sequences, at most ceil(total_k / kBlockN) + batch (each
  // sequence adds at most one partial block).
  const int grid_x =
      varlen ? int((p.total_k + Cfg::kBlockN - 1) / Cfg::kBlockN) + p.batch : n_blocks;
  const auto params = MakeBwdKernelParams<Cfg, typename Cfg::SmemLayoutKVTile>(
      args, dq_accum, {n_blocks, n_blocks * p.num_kv_heads * p.batch, 0, nullptr, nullptr},
      varlen);
  cudaError_t err;
  if (dq_accum != nullptr &&
      (err = cudaMemsetAsync(dq_accum, 0, Sm90BwdDqAccumFloats(p, args.ws_rows) * sizeof(float),
                             stream)) != cudaSuccess)
    return err;
  const bool softcap = p.softcap > 0.f;
  auto kernel = softcap ? FlashBwdSm90WideKernel<Cfg, true, true>
                        : FlashBwdSm90WideKernel<Cfg, false, true>;
  if (!varlen)
    kernel = softcap ? FlashBwdSm90WideKernel<Cfg, true> : FlashBwdSm90WideKernel<Cfg, false>;
  if ((err = LaunchWithSmem(kernel, dim3(grid_x, p.num_kv_heads, varlen ? 1 : p.batch),
                            Cfg::kThreads, sizeof(typename Cfg::SharedStorage), stream,
                            params)) != cudaSuccess)
    return err;
  if (dq_kernel) return LaunchFlashBwdSm90Dq<T, kHeadDim>(args, stream);
  auto* dq = static_cast<typename Cfg::Element*>(bp.dq);
  if (varlen) {
    FlashBwdSm90DqConvertKernel<Cfg, true><<<dim3(m_blocks, p.num_heads, 1), 256, 0, stream>>>(
        dq_accum, dq, int(p.total_q), p.num_heads, m_blocks, p.softmax_scale, p.cu_seqlens_q,
        p.batch);
    return cudaGetLastError();
  }
  FlashBwdSm90DqConvertKernel<Cfg><<<dim3(m_blocks, p.num_heads, p.batch), 256, 0, stream>>>(
      dq_accum, dq, p.seqlen_q, p.num_heads, m_blocks, p.softmax_scale);
  return cudaGetLastError();
}

}  // namespace jax_sgl::cuda::sm90
