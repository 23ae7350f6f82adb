// Compile-time shape of the sm_90a flash forward for one (dtype, head dim, variant): tile sizes,
// shared memory layouts and the two warpgroup MMAs, all as CuTe types. Everything else is a
// run-time parameter (kernel.cuh). The variants (variants.h) differ in the key tile, in whether
// the CTAs are persistent and in the softmax's instruction schedule.
//
// CTA = 3 warpgroups: warpgroup 0 loads (TMA), warpgroups 1 and 2 each own 64 query rows of the
// 128-row tile and take turns on the tensor cores (ping-pong). The 64-row halves of Q/O are
// separate smem blocks so each consumer loads and stores its own rows with one TMA box.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace jax_sgl::cuda::sm90 {

using namespace cute;

// A work tile: query rows [m_block * kBlockM, +kBlockM) of one (q head, batch). The varlen
// kernel also carries the sequence's geometry (rows of q / k in the packed buffers, lengths).
struct WorkTile {
  int m_block, head, batch;
  int q_row0 = 0, q_len = 0, k_row0 = 0, k_len = 0;
  int split = -1;  // tail split (dense, persistent): which share of the key tiles, else -1
};

// Persistent CTAs: a consumer's current work tile and its ordinal (whose parity is the phase of
// the Q barrier), parked in smem across the main loop instead of in registers (kernel.cuh).
struct HeldTile {
  WorkTile w;
  int iter;
};

// Keys per tile of variant 0: 128 keeps S (64 fp32 per thread) and O (kHeadDim/2 per thread) plus
// the P operand inside 240 registers up to hd128; hd256's O alone takes 128 registers, so its key
// tile halves. Two stages of K and V fit smem at every head dim (hd256: 64+64+64 KiB).
constexpr int DefaultBlockN(int head_dim) { return head_dim <= 128 ? 128 : 64; }

// kPersistent: grid = #SMs, each CTA loops over work tiles (kernel.cuh) and the loads of the next
// tile overlap the epilogue of the current one. kFastSoftmax: tree reductions for the row max and
// sum, O rescaled only when a row max moved (softmax.h). kEarlyRescale: the O rescale of a step
// runs between the issue of S = Q K^T and of P V (kernel.cuh). kLeanSoftmax: branch-free softmax
// with ex2.approx.ftz (softmax.h). kDeferPvWait: the wait for a step's P V moves to the top of
// the next step (kernel.cuh). kDirectO: O goes from registers to global memory, not through smem
// and a TMA store (kernel.cuh epilogue). kQStages: Q buffers of a persistent CTA; with two, the
// next tile's Q loads while this tile's main loop still runs (kernel.cuh producer).
template <typename Element_, int kHeadDim_, int kBlockN_ = DefaultBlockN(kHeadDim_),
          bool kPersistent_ = false, bool kFastSoftmax_ = false, bool kEarlyRescale_ = false,
          bool kLeanSoftmax_ = false, bool kDeferPvWait_ = false, bool kDirectO_ = false,
          int kQStages_ = 1>
