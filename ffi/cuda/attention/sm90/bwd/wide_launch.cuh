// Host launcher of the sm_90a flash attention backward for the wide head dims (192, 256;
// wide_kernel.cuh): TMA descriptors for one call, then zero dq_accum, the dK/dV kernel (+ dQ
// reductions) with one CTA per (64 keys, kv head, batch), and the dQ convert. No tail split (its
// scratch is sized for config.h's 128-key blocks) and no deterministic dQ (Sm90BwdUnsupported
// keeps those calls off this kernel). Included by launch.cuh.
#pragma once

#include "ffi/cuda/attention/common/launch.cuh"
#include "ffi/cuda/attention/sm90/bwd/launch.h"
#include "ffi/cuda/attention/sm90/bwd/wide_kernel.cuh"
#include "ffi/cuda/attention/sm90/fwd/launch.cuh"  // CutlassType, DenseTensor

namespace jax_sgl::cuda::sm90 {

template <typename T, int kHeadDim>
cudaError_t LaunchFlashBwdSm90Wide(const FlashBwdArgs& args, float* dq_accum,
                                   cudaStream_t stream) {
  using Cfg = BwdWideConfig<typename CutlassType<T>::type, kHeadDim>;
  const AttentionBwdParams& bp = args.bp;
  const AttentionParams& p = bp.fwd;
  if (dq_accum == nullptr) return cudaErrorInvalidValue;  // deterministic: not served here
  auto q = DenseTensor<Cfg>(p.q, p.seqlen_q, kHeadDim, p.num_heads, p.batch);
  auto dout = DenseTensor<Cfg>(bp.dout, p.seqlen_q, kHeadDim, p.num_heads, p.batch);
  auto k = DenseTensor<Cfg>(p.k, p.seqlen_k, kHeadDim, p.num_kv_heads, p.batch);
  auto v = DenseTensor<Cfg>(p.v, p.seqlen_k, kHeadDim, p.num_kv_heads, p.batch);
  auto dk = DenseTensor<Cfg>(bp.dk, p.seqlen_k, kHeadDim, p.num_kv_heads, p.batch);
  auto dv = DenseTensor<Cfg>(bp.dv, p.seqlen_k, kHeadDim, p.num_kv_heads, p.batch);
  using RowsTile = typename Cfg::SmemLayoutRowsTile;
  using KVTile = typename Cfg::SmemLayoutKVTile;
  const int m_blocks = args.ws_rows / Cfg::kBlockM;
  const int n_blocks = (p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const int num_blocks = n_blocks * p.num_kv_heads * p.batch;
  BwdKernelParams<Cfg> params{
      make_tma_copy(SM90_TMA_LOAD{}, q, RowsTile{}, typename Cfg::RowsD{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, dout, RowsTile{}, typename Cfg::RowsD{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, k, KVTile{}, typename Cfg::KeysD{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, v, KVTile{}, typename Cfg::KeysD{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, dk, KVTile{}, typename Cfg::KeysD{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, dv, KVTile{}, typename Cfg::KeysD{}, _1{}),
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
      n_blocks,
      num_blocks,  // num_whole: no tail split
      0,
      nullptr,
      nullptr,
  };
  cudaError_t err = cudaMemsetAsync(
      dq_accum, 0, Sm90BwdDqAccumFloats(p, args.ws_rows) * sizeof(float), stream);
  if (err != cudaSuccess) return err;
  auto kernel = p.softcap > 0.f ? FlashBwdSm90WideKernel<Cfg, true>
                                : FlashBwdSm90WideKernel<Cfg, false>;
  if ((err = LaunchWithSmem(kernel, dim3(n_blocks, p.num_kv_heads, p.batch), Cfg::kThreads,
                            sizeof(typename Cfg::SharedStorage), stream, params)) != cudaSuccess)
    return err;
  FlashBwdSm90DqConvertKernel<Cfg><<<dim3(m_blocks, p.num_heads, p.batch), 256, 0, stream>>>(
      dq_accum, static_cast<typename Cfg::Element*>(bp.dq), p.seqlen_q, p.num_heads, m_blocks,
      p.softmax_scale);
  return cudaGetLastError();
}

}  // namespace jax_sgl::cuda::sm90
