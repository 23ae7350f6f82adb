// BwdKernelParams of one call, for both shapes of the sm_90a backward's dK/dV kernel (config.h's
// FlashBwdSm90Kernel and wide_config.h's FlashBwdSm90WideKernel): TMA descriptors over the dense
// [batch, seq, heads, head_dim] tensors (K / V / dK / dV in boxes of KVBox, one consumer's half
// or the whole tile) and the call's scalars; `varlen` (the kVarlen instantiations) views them all
// as packed rows [total, head_dim, heads, 1] (Sm90BwdViewRows). Host code; included by the
// launchers.
#pragma once

#include "ffi/cuda/attention/flash_bwd_launch.h"
#include "ffi/cuda/attention/sm90/bwd/kernel.cuh"
#include "ffi/cuda/attention/sm90/fwd/launch.cuh"  // DenseTensor

namespace jax_sgl::cuda::sm90 {

// Grid fields of BwdKernelParams (kernel.cuh): the tail split, {n_blocks, n_blocks, 0, nullptr,
// nullptr} (every block whole) when off, and the causal launch order (0: the grid's own).
struct BwdGridFields {
  int n_blocks;
  int num_whole;
  int tail_splits;
  float* tail_dk;
  float* tail_dv;
  int section_heads = 0;
};

template <typename Cfg, typename KVBox>
BwdKernelParams<Cfg> MakeBwdKernelParams(const FlashBwdArgs& args, float* dq_accum,
                                         const BwdGridFields& grid, bool varlen = false) {
  constexpr int kD = Cfg::kHeadDim;
  const AttentionBwdParams& bp = args.bp;
  const AttentionParams& p = bp.fwd;
  const BwdViewRows rows = Sm90BwdViewRows(p, varlen);
  auto q = DenseTensor<Cfg>(p.q, rows.q, kD, p.num_heads, rows.batch);
  auto dout = DenseTensor<Cfg>(bp.dout, rows.q, kD, p.num_heads, rows.batch);
  auto k = DenseTensor<Cfg>(p.k, rows.k, kD, p.num_kv_heads, rows.batch);
  auto v = DenseTensor<Cfg>(p.v, rows.k, kD, p.num_kv_heads, rows.batch);
  auto dk = DenseTensor<Cfg>(bp.dk, rows.k, kD, p.num_kv_heads, rows.batch);
  auto dv = DenseTensor<Cfg>(bp.dv, rows.k, kD, p.num_kv_heads, rows.batch);
  using RowsTile = typename Cfg::SmemLayoutRowsTile;
  return BwdKernelParams<Cfg>{
      make_tma_copy(SM90_TMA_LOAD{}, q, RowsTile{}, typename Cfg::RowsD{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, dout, RowsTile{}, typename Cfg::RowsD{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, k, KVBox{}, typename Cfg::KeysD{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, v, KVBox{}, typename Cfg::KeysD{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, dk, KVBox{}, typename Cfg::KeysD{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, dv, KVBox{}, typename Cfg::KeysD{}, _1{}),
      q.shape(),
      k.shape(),
      args.lse_log2,
      bp.softmax_d,
      dq_accum,
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
      grid.n_blocks,
      grid.num_whole,
      grid.tail_splits,
      grid.tail_dk,
      grid.tail_dv,
      grid.section_heads,
      p.cu_seqlens_q,
      p.kv_layout == KvLayout::kVarlen ? p.cu_seqlens_k : nullptr,
      int(p.total_q),
      int(p.total_k),
      p.batch,
      static_cast<typename Cfg::Element*>(bp.dk),
      static_cast<typename Cfg::Element*>(bp.dv),
  };
}

}  // namespace jax_sgl::cuda::sm90
