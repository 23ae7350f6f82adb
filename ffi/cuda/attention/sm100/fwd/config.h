// Compile-time choice of the sm_100a flash forward for one (dtype, head dim): CUTLASS's Blackwell
// FMHA collectives (examples/77_blackwell_fmha of the nvidia-cutlass wheel, on the include path
// cmake/cuda.cmake sets) assembled with jax_sgl's strides, problem shapes and masks.
//
// Tile: 256 q rows x 128 keys x head dim, the two 128-row halves stacked on the q axis
// (ThreadShape 2x1x1, one softmax warpgroup each) so a K/V tile loaded once serves both: the
// collective's choice for hd 64 and 128 in fp16/bf16 (its example runs exactly these, and its
// TMEM plan, S 2 x 128 + O 2 x 128 columns, is sized for head dims up to 128). Larger head dims
// do not fit that TMEM plan and run on the portable kernel (dispatch.cc).
#pragma once

#include <cute/tensor.hpp>

#include "collective/fmha_fusion.hpp"
#include "collective/sm100_fmha_fwd_epilogue_tma_warpspecialized.hpp"
#include "collective/sm100_fmha_fwd_mainloop_tma_warpspecialized.hpp"
#include "kernel/fmha_tile_scheduler.hpp"
#include "kernel/sm100_fmha_fwd_kernel_tma_warpspecialized.hpp"

#include "ffi/cuda/attention/sm100/fwd/varlen_tile_scheduler.hpp"

namespace jax_sgl::cuda::sm100 {

using cute::_0;
using cute::_1;
using cutlass::fmha::collective::VariableLength;

// Strides of Q / O [rows, head_dim, ((group, kv heads), batch)]: a q head h = kv head * group +
// r of the group, so (r, kv head) strides (head, group * head) address it.
using StrideQ = cute::tuple<int, _1, cute::tuple<cute::tuple<int, int>, int>>;
// K / V [rows, head_dim, ((group, kv heads), batch)]: stride 0 over the group (GQA).
using StrideKv = cute::tuple<int, _1, cute::tuple<cute::tuple<_0, int>, int>>;
// LSE [q rows, ((group, kv heads), batch)] (jax_sgl's dense [batch, heads, seqlen_q] or varlen
// [heads, total_q] layout, attention_params.h).
using StrideLse = cute::tuple<_1, cute::tuple<cute::tuple<int, int>, int>>;

// (q rows, keys, head dim, ((group, kv heads), batch)); varlen rows carry the cumulative lengths.
using DenseShape = cute::tuple<int, int, int, cute::tuple<cute::tuple<int, int>, int>>;
using VarlenShape =
    cute::tuple<VariableLength, VariableLength, int, cute::tuple<cute::tuple<int, int>, int>>;

inline constexpr int kFwdTileRows = 256;
template <int kHeadDim>
using FwdTile = cute::Shape<cute::Int<kFwdTileRows>, cute::_128, cute::Int<kHeadDim>>;

// The kernel of one (element type, head dim, problem shape, mask, tile scheduler): the
// collective's TMA warp-specialized mainloop (load, tcgen05 MMA into TMEM, two softmax warpgroups,
// correction) and TMA-store epilogue, one CTA per (256-row q tile, q head, sequence). Dense calls
// take the collectives' IndividualTileScheduler (no workspace, no atomic tile counter; grid y/z
// take heads and batch), varlen calls VarlenTileScheduler (varlen_tile_scheduler.hpp).
template <typename E, int kHeadDim, typename Shape, typename Mask,
          typename Scheduler = cutlass::fmha::kernel::IndividualTileScheduler>
struct FwdKernel {
  using Mainloop = cutlass::fmha::collective::Sm100FmhaFwdMainloopTmaWarpspecialized<
      E, float, float, FwdTile<kHeadDim>, StrideQ, StrideKv, StrideKv, Mask>;
  using Epilogue = cutlass::fmha::collective::Sm100FmhaFwdEpilogueTmaWarpspecialized<
      E, float, typename Mainloop::TileShapePV, StrideQ, StrideLse>;
  using Kernel = cutlass::fmha::kernel::Sm100FmhaFwdKernelTmaWarpspecialized<
      Shape, Mainloop, Epilogue, Scheduler>;
};

}  // namespace jax_sgl::cuda::sm100
