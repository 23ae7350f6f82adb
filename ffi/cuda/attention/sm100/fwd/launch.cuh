// Host launcher of the sm_100a flash forward: fills the collectives' arguments from
// AttentionParams (strides, problem shape, scale, LSE layout) and launches the kernel config.h
// assembles. Included only by the generated instantiations/sm100_fwd_*.cu files.
//
// Dense calls take DenseShape; varlen calls (cu_seqlens_q and cu_seqlens_k) take VarlenShape,
// whose VariableLength rows the collectives turn into per-sequence offsets (TMA views of the packed
// buffers, batch stride 0). Masks: bottom-right causal is the collectives' CausalMask<false> (key j
// of query row i is kept when j <= i + keys - rows); a non-causal call takes ResidualMask, which
// masks only the keys past the end of the last, partial key tile (no cost when keys % 128 == 0).
#pragma once

#include <cutlass/device_kernel.h>

#include "ffi/cuda/attention/common/cutlass_type.h"
#include "ffi/cuda/attention/sm100/common/run_kernel.cuh"
#include "ffi/cuda/attention/sm100/fwd/config.h"
#include "ffi/cuda/attention/sm100/fwd/launch.h"
#include "ffi/cuda/attention/sm100/fwd/sinks.cuh"
#include "device/fmha.hpp"

namespace jax_sgl::cuda {
namespace sm100 {

// The collectives' arguments for one call of shape `shape` (dense or varlen); q_rows: the row
// extent of q that the LSE's head stride spans (seqlen_q dense, total_q varlen).
template <typename Kernel, typename E, typename Shape>
typename Kernel::Arguments MakeArguments(const AttentionParams& p, const Shape& shape,
                                         int q_rows, bool varlen) {
  using namespace cute;
  const int group = p.num_heads / p.num_kv_heads;
  const int q_row = p.num_heads * p.head_dim;
  const int o_row = p.num_heads * p.head_dim_v;
  // Varlen rows are addressed through the cumulative lengths: batch stride 0.
  const int batch_rows = varlen ? 0 : 1;
  StrideQ dq = make_stride(q_row, _1{}, make_stride(make_stride(p.head_dim, group * p.head_dim),
                                                    batch_rows * p.seqlen_q * q_row));
  StrideQ d_o = make_stride(o_row, _1{}, make_stride(make_stride(p.head_dim_v, group * p.head_dim_v),
                                                     batch_rows * p.seqlen_q * o_row));
  StrideKv dk = make_stride(int(p.k_row_stride), _1{},
                            make_stride(make_stride(_0{}, int(p.k_head_stride)),
                                        batch_rows * p.seqlen_k * int(p.k_row_stride)));
  StrideKv dv = make_stride(int(p.v_row_stride), _1{},
                            make_stride(make_stride(_0{}, int(p.v_head_stride)),
                                        batch_rows * p.seqlen_k * int(p.v_row_stride)));
  StrideLse dlse = make_stride(_1{}, make_stride(make_stride(q_rows, q_rows * group),
                                                 batch_rows * q_rows * p.num_heads));
  typename Kernel::Arguments args{
      shape,
      {{static_cast<const E*>(p.q), dq, static_cast<const E*>(p.k), dk,
        static_cast<const E*>(p.v), dv},
       p.softmax_scale},
      {static_cast<E*>(p.out), d_o, p.lse, dlse},
      cutlass::KernelHardwareInfo{}};
  return args;
}

// A varlen call: ResidualMask only (dispatch.cc keeps varlen causal off this kernel).
template <typename E, int kHeadDim>
cudaError_t LaunchVarlen(const AttentionParams& p, cudaStream_t stream) {
  using namespace cute;
  using Kernel = typename FwdKernel<E, kHeadDim, VarlenShape, cutlass::fmha::collective::ResidualMask,
                                    VarlenTileScheduler<kFwdTileRows>>::Kernel;
  // The collectives read the cumulative lengths as int*; they never write them. max_length (a
  // bound: total_q) sets the O store's row offsets; keys need only a bound.
  VarlenShape shape{VariableLength{p.seqlen_q, const_cast<int*>(p.cu_seqlens_q), int(p.total_q)},
                    VariableLength{int(p.total_k), const_cast<int*>(p.cu_seqlens_k), int(p.total_k)},
                    p.head_dim,
                    make_tuple(make_tuple(p.num_heads / p.num_kv_heads, p.num_kv_heads), p.batch)};
  return RunKernel<Kernel>(MakeArguments<Kernel, E>(p, shape, int(p.total_q), true), stream);
}

template <typename E, int kHeadDim, typename Mask>
cudaError_t LaunchDense(const AttentionParams& p, cudaStream_t stream) {
  using namespace cute;
  using Kernel = typename FwdKernel<E, kHeadDim, DenseShape, Mask>::Kernel;
  DenseShape shape{p.seqlen_q, p.seqlen_k, p.head_dim,
                   make_tuple(make_tuple(p.num_heads / p.num_kv_heads, p.num_kv_heads), p.batch)};
  return RunKernel<Kernel>(MakeArguments<Kernel, E>(p, shape, p.seqlen_q, false), stream);
}

}  // namespace sm100

// Three kernels per (dtype, head dim): dense ResidualMask and CausalMask<false>, varlen
// ResidualMask; then, with sinks, their pass over the finished rows (sinks.cuh).
template <typename T, int kHeadDim>
cudaError_t LaunchFlashFwdSm100(const AttentionParams& p, cudaStream_t stream) {
  using E = typename CutlassType<T>::type;
  namespace collective = cutlass::fmha::collective;
  cudaError_t err;
  if (p.cu_seqlens_q != nullptr)
    err = sm100::LaunchVarlen<E, kHeadDim>(p, stream);
  else if (p.causal)
    err = sm100::LaunchDense<E, kHeadDim, collective::CausalMask<false>>(p, stream);
  else
    err = sm100::LaunchDense<E, kHeadDim, collective::ResidualMask>(p, stream);
  if (err != cudaSuccess || p.sinks == nullptr) return err;
  return sm100::LaunchApplySinks<E>(p, stream);
}

}  // namespace jax_sgl::cuda

// Instantiates one (storage type T, head dim D) of the launchers above (instantiations/).
#define JAX_SGL_INSTANTIATE_SM100_FWD(T, D)                                             \
  namespace jax_sgl::cuda {                                                             \
  template cudaError_t LaunchFlashFwdSm100<T, D>(const AttentionParams&, cudaStream_t); \
  }
