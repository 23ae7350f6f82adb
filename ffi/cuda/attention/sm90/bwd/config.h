// Compile-time shape of the sm_90a flash attention backward for one (dtype, head dim): tiles,
// shared memory layouts and the four warpgroup MMAs, as CuTe types (bwd_kernel.cuh runs them).
//
// CTA = 3 warpgroups over 128 keys of one (kv head, batch): warpgroup 0 loads (TMA), warpgroups 1
// and 2 each own 64 of the keys and keep their dK, dV in registers for the whole CTA. Per step
// of kBlockM query rows (of one q head of the GQA group) each consumer computes, keys as M:
//   S^T = K Q^T,  dP^T = V dO^T          (SS wgmma, both operands in smem)
//   P^T = exp2(S^T scale log2e - lse2),  dS^T = P^T (dP^T - D)   (registers)
//   dV += P^T dO,  dK += dS^T Q           (RS wgmma: P^T and dS^T straight from registers)
// and, after both consumers have written their dS^T into smem, dQ_part = dS K over all 128 keys
// (SS wgmma; each consumer one half of the dQ tile), added to a float32 buffer with vector
// reductions (bwd_kernel.cuh). dK is issued after dQ, so it runs while the dQ part is reduced.
//
// hd96 runs on this shape, not wide_config.h's head-dim split: its dK + dV (96 floats) fit
// beside 64-row score tiles (96 + 64 + 24 dQ = 184 registers), and this shape keeps P^T / dS^T
// in registers (RS wgmma) and covers 128 keys per CTA, where the wide one writes both through
// smem and reloads Q / dO for every 64 keys. What 96 changes is the swizzle: 96 features are not
// whole 128-byte atoms (64 features), so Q / dO use 64-byte ones (3 of 32), and K / V 32-byte
// ones, because each consumer's dQ columns (K^T as wgmma's MN-major B operand, 48 features)
// must be whole atoms too (3 of 16). wgmma N = 96 and 48 need CUTE_SM90_EXTENDED_MMA_SHAPES.
//
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
struct BwdConfig {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128,
                "this shape of the sm90 backward serves head dims 64, 96, 128");

  static constexpr int kConsumers = 2;
  static constexpr int kWarpgroupKeys = 64;                   // wgmma M of the key-major GEMMs
  static constexpr int kBlockN = kWarpgroupKeys * kConsumers;  // keys per CTA
  // Query rows per step. Per consumer thread the float32 registers are dK + dV (kHeadDim), S^T
  // and dP^T (kBlockM / 2 each) and the dQ part (kBlockM * kHeadDim / 256): at hd128, 64 rows
  // give 128 + 64 + 32 = 224 under the 240 setmaxnreg grants; hd64 affords 128 rows (64 + 128 +
  // 32), which halves the q steps and their fixed costs; hd96 cannot (96 + 128 + 48).
  static constexpr int kBlockM = kHeadDim == 64 ? 128 : 64;
  // Q (and dO) tiles in flight: a third stage cost 1-3% forward+backward on the H200.
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;  // (24 + 2 * 240) * 128 <= 65536

  // dQ tile [kBlockM, kHeadDim] split between the consumers: by columns at hd128 (64 rows, wgmma
  // M = 64 takes them all), by rows at hd64 (128 rows). Each consumer's part is 64 x 64 (hd96:
  // 64 x 48).
  static constexpr int kDqSplitM = kBlockM / 64;
  static constexpr int kDqSplitN = kConsumers / kDqSplitM;
  static constexpr int kDqRows = kBlockM / kDqSplitM;
  static constexpr int kDqCols = kHeadDim / kDqSplitN;
  static_assert(kDqRows == 64 && kDqCols % 16 == 0);
  // Floats of one consumer's dQ part: the unit of the dq_accum layout (bwd_kernel.cuh).
  static constexpr int kDqPartFloats = kDqRows * kDqCols;

  using KeysD = Shape<Int<kWarpgroupKeys>, Int<kHeadDim>>;
  using RowsD = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileSdP = Shape<Int<kWarpgroupKeys>, Int<kBlockM>, Int<kHeadDim>>;  // S^T = K Q^T
  using TileKV = Shape<Int<kWarpgroupKeys>, Int<kHeadDim>, Int<kBlockM>>;   // dV += P^T dO
  using TileDq = Shape<Int<kDqRows>, Int<kDqCols>, Int<kBlockN>>;           // dQ = dS K

  // S^T and dP^T: K / V rows and Q / dO rows, all K-major (head dim contiguous).
  using MmaSdP = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Element, Element, float, TileSdP>()));
  // dV and dK: P^T / dS^T from registers; dO / Q read transposed (head dim = N contiguous).
  using MmaKV = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<Element, Element, float, TileKV, GMMA::Major::K,
                                 GMMA::Major::MN>()));
  // dQ: dS from smem stored query-row contiguous (as the S^T accumulators hold it), K read
  // transposed: both MN-major.
  using MmaDq = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Element, Element, float, TileDq, GMMA::Major::MN,
                                 GMMA::Major::MN>()));

  // The largest swizzle whose atoms tile the head dim (Q, dO) and each dQ part's columns (K, V;
  // one TMA descriptor type loads both): 128 bytes at hd64 / hd128, 64 and 32 at hd96.
  template <int kFeatures>
  using AtomFor = std::conditional_t<
      kFeatures % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
      std::conditional_t<kFeatures % 32 == 0, GMMA::Layout_K_SW64_Atom<Element>,
                         GMMA::Layout_K_SW32_Atom<Element>>>;
  using SwizzleAtom = AtomFor<kHeadDim>;
  using SwizzleAtomKV = AtomFor<kDqCols>;
  // K and V: [64 keys, head dim, consumer]; each half is one TMA box, loaded and (as dK, dV)
  // stored by the same descriptor.
  using SmemLayoutKVHalf = decltype(tile_to_shape(SwizzleAtomKV{}, KeysD{}));
  using SmemLayoutKV = decltype(tile_to_shape(
      SwizzleAtomKV{}, Shape<Int<kWarpgroupKeys>, Int<kHeadDim>, Int<kConsumers>>{}));
  // K as the B operand of dQ = dS K: [head dim, (64 keys, consumer)] over the same bytes.
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{},
      make_layout(Shape<Int<kHeadDim>, Shape<Int<kWarpgroupKeys>, Int<kConsumers>>>{},
                  Stride<Int<kWarpgroupKeys>, Stride<_1, Int<kWarpgroupKeys * kHeadDim>>>{})));
  // Q and dO: [rows, head dim, stage], and transposed [head dim, rows, stage] for dK and dV.
  using SmemLayoutRowsTile = decltype(tile_to_shape(SwizzleAtom{}, RowsD{}));
  using SmemLayoutRows = decltype(tile_to_shape(
      SwizzleAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutRowsT = decltype(composition(
      SmemLayoutRows{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                    Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  // dS: [rows, keys, buffer], rows contiguous; written through the transposed view [keys, rows,
  // buffer] from the dS^T accumulators. Two buffers: a consumer may write step j + 1's dS while
  // the other still reads step j's (the per-step barrier orders everything else).
  using SmemLayoutDs = decltype(tile_to_shape(
      GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kBlockN>, _2>{}));
  using SmemLayoutDsT = decltype(composition(
      SmemLayoutDs{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>, _2>{},
                                  Stride<Int<kBlockM>, _1, Int<kBlockM * kBlockN>>{})));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;  // dK at the end
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> v;  // dV at the end
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutRows>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutRows>> dout;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutDs>> ds;
    alignas(16) float lse2[kStages][kBlockM];  // lse * log2(e) of the Q stage's rows
    alignas(16) float dsum[kStages][kBlockM];  // D = rowsum(dO O) - dlse of the dO stage's rows
    typename Pipeline::SharedStorage pipe_q;
    typename Pipeline::SharedStorage pipe_do;
    cutlass::arch::ClusterTransactionBarrier barrier_kv;
  };

  // 227 KiB of dynamic smem per CTA on sm_90.
  static_assert(sizeof(SharedStorage) <= 227 * 1024);

  static constexpr int kKVHalfBytes = kWarpgroupKeys * kHeadDim * sizeof(Element);
  static constexpr int kRowsTileBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr int kRowFloatsBytes = kBlockM * sizeof(float);

  // Global tensors as TMA sees them (gmem_view.h).
  using GmemShape = sm90::GmemShape;
  using GmemTensor = GmemTensorOf<Element>;
  using TmaRows = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutRowsTile{},
                                         RowsD{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKVHalf{},
                                       KeysD{}, _1{}));
  using TmaKVStore = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensor{}, SmemLayoutKVHalf{},
                                            KeysD{}, _1{}));
};

}  // namespace jax_sgl::cuda::sm90
