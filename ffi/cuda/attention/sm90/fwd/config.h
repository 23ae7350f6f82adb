// Compile-time shape of the sm_90a flash forward for one (dtype, head dim): tile sizes (from
// tile_size.h), shared memory layouts and the two warpgroup MMAs, all as CuTe types. Everything
// else is a run-time parameter (kernel.cuh).
//
// CTA = 3 warpgroups: warpgroup 0 loads (TMA), warpgroups 1 and 2 each own 64 query rows of the
// 128-row tile and take turns on the tensor cores (ping-pong). The 64-row halves of Q/O are
// separate smem blocks so each consumer loads and stores its own rows with one TMA box.
//
// e4m3 (kFp8: Element is cutlass::float_e4m3_t): O and LSE come out as bf16 / float32 (ElementOut),
// and wgmma takes 8-bit operands K-major only, so P V needs V^T (keys contiguous) in smem. TMA
// lands each V tile as it is stored ([keys, head dim], the `v` ring, here a staging ring only)
// and the producer warpgroup writes it transposed into the `vt` ring the consumers read
// (mainloop_load.cuh TransposeV). Asking callers for a transposed V instead would not serve a
// paged pool (its pages are written token by token), nor the API's [.., keys, heads, D] layout.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "ffi/cuda/attention/sm90/fwd/tile_size.h"
#include "ffi/cuda/attention/sm90/gmem_view.h"

namespace jax_sgl::cuda::sm90 {

using namespace cute;

// A work tile: query rows [m_block * kBlockM, +kBlockM) of one (q head, batch). The varlen
// kernel also carries the sequence's geometry (rows of q / k in the packed buffers, lengths).
struct WorkTile {
  int m_block, head, batch;
  int q_row0 = 0, q_len = 0, k_row0 = 0, k_len = 0;
  int split = -1;  // tail split (dense) or key split (paged), persistent: which share of the
                   // key tiles, else -1
};

// Persistent CTAs: a consumer's current work tile and its ordinal (whose parity is the phase of
// the Q barrier), parked in smem across the main loop instead of in registers (kernel.cuh).
struct HeldTile {
  WorkTile w;
  int iter;
};

// fp8 only: the transposed V ring and the barriers of the staged V tiles (kernel.cuh,
// mainloop_load.cuh). An empty base for the 16-bit configs, so their layout does not move.
template <bool kFp8, typename Element, int kVtElems, int kStages>
struct Fp8Storage {};
template <typename Element, int kVtElems, int kStages>
struct Fp8Storage<true, Element, kVtElems, kStages> {
  alignas(1024) cute::array_aligned<Element, kVtElems> vt;
  // Staged V tile i landed (TMA transaction bytes), one per slot of the `v` ring.
  cutlass::arch::ClusterTransactionBarrier v_staged[kStages];
};

template <typename Element_, int kHeadDim_>
struct FlashConfig {
  using Element = Element_;  // cutlass::bfloat16_t, cutlass::half_t or cutlass::float_e4m3_t
  static constexpr bool kFp8 = sizeof(Element) == 1;
  // O's type: Element, bf16 for e4m3 inputs (the API's output dtype for fp8 q, docs/api.md).
  using ElementOut = std::conditional_t<kFp8, cutlass::bfloat16_t, Element>;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(Sm90FwdHeadDim(kHeadDim), "the sm90 forward serves head dims 64, 128, 256");
  static constexpr FwdTileSize kTile = kFp8 ? FwdTileFp8(kHeadDim) : FwdTile(kHeadDim);
  static constexpr bool kPersistent = kTile.persistent;
  static constexpr bool kEarlyRescale = kTile.early_rescale;