struct FlashConfig {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256);
  static constexpr bool kPersistent = kPersistent_;
  static constexpr bool kFastSoftmax = kFastSoftmax_;
  static constexpr bool kEarlyRescale = kEarlyRescale_;
  static constexpr bool kLeanSoftmax = kLeanSoftmax_;
  static constexpr bool kDeferPvWait = kDeferPvWait_;
  static constexpr bool kDirectO = kDirectO_;
  static constexpr int kQStages = kQStages_;
  static_assert(kQStages == 1 || kQStages == 2);

  static constexpr int kWarpgroupRows = 64;                   // wgmma M per warpgroup
  static constexpr int kConsumers = 2;                        // consumer warpgroups (ping-pong)
  static constexpr int kBlockM = kWarpgroupRows * kConsumers; // query rows per CTA
  // Keys per tile: a multiple of 16 (the K step of P V), at most 256 (wgmma N, TMA box).
  static constexpr int kBlockN = kBlockN_;
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256);
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // Registers per thread after setmaxnreg: producers give theirs to the consumers.
  // (24 + 2 * 240) * 128 = 64512 <= 65536, the register file of one SM.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  using RowsD = Shape<Int<kWarpgroupRows>, Int<kHeadDim>>;
  using TileQK = Shape<Int<kWarpgroupRows>, Int<kBlockN>, Int<kHeadDim>>;  // S = Q K^T
  using TilePV = Shape<Int<kWarpgroupRows>, Int<kHeadDim>, Int<kBlockN>>;  // O += P V

  // S = Q K^T: both operands from smem, K-major (head dim contiguous).
  // Needs CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED (cmake/cuda.cmake) when kBlockN is not 64 / 128 /
  // 192 / 256, else CuTe's selector falls back to N = 16 atoms (checked below).
  using MmaQK = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Element, Element, float, TileQK>()));
  static_assert(size<1>(typename MmaQK::AtomShape_MNK{}) == kBlockN,
                "S = Q K^T must be one wgmma per K step (define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED)");
  // O += P V: P from registers (the softmax output never touches smem); V is read transposed,
  // its head dim (the N of this GEMM) contiguous, i.e. MN-major.
  using MmaPV = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<Element, Element, float, TilePV, GMMA::Major::K,
                                 GMMA::Major::MN>()));

  // 128-byte swizzle: conflict-free for both TMA writes and wgmma reads.
  using SwizzleAtom = GMMA::Layout_K_SW128_Atom<Element>;
  // Q (and later O): [64 rows, head dim, consumer].
  using SmemLayoutQ = decltype(tile_to_shape(
      SwizzleAtom{}, Shape<Int<kWarpgroupRows>, Int<kHeadDim>, Int<kConsumers>>{}));
  using SmemLayoutQHalf = decltype(tile_to_shape(SwizzleAtom{}, RowsD{}));
  // K and V: [keys, head dim, stage], as TMA writes them.
  using SmemLayoutKV = decltype(tile_to_shape(
      SwizzleAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutKVTile = decltype(tile_to_shape(
      SwizzleAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V seen as the B operand of P V: [head dim, keys, stage] over the same bytes.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                  Stride<Int<kBlockN>, _1, Int<kBlockN * kHeadDim>>{})));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  // Persistent CTAs stage O in its own buffer when it fits (the next tile's Q then loads during
  // this tile's epilogue); otherwise, and always in variant 0, O reuses the Q buffer.
  static constexpr int kQBytes = cosize_v<SmemLayoutQ> * int(sizeof(Element));
  static constexpr int kSmemLimit = 227 * 1024;  // sm_90 opt-in dynamic smem per block
  static constexpr bool kSeparateO =
      kPersistent && !kDirectO &&
      kQBytes * (kQStages + 1) + 2 * cosize_v<SmemLayoutKV> * int(sizeof(Element)) + 1024 <=
          kSmemLimit;
  // Persistent: whether Q is free for the next tile when a tile's main loop ends (O does not
  // leave through the Q buffer), or only once O has been stored from it.
  static constexpr bool kQFreeAfterLoop = kSeparateO || kDirectO;
  // Two Q buffers only where O has a way out of its own (and so each Q is free after the loop).
  static_assert(kQStages == 1 || (kPersistent && kQFreeAfterLoop));

  struct SharedStorage {
    // Q buffer b at b * cosize_v<SmemLayoutQ>; O too if !kSeparateO (then kQStages is 1).
    alignas(1024) cute::array_aligned<Element, kQStages * cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> v;
    alignas(1024) cute::array_aligned<Element, kSeparateO ? cosize_v<SmemLayoutQ> : 8> o;
    typename Pipeline::SharedStorage pipe_k;
    typename Pipeline::SharedStorage pipe_v;
    // Per Q buffer: Q (and, persistent, the tile) ready; persistent: the consumers are done with
    // it; the work tile of its Q, or -1.
    cutlass::arch::ClusterTransactionBarrier barrier_q[kQStages];
    cutlass::arch::ClusterBarrier barrier_q_empty[kQStages];
    int tile[kQStages];
    HeldTile held[kConsumers];                           // persistent: each consumer's tile
  };
  static_assert(sizeof(SharedStorage) <= kSmemLimit);

  static constexpr int kQHalfBytes = kWarpgroupRows * kHeadDim * sizeof(Element);
  static constexpr int kKVTileBytes = kBlockN * kHeadDim * sizeof(Element);

  // Global tensors as TMA sees them: [rows, head dim, head, batch] with the head dim contiguous.
  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)),
                                          GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQHalf{}, RowsD{},
                                      _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKVTile{},
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensor{}, SmemLayoutQHalf{}, RowsD{},
                                      _1{}));
};

}  // namespace jax_sgl::cuda::sm90
