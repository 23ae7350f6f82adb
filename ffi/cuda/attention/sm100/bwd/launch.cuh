// Host launcher of the sm_100a flash attention backward: fills the arguments of CUTLASS's Blackwell
// FMHA backward collective (dK/dV kernel and dQ convert kernel, 77_blackwell_fmha) from jax_sgl's
// params and launches them. Included only by the generated instantiations/sm100_bwd_*.cu files.
//
// Layouts (dense only, Sm100BwdUnsupported): the collective's modes are (rows, features, ((group
// head, kv head), batch)); jax_sgl's q/out/dq are [batch, seqlen_q, heads, D] and k/v/dk/dv
// [batch, seqlen_k, kv heads, D], so q head h = kv head * group + group head is stride D on the
// group mode and group * D on the kv head mode; K/V take stride 0 on the group mode, which is how
// the collective sums dK / dV over a GQA group (its CTA walks every group head of its kv head).
// lse-shaped rows (the preprocess's -D and -lse * log2(e)) are [batch, heads, seqlen_q].
// Masks: bottom-right causal is CausalForBackwardMask<false> (key j of row i kept when
// j <= i + seqlen_k - seqlen_q, jax_sgl's definition); otherwise ResidualMaskForBackward, which
// masks the keys past seqlen_k in the last, partial key tile.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/arch.h>
#include <cutlass/device_kernel.h>
#include <cutlass/kernel_hardware_info.hpp>

#include "ffi/cuda/attention/common/cutlass_type.h"
#include "ffi/cuda/attention/sm100/common/run_kernel.cuh"
#include "ffi/cuda/attention/sm100/bwd/launch.h"
// The collective's headers rely on CuTe, the arch tags and the masks being declared first, and
// the convert kernel on the names the dK/dV kernel's header brings into its namespace (the order
// of the collective's own device/fmha_device_bwd.hpp).
#include "collective/fmha_fusion.hpp"
#include "device/fmha.hpp"
#include "kernel/sm100_fmha_bwd_kernel_tma_warpspecialized.hpp"
#include "kernel/fmha_kernel_bwd_convert.hpp"

namespace jax_sgl::cuda {
namespace sm100_bwd {

using namespace cute;

// (seqlen_q, seqlen_k, head_dim, head_dim_v, ((group, kv heads), batch)).
using ProblemShape = cute::tuple<int, int, int, int, cute::tuple<cute::tuple<int, int>, int>>;
using StrideQ = cute::tuple<int, _1, cute::tuple<cute::tuple<int, int>, int>>;
using StrideKv = cute::tuple<int, _1, cute::tuple<cute::tuple<_0, int>, int>>;
using StrideRow = cute::tuple<_1, cute::tuple<cute::tuple<int, int>, int>>;

// 128 x 128 (query rows x keys) is the one tile the collective takes (its static_asserts).
template <typename E, int kHeadDim, class Mask>
using DkDvKernel = cutlass::fmha::kernel::Sm100FmhaBwdKernelTmaWarpSpecialized<
    ProblemShape, E, float, Shape<_128, _128, Int<kHeadDim>, Int<kHeadDim>>, Mask>;
template <typename E>
using ConvertKernel = cutlass::fmha::kernel::FmhaKernelBwdConvert<ProblemShape, E, float>;


template <typename E, int kHeadDim, class Mask>
cudaError_t Launch(const FlashBwdArgs& a, float* dq_accum, cudaStream_t stream) {
  const AttentionBwdParams& bp = a.bp;
  const AttentionParams& p = bp.fwd;
  const int group = a.group;
  const int d = kHeadDim;
  const ProblemShape shape{p.seqlen_q, p.seqlen_k, d, d,
                           {{group, p.num_kv_heads}, p.batch}};
  const int q_row = p.num_heads * d;
  const StrideQ q_stride{q_row, _1{}, {{d, group * d}, p.seqlen_q * q_row}};
  const int k_row = p.num_kv_heads * d;
  const StrideKv kv_stride{k_row, _1{}, {{_0{}, d}, p.seqlen_k * k_row}};
  // The preprocess's workspace: [batch, heads, ws_rows] with ws_rows == seqlen_q.
  const StrideRow row_stride{_1{}, {{a.ws_rows, a.ws_rows * group}, a.ws_rows * p.num_heads}};
  const int acc_rows = Sm100BwdDqAccumRows(p);
  const StrideQ acc_stride{d, _1{}, {{acc_rows * d, acc_rows * d * group},
                                     acc_rows * d * p.num_heads}};

  using DkDv = DkDvKernel<E, kHeadDim, Mask>;
  typename DkDv::Arguments args{
      shape,
      {static_cast<const E*>(p.q), q_stride,
       static_cast<const E*>(p.k), kv_stride,
       static_cast<const E*>(p.v), kv_stride,
       static_cast<const E*>(bp.dout), q_stride,
       a.lse_log2, row_stride,
       bp.softmax_d, row_stride,
       dq_accum, acc_stride,
       p.softmax_scale},
      {static_cast<E*>(bp.dk), kv_stride, static_cast<E*>(bp.dv), kv_stride},
      cutlass::KernelHardwareInfo{}};

  // dQ arrives by float32 TMA reduce-adds from every key block: start from zero.
  const size_t acc_bytes = size_t(p.batch) * p.num_heads * acc_rows * d * sizeof(float);
  if (cudaError_t err = cudaMemsetAsync(dq_accum, 0, acc_bytes, stream); err != cudaSuccess)
    return err;
  if (cudaError_t err = sm100::RunKernel<DkDv>(args, stream); err != cudaSuccess) return err;

  // The collective accumulates dQ unscaled; the convert applies softmax_scale as it narrows.
  using Convert = ConvertKernel<E>;
  typename Convert::Arguments convert{
      shape,
      dq_accum, acc_stride,
      nullptr, kv_stride,
      nullptr, kv_stride,
      static_cast<E*>(bp.dq), q_stride,
      nullptr, kv_stride,
      nullptr, kv_stride,
      p.softmax_scale};
  return sm100::RunKernel<Convert>(convert, stream);
}

}  // namespace sm100_bwd

template <typename T, int kHeadDim>
cudaError_t LaunchFlashBwdSm100(const FlashBwdArgs& args, float* dq_accum, cudaStream_t stream) {
  using E = typename CutlassType<T>::type;
  using namespace cutlass::fmha::collective;
  return args.bp.fwd.causal
             ? sm100_bwd::Launch<E, kHeadDim, CausalForBackwardMask<false>>(args, dq_accum, stream)
             : sm100_bwd::Launch<E, kHeadDim, ResidualMaskForBackward>(args, dq_accum, stream);
}

}  // namespace jax_sgl::cuda

// Instantiates one (storage type T, head dim D) of the launchers above (instantiations/).
#define JAX_SGL_INSTANTIATE_SM100_BWD(T, D)                                                  \
  namespace jax_sgl::cuda {                                                                  \
  template cudaError_t LaunchFlashBwdSm100<T, D>(const FlashBwdArgs&, float*, cudaStream_t); \
  }
