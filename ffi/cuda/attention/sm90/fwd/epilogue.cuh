// The sm_90a flash forward's epilogue: one warpgroup's 64 rows of a finished work tile.
// Normalizes O by the softmax sums and writes LSE, then O: registers -> smem (the Q buffer of the
// same warpgroup, or its own buffer when persistent and smem allows) -> TMA store; varlen row by
// row from registers (a TMA box would write the next sequence's rows); a tail-split share as
// float32 O and LSE to its slot of the tail buffers; a paged key share as float32 O and LSE rows
// of the split partials. Then tells the producer when Q is free.
// Attention sinks are applied here from the finished LSE alone (a few scalars per row, after the
// main loop), except to a tail or key share, whose combine applies them. ptxas -v, sm_90a,
// 2026-12-04: hd128 still spills nothing; the hd256 dense kernels go from 32 / 24 to 40 / 36
// bytes of spill stores (plain / softcap), varlen unchanged (80 / 88); moving the sink after the
// tail branch or a one-branch ApplySink gave the same numbers. Not yet timed on a GPU.
// fp8 (Cfg::kFp8): O is bf16 (ElementOut), scaled by the tile's v_descale with the softmax
// normalization; the LSE's scale carries q_descale * k_descale as the scores' did (kernel.cuh).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "ffi/common/attention_sink.h"
#include "ffi/cuda/attention/sm90/fwd/config.h"
#include "ffi/cuda/attention/sm90/fwd/fp8.cuh"
#include "ffi/cuda/attention/sm90/fwd/kernel_params.h"
#include "ffi/cuda/attention/sm90/fwd/softmax.h"
#include "ffi/cuda/attention/sm90/fwd/tile_scheduler.cuh"

namespace jax_sgl::cuda::sm90 {

template <typename Cfg, bool kVarlen, bool kPack = false>
struct Epilogue {
  using Element = typename Cfg::ElementOut;  // O's type
  using Scheduler = TileScheduler<Cfg, kVarlen, KernelParams<Cfg>, kPack>;
  static constexpr int kBlockM = Cfg::kBlockM;
  static constexpr int kRows = Cfg::kWarpgroupRows;
  static constexpr bool kPersistent = Cfg::kPersistent;

  KernelParams<Cfg> const& params;
  Scheduler const& scheduler;
  typename Cfg::SharedStorage& shared;
  AccCoord const& coord;
  int const& consumer;
  int const& thread_in_wg;
  uint32_t const& epilogue_barrier;

