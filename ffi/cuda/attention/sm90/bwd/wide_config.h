// Compile-time shape of the sm_90a flash attention backward for the wide head dims (192, 256):
// tiles, shared memory layouts and the four warpgroup MMAs, as CuTe types (wide_kernel.cuh runs
// them). hd64 / hd96 / hd128 keep config.h's shape: this one exists because at hd256 that shape's
// per-thread dK + dV (2 x 128 floats for 64 keys x 256 features) exceeds the 240 registers.
//
// CTA = 3 warpgroups over 64 keys of one (kv head, batch): warpgroup 0 loads (TMA); warpgroups 1
// and 2 split the HEAD DIM of dK and dV (each holds dK[64 keys, D / 2] and dV[64, D / 2]: 64 + 64
// floats per thread at hd256) and the query rows of the score tiles. Per step of 64 query rows:
//   S^T = K Q^T, dP^T = V dO^T         each consumer its 32 rows: [64 keys, 32 rows] over all D
//   P^T, dS^T -> smem                   both consumers need all 64 rows of them next
//   dV[:, half] += P^T dO[:, half]      (SS wgmma, P^T from smem)
//   dK[:, half] += dS^T Q[:, half]      (SS wgmma)
//   dQ[:, half]  = dS K[:, half]        (SS wgmma, [64 rows, D / 2] per consumer: 64 floats)
// and the dQ part is added to dq_accum with vector reductions, as in config.h's kernel.
// Registers per consumer thread at hd256: dK 64 + dV 64 + dQ 64 (+ S^T, dP^T 16 each, dead by
// the time dQ is live). Shared memory at hd256: K, V 32 KiB each, Q and dO 2 stages x 32 KiB
// each, P^T and dS^T 2 buffers x 8 KiB each: 224 KiB of the 227.
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
struct BwdWideConfig {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 192 || kHeadDim == 256, "the wide sm90 backward: head dims 192, 256");

  static constexpr int kConsumers = 2;
  static constexpr int kBlockN = 64;  // keys per CTA (wgmma M of the key-major GEMMs)
  static constexpr int kBlockM = 64;  // query rows per step
  static constexpr int kHalf = kHeadDim / kConsumers;       // features per consumer
  static constexpr int kScoreRows = kBlockM / kConsumers;  // score rows per consumer
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;  // (24 + 2 * 240) * 128 <= 65536

  // The dq_accum unit of one consumer (DqAccumIndex order within it): its [64 rows, kHalf]
  // columns of the dQ tile. The convert kernel reads these names.
  static constexpr int kDqSplitM = 1;
  static constexpr int kDqSplitN = kConsumers;
  static constexpr int kDqRows = kBlockM;
  static constexpr int kDqCols = kHalf;
  static constexpr int kDqPartFloats = kDqRows * kDqCols;

  using KeysD = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using RowsD = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using KeysHalf = Shape<Int<kBlockN>, Int<kHalf>>;
  using TileSdP = Shape<Int<kBlockN>, Int<kScoreRows>, Int<kHeadDim>>;  // S^T = K Q^T
  using TileKV = Shape<Int<kBlockN>, Int<kHalf>, Int<kBlockM>>;         // dV += P^T dO
  using TileDq = Shape<Int<kBlockM>, Int<kHalf>, Int<kBlockN>>;         // dQ = dS K

  // S^T and dP^T: K / V rows and Q / dO rows, all K-major (head dim contiguous).
  using MmaSdP = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Element, Element, float, TileSdP>()));
  // dV and dK: P^T / dS^T from smem stored row-contiguous (K-major); dO / Q read transposed
  // (head dim = N contiguous).
  using MmaKV = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Element, Element, float, TileKV, GMMA::Major::K,
                                 GMMA::Major::MN>()));
  // dQ: dS through the transposed view of the same smem (query rows contiguous: MN-major), K
  // read transposed (MN-major).
  using MmaDq = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Element, Element, float, TileDq, GMMA::Major::MN,
                                 GMMA::Major::MN>()));

  // Q, dO, K and V: a consumer's feature half is read transposed (MN-major B operand of dV / dK
  // / dQ), so it must hold whole swizzle atoms: 128-byte ones at hd256 (128 features = 2 atoms),
  // 64-byte ones at hd192 (96 = 3 atoms of 32; the 128-byte atom's 64 would split).
  using SwizzleAtom = std::conditional_t<kHalf % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
                                         GMMA::Layout_K_SW64_Atom<Element>>;
  // K and V: [64 keys, head dim, 1]: one TMA tile each, loaded and (as dK, dV) stored by the
  // same descriptor.
  using SmemLayoutKVTile = decltype(tile_to_shape(SwizzleAtom{}, KeysD{}));
  using SmemLayoutKV = decltype(tile_to_shape(
      SwizzleAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, _1>{}));
  // K as the B operand of dQ = dS K: [head dim, 64 keys] over the same bytes.
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{},
                                  Stride<Int<kBlockN>, _1>{})));
  // Q and dO: [rows, head dim, stage], and transposed [head dim, rows, stage] for dK and dV.
  using SmemLayoutRowsTile = decltype(tile_to_shape(SwizzleAtom{}, RowsD{}));
  using SmemLayoutRows = decltype(tile_to_shape(
      SwizzleAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutRowsT = decltype(composition(
      SmemLayoutRows{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                    Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  // P^T and dS^T: [64 keys, 64 rows, buffer], rows contiguous (written from the S^T / dP^T
  // accumulators, the A operand of dV / dK); dS [rows, keys, buffer] is the transposed view for
  // dQ. Two buffers: a consumer may write step j + 1's while the other still reads step j's (the
  // per-step barrier orders everything else).
  using SmemLayoutPt = decltype(tile_to_shape(
      GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kBlockN>, Int<kBlockM>, _2>{}));
  using SmemLayoutDs = decltype(composition(
      SmemLayoutPt{}, make_layout(Shape<Int<kBlockM>, Int<kBlockN>, _2>{},
                                  Stride<Int<kBlockN>, _1, Int<kBlockM * kBlockN>>{})));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;  // dK at the end
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> v;  // dV at the end
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutRows>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutRows>> dout;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutPt>> p;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutPt>> ds;
    alignas(16) float lse2[kStages][kBlockM];  // lse * log2(e) of the Q stage's rows
    alignas(16) float dsum[kStages][kBlockM];  // D = rowsum(dO O) - dlse of the dO stage's rows
    typename Pipeline::SharedStorage pipe_q;
    typename Pipeline::SharedStorage pipe_do;
    cutlass::arch::ClusterTransactionBarrier barrier_kv;
  };

  // 227 KiB of dynamic smem per CTA on sm_90.
  static_assert(sizeof(SharedStorage) <= 227 * 1024);

  static constexpr int kKVTileBytes = kBlockN * kHeadDim * sizeof(Element);
  static constexpr int kRowsTileBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr int kRowFloatsBytes = kBlockM * sizeof(float);

  // Global tensors as TMA sees them (gmem_view.h).
  using GmemShape = sm90::GmemShape;
  using GmemTensor = GmemTensorOf<Element>;
  using TmaRows = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutRowsTile{},
                                         RowsD{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKVTile{},
                                       KeysD{}, _1{}));
  using TmaKVStore = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensor{}, SmemLayoutKVTile{},
                                            KeysD{}, _1{}));
};

}  // namespace jax_sgl::cuda::sm90
