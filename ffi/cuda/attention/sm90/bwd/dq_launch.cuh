// Host launcher of the sm_90a deterministic dQ kernel (dq_kernel.cuh) for one call: TMA
// descriptors over the dense tensors, one CTA per (128 query rows, q head, batch); varlen
// (cu_seqlens_q with cu_seqlens_k) over the packed rows, one CTA per (linear 128-row block of all
// sequences, q head). Runs after a dK/dV kernel launched without dq_accum (config.h's, or
// wide_config.h's above hd128). Included by the launchers.
#pragma once

#include "ffi/cuda/attention/common/launch.cuh"
#include "ffi/cuda/attention/flash_bwd_launch.h"
#include "ffi/cuda/attention/sm90/bwd/dq_kernel.cuh"
#include "ffi/cuda/attention/sm90/fwd/launch.cuh"  // CutlassType, DenseTensor

namespace jax_sgl::cuda::sm90 {

template <typename T, int kHeadDim>
cudaError_t LaunchFlashBwdSm90Dq(const FlashBwdArgs& args, cudaStream_t stream) {
  using Cfg = BwdDqConfig<typename CutlassType<T>::type, kHeadDim>;
  const AttentionBwdParams& bp = args.bp;
  const AttentionParams& p = bp.fwd;
  const bool varlen = p.cu_seqlens_q != nullptr;
  if (varlen != (p.kv_layout == KvLayout::kVarlen) || varlen != (args.ws_seq_align > 0))
    return cudaErrorInvalidValue;
  const BwdViewRows rows = Sm90BwdViewRows(p, varlen);
  auto q = DenseTensor<Cfg>(p.q, rows.q, kHeadDim, p.num_heads, rows.batch);
  auto dout = DenseTensor<Cfg>(bp.dout, rows.q, kHeadDim, p.num_heads, rows.batch);
  auto dq = DenseTensor<Cfg>(bp.dq, rows.q, kHeadDim, p.num_heads, rows.batch);
  auto k = DenseTensor<Cfg>(p.k, rows.k, kHeadDim, p.num_kv_heads, rows.batch);
  auto v = DenseTensor<Cfg>(p.v, rows.k, kHeadDim, p.num_kv_heads, rows.batch);
  using RowsHalf = typename Cfg::SmemLayoutRowsHalf;
  using KVTile = typename Cfg::SmemLayoutKVTile;
  BwdDqKernelParams<Cfg> params{
      make_tma_copy(SM90_TMA_LOAD{}, q, RowsHalf{}, typename Cfg::RowsD{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, dout, RowsHalf{}, typename Cfg::RowsD{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, k, KVTile{}, typename Cfg::KeysD{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, v, KVTile{}, typename Cfg::KeysD{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, dq, RowsHalf{}, typename Cfg::RowsD{}, _1{}),
      q.shape(),
      k.shape(),
      args.lse_log2,
      bp.softmax_d,
      p.seqused_k,
      p.seqlen_q,
      p.seqlen_k,
      p.num_heads,
      p.num_heads / p.num_kv_heads,
      args.ws_rows,
      p.softmax_scale,
      p.softmax_scale * 1.4426950408889634f,
      p.softcap > 0.f ? p.softmax_scale / p.softcap : 0.f,
      p.softcap > 0.f ? p.softcap * 1.4426950408889634f : 0.f,
      p.window_left,
      p.window_right,
      p.cu_seqlens_q,
      varlen ? p.cu_seqlens_k : nullptr,
      int(p.total_q),
      int(p.total_k),
      p.batch,
      args.ws_seq_align,
      static_cast<typename Cfg::Element*>(bp.dq),
  };
  if (varlen) {
    // The row blocks of all sequences: at most ceil(total_q / kBlockM) + batch (each sequence
    // adds at most one partial block).
    const dim3 grid(int((p.total_q + Cfg::kBlockM - 1) / Cfg::kBlockM) + p.batch, p.num_heads, 1);
    return LaunchWithSmem(FlashBwdSm90DqKernel<Cfg, true>, grid, Cfg::kThreads,
                          sizeof(typename Cfg::SharedStorage), stream, params);
  }
  const dim3 grid((p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM, p.num_heads, p.batch);
  return LaunchWithSmem(FlashBwdSm90DqKernel<Cfg>, grid, Cfg::kThreads,
                        sizeof(typename Cfg::SharedStorage), stream, params);
}

}  // namespace jax_sgl::cuda::sm90
