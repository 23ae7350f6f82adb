// Compile-time shape of the sm_90a deterministic dQ kernel (bwd_dq_kernel.cuh) for one (dtype,
// head dim): the forward's CTA shape with the backward's math. CTA = 3 warpgroups over 128 query
// rows of one (q head, batch): warpgroup 0 loads (TMA), warpgroups 1 and 2 own 64 rows each and
// walk the visible key tiles computing, rows as M,
//   S = Q K^T,  dP = dO V^T            (SS wgmma)
//   P = exp2(S scale log2e - lse2),  dS = P (dP - D)
//   dQ += dS K                          (RS wgmma: dS from registers, K read transposed)
// dQ stays in registers; every dQ row is written once, by one CTA: no atomics.
// Head dims 192 / 256 (the deterministic mode of the wide backward) take 32-key tiles: dQ is then
// 128 floats per thread at hd256, beside S, dP (16 each) and the dS operand (8).
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "ffi/cuda/attention/sm90/gmem_view.h"

namespace jax_sgl::cuda::sm90 {

using namespace cute;

template <typename Element_, int kHeadDim_>
struct BwdDqConfig {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 192 ||
                kHeadDim == 256);

  static constexpr int kWarpgroupRows = 64;
  static constexpr int kConsumers = 2;
  static constexpr int kBlockM = kWarpgroupRows * kConsumers;
  // Keys per tile: S and dP take kBlockN / 2 float registers each, dQ kHeadDim / 2 and the dS
  // operand kBlockN / 4: 64 keys keep hd128 at 32 + 32 + 64 + 16 (room to spare under 240);
  // hd256 takes 32 keys: 16 + 16 + 128 + 8.
  static constexpr int kBlockN = kHeadDim > 128 ? 32 : 64;
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  using RowsD = Shape<Int<kWarpgroupRows>, Int<kHeadDim>>;
  using KeysD = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileS = Shape<Int<kWarpgroupRows>, Int<kBlockN>, Int<kHeadDim>>;   // S = Q K^T
  using TileDq = Shape<Int<kWarpgroupRows>, Int<kHeadDim>, Int<kBlockN>>;  // dQ += dS K

  using MmaS = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Element, Element, float, TileS>()));
  using MmaDq = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<Element, Element, float, TileDq, GMMA::Major::K,
                                 GMMA::Major::MN>()));

  // 128-byte atoms (64 features) where they tile the head dim, 64-byte ones at hd96.
  using SwizzleAtom = std::conditional_t<kHeadDim % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
                                         GMMA::Layout_K_SW64_Atom<Element>>;
  // Q and dO: [64 rows, head dim, consumer] (one TMA box per half); dQ reuses the Q half.
  using SmemLayoutRowsHalf = decltype(tile_to_shape(SwizzleAtom{}, RowsD{}));
  using SmemLayoutRows = decltype(tile_to_shape(
      SwizzleAtom{}, Shape<Int<kWarpgroupRows>, Int<kHeadDim>, Int<kConsumers>>{}));
  // K and V: [keys, head dim, stage]; K also as the B operand of dQ += dS K: [head dim, keys].
  using SmemLayoutKVTile = decltype(tile_to_shape(SwizzleAtom{}, KeysD{}));
  using SmemLayoutKV = decltype(tile_to_shape(
      SwizzleAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                  Stride<Int<kBlockN>, _1, Int<kBlockN * kHeadDim>>{})));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;  // one stage = a K tile and a V tile

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutRows>> q;  // dQ at the end
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutRows>> dout;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> v;
    typename Pipeline::SharedStorage pipe_kv;
    cutlass::arch::ClusterTransactionBarrier barrier_rows;
  };

  static constexpr int kRowsHalfBytes = kWarpgroupRows * kHeadDim * sizeof(Element);
  static constexpr int kKVTileBytes = kBlockN * kHeadDim * sizeof(Element);

  // Global tensors as TMA sees them (gmem_view.h).
  using GmemShape = sm90::GmemShape;
  using GmemTensor = GmemTensorOf<Element>;
  using TmaRows = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutRowsHalf{},
                                         RowsD{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKVTile{},
                                       KeysD{}, _1{}));
  using TmaRowsStore = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensor{},
                                              SmemLayoutRowsHalf{}, RowsD{}, _1{}));
};

}  // namespace jax_sgl::cuda::sm90