  static constexpr int kWarpgroupRows = 64;                   // wgmma M per warpgroup
  static constexpr int kConsumers = 2;                        // consumer warpgroups (ping-pong)
  static constexpr int kBlockM = kWarpgroupRows * kConsumers; // query rows per CTA
  static_assert(kBlockM == kSm90FwdBlockM, "the host counts tiles of kSm90FwdBlockM rows");
  // Keys per tile: a multiple of 16 (the K step of P V), at most 256 (wgmma N, TMA box).
  static constexpr int kBlockN = kTile.block_n;
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256);
  static constexpr int kStages = kTile.stages;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kHoleWords = (kBlockN + 31) / 32;  // paged gather: one hole bit per key
  // 16-byte chunks of a K / V / Q row (the gather's copies, PackGQA's Q rows, the page-tail
  // zeroing): they stay whole under the 128- and 64-byte swizzles.
  static constexpr int kChunkElems = 16 / int(sizeof(Element));
  static constexpr int kRowChunks = kHeadDim / kChunkElems;
  // Registers per thread after setmaxnreg: producers give theirs to the consumers.
  // (24 + 2 * 240) * 128 = 64512 <= 65536, the register file of one SM. fp8 producers keep 32 and
  // the consumers 232 ((32 + 2 * 232) * 128 = 63488): the V transpose (fp8.cuh TransposeV) spilled
  // 12 bytes in 24 at hd128 with 128-key tiles. With the ring addresses added after the XOR,
  // hd128 spills 24 bytes in 32 and in 40 alike, outside the transpose (two words of the tile
  // loop's state; the LDSM / PRMT / STSM blocks keep to registers).
  static constexpr int kProducerRegs = kFp8 ? 32 : 24;
  static constexpr int kConsumerRegs = kFp8 ? 232 : 240;
  // The paged gather (cp.async rows: pages that are not whole TMA boxes) at hd <= 128: its 128
  // producer threads spilled in the copy loop with 24 (ncu: 1.6 M local-memory requests missing
  // L1); 40 leaves ptxas no spill at hd64 / hd128 and the consumers fit 232. Measured against 24
  // / 240 (H100, 2026-12-05, bench_attention_paged.py at page 1, two runs): chunked prefill
  // +4-6%, mixed batch +3.5%, verify +2%. 48 / 224 then holds the copy loop's eight table entries
  // in flight (mainloop_load.cuh) without spills. hd256's consumers spill in 232: it keeps the
  // split above. e4m3 producers gather V too and transpose it: ptxas -v (nvcc 13.0) finds no
  // spill with 56 at hd64 (48 spilled 8 bytes), 48 at hd128, 40 at hd256 (32 spilled 40), and
  // no consumer spill at 224 / 224 / 232.
  static constexpr int kGatherProducerRegs =
      kFp8 ? (kHeadDim == 64 ? 56 : kHeadDim == 128 ? 48 : 40)
           : kHeadDim <= 128 ? 48 : kProducerRegs;
  static constexpr int kGatherConsumerRegs = kHeadDim <= 128 ? 224 : kFp8 ? 232 : kConsumerRegs;
  static_assert(kGatherProducerRegs + 2 * kGatherConsumerRegs <= 512, "64K registers per SM");