  // Stores O (tOrO, this warpgroup's accumulator) and LSE of `tile`; row_base: the tile row of
  // this thread's r = 0 (non-persistent). sOmine: this warpgroup's O staging in smem. Returns the
  // ordinal of the next published tile (persistent).
  template <typename ThrPV, typename SO, typename TO>
  __device__ __forceinline__ int Store(WorkTile const& tile, int row_base, ThrPV const& thr_pv,
                                       SO const& sOmine, TO& tOrO, OnlineSoftmax& softmax) {
    // Persistent: the epilogue reads its tile (and the next Q phase) back from smem rather than
    // keep it in registers across the main loop, which needs them all: held there, it spilled.
    const WorkTile w = kPersistent ? LoadTile(shared.held[consumer]) : tile;
    const int next_iter = kPersistent ? LoadTileIter(shared.held[consumer]) + 1 : 0;
    // Row of r = 0 again; non-persistent keeps row_base, live anyway (hd256 spilled m_block).
    const int out_row =
        kPersistent ? w.m_block * kBlockM + consumer * kRows + coord.row0 : row_base;
    // With a separate O buffer, Q is done: the producer may load a later tile's into it.
    if constexpr (kPersistent && Cfg::kSeparateO) shared.barrier_q_empty.arrive();

    // This thread's two rows (r = 0, 1): q row q_row[r] of q head head[r] (PackGQA:
    // TileScheduler::Pack), else tile row out_row + 8 r of q head w.head.
    int q_row[2], head[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = out_row + 8 * r;
      q_row[r] = row / scheduler.Pack();
      head[r] = scheduler.Pack() > 1 ? w.head * scheduler.Pack() + row % scheduler.Pack() : w.head;
    }
    float inv_sum[2], lse[2];
    if constexpr (Cfg::kFp8) {
      const int kv_head = scheduler.KvHead(w);
      // Softcap: the capped scores are already scaled (softmax_scale is then 1).
      const float qk = params.softcap != 0.f
                           ? 1.f
                           : params.q_descale.At(w.batch, kv_head) *
                                 params.k_descale.At(w.batch, kv_head);
      softmax.Finish(params.softmax_scale * qk, inv_sum, lse);
      const float v_descale = params.v_descale.At(w.batch, kv_head);
      inv_sum[0] *= v_descale;
      inv_sum[1] *= v_descale;
    } else {
      softmax.Finish(params.softmax_scale, inv_sum, lse);
    }
    const bool tail_share = Scheduler::kShares && w.split >= 0;
    if (params.sinks != nullptr && !tail_share) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const SinkedRow fin = ApplySink(lse[r], params.sinks[head[r]]);
        inv_sum[r] *= fin.scale;
        lse[r] = fin.lse;
      }
    }
    ScaleRows(tOrO, inv_sum);
    if constexpr (kPersistent && !kVarlen) {
      if (w.split >= 0) {
        // A share of a tail tile: O (float32) and LSE of its keys, to its slot of the tail
        // buffers; FlashFwdSm90TailCombine merges the shares into O and LSE.
        const int index = (w.batch * params.num_heads + w.head) * params.num_m_blocks + w.m_block;
        const int64_t slot =
            int64_t(index - params.num_whole_tiles) * params.tail_splits + w.split;
        const int64_t row0 = slot * kBlockM + consumer * kRows;  // this warpgroup's rows
        Tensor gP = make_tensor(make_gmem_ptr(params.tail_o + row0 * Cfg::kHeadDim),
                                make_layout(typename Cfg::RowsD{},
                                            make_stride(Int<Cfg::kHeadDim>{}, _1{})));
        Tensor tOgP = thr_pv.partition_C(gP);
#pragma unroll
        for (int i = 0; i < size(tOrO); i += 2)
          *reinterpret_cast<float2*>(&tOgP(i)) = make_float2(tOrO(i), tOrO(i + 1));
        if (coord.col0 == 0) {
#pragma unroll
          for (int r = 0; r < 2; ++r) params.tail_lse[row0 + coord.row0 + 8 * r] = lse[r];
        }
        if constexpr (!Cfg::kSeparateO) {
          // Q may be reloaded once every thread is past its last wgmma on it.
          cutlass::arch::NamedBarrier::sync(128, epilogue_barrier);
          if (thread_in_wg == 0) shared.barrier_q_empty.arrive();
        }
        return next_iter;
      }
    }
    if constexpr (kPersistent && kVarlen && kPack) {
      if (w.split >= 0) {
        // A key share of a paged tile: its rows' O (float32) and LSE to the share's slice of the
        // partials, by (q row, head) as LaunchSplitCombine reads them; rows past the sequence
        // are no q row's.
        const int64_t share_row0 = int64_t(w.split) * params.total_q + w.q_row0;
        float* row_o[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int64_t slot = (share_row0 + q_row[r]) * params.num_heads + head[r];
          const bool valid = q_row[r] < scheduler.SeqlenQ(w);
          row_o[r] = valid ? params.split_o + slot * Cfg::kHeadDim + coord.col0 : nullptr;
          if (valid && coord.col0 == 0) params.split_lse[slot] = lse[r];
        }
        // Values 2j and 2j+1 of the accumulator are adjacent columns of one row (even column).
#pragma unroll
        for (int i = 0; i < size(tOrO); i += 2) {
          float* dst = row_o[AccCoord::Row(i) / 8];
          if (dst != nullptr)
            *reinterpret_cast<float2*>(dst + AccCoord::Col(i)) = make_float2(tOrO(i), tOrO(i + 1));
        }
        if constexpr (!Cfg::kSeparateO) {
          // Q may be reloaded once every thread is past its last wgmma on it.
          cutlass::arch::NamedBarrier::sync(128, epilogue_barrier);
          if (thread_in_wg == 0) shared.barrier_q_empty.arrive();
        }
        return next_iter;
      }
    }
    if (params.lse != nullptr && coord.col0 == 0) {
      // Dense: [batch, heads, seqlen_q]; varlen q: [heads, total_q] (attention_params.h).
      auto lse_row = [&](int h) {
        return kVarlen && params.cu_seqlens_q != nullptr
                   ? params.lse + int64_t(h) * params.total_q + w.q_row0
                   : params.lse + (int64_t(w.batch) * params.num_heads + h) * params.seqlen_q;
      };
      // One head per thread unless packed: its row pointer is computed once.
      float* const row_lse = kPack ? nullptr : lse_row(w.head);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (q_row[r] < scheduler.SeqlenQ(w)) (kPack ? lse_row(head[r]) : row_lse)[q_row[r]] = lse[r];
      }
    }
    if constexpr (kVarlen) {
      // Row by row from registers, because a TMA box would write the next sequence's rows.
      // Rows of this warpgroup's 64-row block past the sequence's end are skipped. Values 2j and
      // 2j+1 of the accumulator are adjacent columns of one row (even column), stored as one
      // 32-bit word.
      const int block_row0 = out_row - coord.row0;  // tile row of this warpgroup's row 0
      const int rows_left = scheduler.SeqlenQ(w) - block_row0;
      const int64_t q_row0 = kVarlen ? int64_t(w.q_row0) : int64_t(w.batch) * params.seqlen_q;
      const int64_t row_stride = int64_t(params.num_heads) * Cfg::kHeadDim;
      static_assert(sizeof(Element) == 2);
      auto release_q = [&] {
        if constexpr (kPersistent && !Cfg::kSeparateO) {
          // Every thread's last wgmma on Q has completed (wait<0> above): Q may be reloaded.
          cutlass::arch::NamedBarrier::sync(128, epilogue_barrier);
          if (thread_in_wg == 0) shared.barrier_q_empty.arrive();
        }
      };
      if constexpr (kPack) {
        if (scheduler.Pack() > 1) {
          // PackGQA: the two rows of this thread belong to different (q row, head) pairs.
          Element* row_out[2];
#pragma unroll
          for (int r = 0; r < 2; ++r)
            row_out[r] = q_row[r] < scheduler.SeqlenQ(w)
                             ? params.out + (q_row0 + q_row[r]) * row_stride +
                                   int64_t(head[r]) * Cfg::kHeadDim + coord.col0
                             : nullptr;
#pragma unroll
          for (int i = 0; i < size(tOrO); i += 2) {
            Element* dst = row_out[AccCoord::Row(i) / 8];
            if (dst != nullptr) {
              const uint32_t lo = Element(tOrO(i)).raw(), hi = Element(tOrO(i + 1)).raw();
              *reinterpret_cast<uint32_t*>(dst + AccCoord::Col(i)) = lo | (hi << 16);
            }
          }
          release_q();
          return next_iter;
        }
      }
      Tensor gO = make_tensor(
          make_gmem_ptr(params.out + (q_row0 + block_row0) * row_stride +
                        int64_t(w.head) * Cfg::kHeadDim),
          make_layout(typename Cfg::RowsD{}, make_stride(row_stride, _1{})));
      Tensor tOgO = thr_pv.partition_C(gO);
      Tensor tOcO = thr_pv.partition_C(make_identity_tensor(typename Cfg::RowsD{}));
#pragma unroll
      for (int i = 0; i < size(tOrO); i += 2) {
        if (get<0>(tOcO(i)) < rows_left) {
          const uint32_t lo = Element(tOrO(i)).raw(), hi = Element(tOrO(i + 1)).raw();
          *reinterpret_cast<uint32_t*>(&tOgO(i)) = lo | (hi << 16);
        }
      }
      release_q();
      return next_iter;
    }
    // sOmine is free: in the Q buffer, this warpgroup's last wgmma has completed (wait<0>
    // above) and only this warpgroup ever read it (with no key tile, a non-persistent CTA never
    // loaded Q at all); in its own buffer, once the previous tile's store has read it.
    if constexpr (Cfg::kSeparateO) {
      if (thread_in_wg == 0) tma_store_wait<0>();
      cutlass::arch::NamedBarrier::sync(128, epilogue_barrier);
    }
    Tensor tOsO = thr_pv.partition_C(sOmine);
#pragma unroll
    for (int i = 0; i < size(tOrO); ++i) tOsO(i) = Element(tOrO(i));
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> TMA reads
    cutlass::arch::NamedBarrier::sync(128, epilogue_barrier);
    if (thread_in_wg == 0) {
      // This warpgroup's 64-row block (2 m_block + consumer), from out_row: keeps hd256 from
      // spilling m_block across the main loop.
      Tensor mO = params.tma_o.get_tma_tensor(params.q_shape);
      Tensor gO = local_tile(mO(_, _, w.head, w.batch), typename Cfg::RowsD{},
                             make_coord((out_row - coord.row0) / kRows, _0{}));
      auto cta_tma = params.tma_o.get_slice(_0{});
      copy(params.tma_o, cta_tma.partition_S(sOmine), cta_tma.partition_D(gO));
      tma_store_arrive();
      if constexpr (!Cfg::kSeparateO) {
        tma_store_wait<0>();
        if constexpr (kPersistent) shared.barrier_q_empty.arrive();  // O has left the Q buffer
      }
    }
    return next_iter;
  }
};

}  // namespace jax_sgl::cuda::sm90