  using RowsD = Shape<Int<kWarpgroupRows>, Int<kHeadDim>>;
  using KeysD = Shape<Int<kBlockN>, Int<kHeadDim>>;
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
  // fp8: V^T from the `vt` ring, keys contiguous (K-major), the only form 8-bit wgmma reads.
  using MmaPV = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<Element, Element, float, TilePV, GMMA::Major::K,
                                 kFp8 ? GMMA::Major::K : GMMA::Major::MN>()));

  // 128-byte swizzle: conflict-free for both TMA writes and wgmma reads. fp8 hd64 rows are 64
  // bytes: 64-byte swizzle atoms.
  using SwizzleAtom = std::conditional_t<kHeadDim * sizeof(Element) % 128 == 0,
                                         GMMA::Layout_K_SW128_Atom<Element>,
                                         GMMA::Layout_K_SW64_Atom<Element>>;
  // Q (and later O): [64 rows, head dim, consumer].
  using SmemLayoutQ = decltype(tile_to_shape(
      SwizzleAtom{}, Shape<Int<kWarpgroupRows>, Int<kHeadDim>, Int<kConsumers>>{}));
  using SmemLayoutQHalf = decltype(tile_to_shape(SwizzleAtom{}, RowsD{}));
  // K and V: [keys, head dim, stage], as TMA writes them.
  using SmemLayoutKV = decltype(tile_to_shape(
      SwizzleAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutKVTile = decltype(tile_to_shape(
      SwizzleAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V seen as the B operand of P V: [head dim, keys, stage]; 16-bit: over the same bytes;
  // fp8: the `vt` ring, keys contiguous, written by the producer's transpose.
  template <typename KVLayout>
  using TransposedKV = decltype(composition(
      KVLayout{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                              Stride<Int<kBlockN>, _1, Int<kBlockN * kHeadDim>>{})));
  using SmemLayoutVtView = TransposedKV<SmemLayoutKV>;
  // Only fp8 allocates it; 16-bit configs get a stand-in of 64 keys (their kBlockN, e.g. 80 at
  // hd256, need not be a multiple of the swizzle atom, and tile_to_shape would refuse it).
  static constexpr int kVtKeys = kFp8 ? kBlockN : 64;
  using VtAtom = std::conditional_t<kVtKeys * sizeof(Element) % 128 == 0,
                                    GMMA::Layout_K_SW128_Atom<Element>,
                                    GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayoutVtFp8 = decltype(tile_to_shape(
      VtAtom{}, Shape<Int<kHeadDim>, Int<kVtKeys>, Int<kStages>>{}));
  using SmemLayoutVt = std::conditional_t<kFp8, SmemLayoutVtFp8, SmemLayoutVtView>;
  // O as staged for its TMA store, in ElementOut (bf16 for fp8: a buffer of its own).
  using SwizzleAtomO = GMMA::Layout_K_SW128_Atom<ElementOut>;
  using SmemLayoutO = decltype(tile_to_shape(
      SwizzleAtomO{}, Shape<Int<kWarpgroupRows>, Int<kHeadDim>, Int<kConsumers>>{}));
  using SmemLayoutOHalf = decltype(tile_to_shape(SwizzleAtomO{}, RowsD{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  // Persistent CTAs stage O in its own buffer when it fits (the next tile's Q then loads during
  // this tile's epilogue, as Q is free once the main loop ends); otherwise O reuses the Q buffer.
  static constexpr int kQBytes = cosize_v<SmemLayoutQ> * int(sizeof(Element));
  static constexpr int kSmemLimit = 227 * 1024;  // sm_90 opt-in dynamic smem per block
  // fp8: O (bf16) is twice Q's bytes, so it always has its own buffer.
  static constexpr bool kSeparateO =
      kFp8 || (kPersistent &&
               kQBytes * 2 + 2 * cosize_v<SmemLayoutKV> * int(sizeof(Element)) + 1024 <= kSmemLimit);

  struct SharedStorage : Fp8Storage<kFp8, Element, cosize_v<SmemLayoutVtFp8>, kStages> {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;  // O too if !kSeparateO
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> v;
    alignas(1024) cute::array_aligned<ElementOut, kSeparateO ? cosize_v<SmemLayoutO> : 8> o;
    typename Pipeline::SharedStorage pipe_k;
    typename Pipeline::SharedStorage pipe_v;
    // Q (and, persistent, the tile) ready; persistent: the consumers are done with Q; the work
    // tile of the Q in smem, or -1.
    cutlass::arch::ClusterTransactionBarrier barrier_q;
    cutlass::arch::ClusterBarrier barrier_q_empty;
    int tile;
    HeldTile held[kConsumers];  // persistent: each consumer's tile
    // Paged: per K stage, the keys of the tile that came from a page-table entry outside the
    // pool (zeros were loaded; the consumers mask them): TMA boxes, bit i of word 0 for box i;
    // gather, bit j of word j / 32 for key j. Written before the stage's full barrier is arrived
    // on, read before the stage is released.
    uint32_t page_holes[kStages][kHoleWords];
    // Paged gather (mainloop_load.cuh GatherPages), per key of the last three K tiles: its pool
    // row, or -1 (zeros), in the copy loop's order (GatherPages' slot_of). And the producer
    // warps' next tile.
    alignas(16) int gather_rows[3][kBlockN];
    int next_tile;
  };
  static_assert(sizeof(SharedStorage) <= kSmemLimit);

  static constexpr int kQHalfBytes = kWarpgroupRows * kHeadDim * sizeof(Element);
  static constexpr int kKVTileBytes = kBlockN * kHeadDim * sizeof(Element);

  // Global tensors as TMA sees them (gmem_view.h).
  using GmemShape = sm90::GmemShape;
  using GmemTensor = GmemTensorOf<Element>;
  using GmemTensorOut = GmemTensorOf<ElementOut>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQHalf{}, RowsD{},
                                      _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKVTile{},
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{}, SmemLayoutOHalf{},
                                      RowsD{}, _1{}));

  // Paged K/V (mainloop_load.cuh): a key tile is kPageBoxes boxes of kPageBoxRows keys, each
  // from its own page of the pool (tile_size.h).
  static constexpr int kPageBoxRows = kSm90PageBoxRows;
  static constexpr int kPageBoxes = kBlockN / kPageBoxRows;
  static_assert(kBlockN % kPageBoxRows == 0);
  // Pages of a multiple of 64 keys load in boxes of 64 (where the key tile holds whole ones):
  // the TMA unit's cost is per load more than per byte. H200, hd128, B=8 x 1024 new tokens over
  // 4k-16k keys: 16-key boxes ran 0.64-0.74x the dense kernel at every page size, 64-key boxes
  // 0.88-0.92x at pages of 64 and 128. kPageBoxRowsWide == kPageBoxRows: no wide boxes (hd256's
  // 80-key tiles).
  static constexpr int kPageBoxRowsWide = kBlockN % 64 == 0 ? 64 : kPageBoxRows;
  // The paged kernel's K/V ring, [keys, head dim, stage] with each 8-key row group's swizzle
  // atoms side by side ([stage][key / 8][head dim / 64][8][64]): a box of whole rows (every
  // head-dim block) is then one contiguous run of smem, i.e. one 5-D TMA load (page_map.h),
  // where SmemLayoutKV's blocks of 64 columns took one load each (two per box at hd128, four at
  // hd256). wgmma reads it through its descriptors' 8-row-group stride (2 KiB at hd128).
  // H100, hd128, same run against the 64-column loads: chunked prefill at pages of 16 +16-18%
  // (0.78-0.83x -> 0.93-0.98x FA3), pages of 64 +1-3%, the mixed batch at pages of 16 +13%
  // (tools/check_page_box_layout.cu checks this layout against the box's write order).
  using SmemLayoutKVRows = decltype(tile_to_shape(
      SwizzleAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}, Step<_2, _1, _3>{}));
  // V^T as P V reads it from that ring (16-bit); fp8 reads its own `vt` ring, whatever V's
  // layout (the producer's transpose reads the rows form, fp8.cuh TransposeV).
  using SmemLayoutVtRows =
      std::conditional_t<kFp8, SmemLayoutVtFp8, TransposedKV<SmemLayoutKVRows>>;
};

}  // namespace jax_sgl::cuda::sm90
