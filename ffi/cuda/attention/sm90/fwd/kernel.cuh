// The sm_90a flash attention forward kernel: the assignment of roles. A work tile is 128 query
// rows of one (q head, batch); by the head dim's tile choice (tile_size.h) one CTA runs per tile,
// or #SMs persistent CTAs (Cfg::kPersistent) loop over tiles (tile_scheduler.cuh).
//   warpgroup 0, one thread: the producer (mainloop_load.cuh), TMA loads of Q and the K/V rings;
//   warpgroups 1 and 2: consumers of 64 query rows each: the main loop below (S = Q K^T and
//   O += P V on wgmma, P kept in registers, the online softmax of softmax.h between them; the
//   two consumers take turns on the tensor cores) and the epilogue (epilogue.cuh: normalize,
//   LSE, O store).
// kVarlen: packed q / k / v (cu_seqlens_q / cu_seqlens_k, seqused_k): per-tile sequence geometry,
// row offsets into the TMA views, O stored row by row. kPaged (with kVarlen): K/V from a page
// pool through the page table (mainloop_load.cuh; the producer is then its warpgroup), and with
// params.pack > 1 (PackGQA, tile_scheduler.cuh) the tile rows are (q row, head) pairs of the q
// heads of one kv head: the consumers then load Q and store O row by row. kSoftcap: scores
// capped before the mask (KernelParams::softcap != 0). Each is its own instantiation, picked per
// call by the launcher, so the dense plain kernel holds none of their code.
// fp8 (Cfg::kFp8: e4m3 q/k/v, bf16 O; dense, varlen and paged): the producer warpgroup also
// writes V transposed (mainloop_load.cuh), P goes to e4m3 in the key order of fp8.cuh, q_descale
// * k_descale of the tile's (batch, kv head) scale the scores and v_descale O (epilogue.cuh).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "ffi/cuda/attention/sm90/fwd/config.h"
#include "ffi/cuda/attention/sm90/fwd/epilogue.cuh"
#include "ffi/cuda/attention/sm90/fwd/fp8.cuh"
#include "ffi/cuda/attention/sm90/fwd/gemm.cuh"
#include "ffi/cuda/attention/sm90/fwd/kernel_params.h"
#include "ffi/cuda/attention/sm90/fwd/mainloop_load.cuh"
#include "ffi/cuda/attention/sm90/fwd/softmax.h"
#include "ffi/cuda/attention/sm90/fwd/tile_scheduler.cuh"

namespace jax_sgl::cuda::sm90 {

template <typename Cfg, bool kVarlen = false, bool kSoftcap = false, bool kPaged = false,
          bool kGather = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    FlashFwdSm90Kernel(CUTE_GRID_CONSTANT KernelParams<Cfg> const params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Cfg::Element;
  using Pipeline = typename Cfg::Pipeline;
  using PipelineState = cutlass::PipelineState<Cfg::kStages>;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kRows = Cfg::kWarpgroupRows;
  constexpr int kConsumerThreads = 128 * Cfg::kConsumers;
  constexpr bool kPersistent = Cfg::kPersistent;
  // Paged: whether middle key tiles with page-table holes branch to the masked step (below).
  // Not for e4m3 under softcap: its two kinds of step in one loop spilled 340 bytes (ptxas -v,
  // hd128's 192-key tile) where one step that tests the holes keeps to registers.
  constexpr bool kHolesBranch = Cfg::kHeadDim <= 128 && !(Cfg::kFp8 && kSoftcap);

  extern __shared__ __align__(1024) char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);

  const int warpgroup = WarpgroupIndex();  // warp-uniform to ptxas (sm90/wgmma.cuh)
  const int thread_in_wg = threadIdx.x % 128;
  const TileScheduler<Cfg, kVarlen, KernelParams<Cfg>, kPaged> scheduler{params};
  WorkTile launch_tile = scheduler.LaunchTile();
  if constexpr (kVarlen && !kPersistent) {
    if (!scheduler.Resolve(launch_tile)) return;  // the whole CTA, before any barrier
  }

  // Barriers: set up by warp 0, made visible to all before any role starts.
  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Cfg::kKVTileBytes;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer
                                    : Pipeline::ThreadCategory::Consumer;
  // Paged: the producer warp arrives on the full barriers itself (mainloop_load.cuh).
  pipe_params.is_leader = !kPaged && threadIdx.x == 0;
  pipe_params.num_consumers = kConsumerThreads;
  Pipeline pipe_k(shared.pipe_k, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipe_v(shared.pipe_v, pipe_params, Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    // Paged gather: each of the 128 producer threads arrives when its cp.asyncs land, and the
    // leader once more after the stage's hole words (mainloop_load.cuh GatherPages). The same
    // thread initialized them for the TMA pipeline's one arrival just above.
    if constexpr (kGather) {
      for (int i = 0; i < Cfg::kStages; ++i) {
        shared.pipe_k.full_barrier_[i].init(128 + 1);
        if constexpr (!Cfg::kFp8) shared.pipe_v.full_barrier_[i].init(128 + 1);
      }
    }
    // fp8: the 128 producer threads arrive on the V^T ring's full barriers once each has written
    // its share of the transposed tile; one TMA arrival per staged V tile (gather: the 128
    // threads' cp.async arrivals + the leader's, as K's).
    if constexpr (Cfg::kFp8) {
      for (int i = 0; i < Cfg::kStages; ++i) {
        shared.pipe_v.full_barrier_[i].init(128);
        shared.v_staged[i].init(kGather ? 128 + 1 : 1);
      }
    }
    shared.barrier_q.init(1);
    // Q is free again when every consumer thread finished its last wgmma on it (separate O), or
    // when each consumer's O store out of the Q buffer has completed.
    if constexpr (kPersistent)
      shared.barrier_q_empty.init(Cfg::kSeparateO ? kConsumerThreads : Cfg::kConsumers);
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (warpgroup == 0) {
    // ---- Producer ------------------------------------------------------------------------
    cutlass::arch::warpgroup_reg_dealloc<kGather ? Cfg::kGatherProducerRegs : Cfg::kProducerRegs>();
    using Load = MainloopLoad<Cfg, kVarlen, kPaged, kGather>;
    if (threadIdx.x >= Load::kThreads) return;
    Load{params, scheduler, shared, pipe_k, pipe_v}.Run(launch_tile);
  } else {
    // ---- Consumers -----------------------------------------------------------------------
    cutlass::arch::warpgroup_reg_alloc<kGather ? Cfg::kGatherConsumerRegs : Cfg::kConsumerRegs>();
    const int consumer = warpgroup - 1;
    const uint32_t my_turn = uint32_t(Barrier::kTurn0) + consumer;
    const uint32_t other_turn = uint32_t(Barrier::kTurn0) + 1 - consumer;
    const uint32_t epilogue_barrier = uint32_t(Barrier::kEpilogue0) + consumer;

    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Cfg::SmemLayoutQ{});
    // Paged TMA boxes fill the ring by whole rows (config.h SmemLayoutKVRows).
    constexpr bool kRowsLayout = kPaged && !kGather;
    using LayoutK = std::conditional_t<kRowsLayout, typename Cfg::SmemLayoutKVRows,
                                       typename Cfg::SmemLayoutKV>;
    using LayoutVt = std::conditional_t<kRowsLayout, typename Cfg::SmemLayoutVtRows,
                                        typename Cfg::SmemLayoutVt>;
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), LayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(VtData<Cfg>(shared)), LayoutVt{});
    Tensor sO = make_tensor(make_smem_ptr(OData<Cfg>(shared)), typename Cfg::SmemLayoutO{});
    typename Cfg::MmaQK mma_qk;
    typename Cfg::MmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(thread_in_wg);
    auto thr_pv = mma_pv.get_thread_slice(thread_in_wg);
    Tensor sOmine = sO(_, _, consumer);
    Tensor tSrK = thr_qk.partition_fragment_B(sK);
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);
    Tensor tOrO = partition_fragment_C(mma_pv, typename Cfg::RowsD{});

    const AccCoord coord(thread_in_wg);
    PipelineState read_k, read_v;  // run on across the tiles of a persistent CTA
    Epilogue<Cfg, kVarlen, kPaged> epilogue{params, scheduler, shared, coord, consumer,
                                            thread_in_wg, epilogue_barrier};
    // The first consumer goes first.
    auto start_turns = [&] {
      if (consumer == 1) cutlass::arch::NamedBarrier::arrive(kConsumerThreads, other_turn);
    };

    // One work tile: main loop, then the epilogue. Q must be in smem. Returns the ordinal of the
    // next published tile (persistent). always_inline: NVVM outlines this lambda otherwise, and
    // ptxas then serializes every wgmma (C7520).
    // PackGQA (scheduler.Pack() > 1): this warpgroup's 64 tile rows of Q, read from q row by
    // row (tile row m: q row m / pack of q head tile.head * pack + m % pack; a TMA box cannot
    // gather them for a group size that does not divide 64). Rows past the sequence get zeros.
    [[maybe_unused]] auto load_q_rows = [&](WorkTile const& tile) {
      constexpr int kChunkElems = Cfg::kChunkElems;
      constexpr int kChunks = Cfg::kRowChunks;
      const int pack = scheduler.Pack();
      const int row0 = tile.m_block * kBlockM + consumer * kRows;
      const int64_t row_stride = int64_t(params.num_heads) * Cfg::kHeadDim;
      Tensor sQmine = sQ(_, _, consumer);
#pragma unroll
      for (int i = thread_in_wg; i < kRows * kChunks; i += 128) {
        const int m = i / kChunks, c = i % kChunks;
        const int token = (row0 + m) / pack, head = tile.head * pack + (row0 + m) % pack;
        uint4 chunk = make_uint4(0, 0, 0, 0);
        if (token < tile.q_len)
          chunk = *reinterpret_cast<const uint4*>(
              params.q + (int64_t(tile.q_row0) + token) * row_stride +
              int64_t(head) * Cfg::kHeadDim + kChunkElems * c);
        // 16-byte chunks of a row stay whole under the 128- and 64-byte swizzles.
        *reinterpret_cast<uint4*>(&sQmine(m, kChunkElems * c)) = chunk;
      }
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> wgmma reads
      cutlass::arch::NamedBarrier::sync(128, epilogue_barrier);
    };

    auto run_tile = [&](WorkTile const& tile, bool last_tile) __attribute__((always_inline)) {
      const KeyTiles tiles = scheduler.Keys(tile);
      if constexpr (kPaged) {
        if (scheduler.Pack() > 1 && !tiles.empty()) load_q_rows(tile);
      }
      Tensor tSrQ = thr_qk.partition_fragment_A(sQ(_, _, consumer));
      const int row_base = tile.m_block * kBlockM + consumer * kRows + coord.row0;  // row of r = 0
      const int diag = scheduler.SeqlenK(tile) - scheduler.SeqlenQ(tile);
      const int key_end = scheduler.SeqlenK(tile);
      // fp8: the tile's q_descale * k_descale scales the scores (with the softcap: its argument).
      [[maybe_unused]] float qk_descale = 1.f;
      if constexpr (Cfg::kFp8) {
        const int kv_head = scheduler.KvHead(tile);
        qk_descale = params.q_descale.At(tile.batch, kv_head) *
                     params.k_descale.At(tile.batch, kv_head);
      }
      OnlineSoftmax softmax(Cfg::kFp8 && !kSoftcap ? params.softmax_scale * qk_descale
                                                   : params.softmax_scale);
      clear(tOrO);
      // Masks keys past the end, right of the diagonal / window and left of the window, for key
      // tile n: each row r keeps the columns in [begin, end), so the test per element is two
      // compares + select, branch-free (a branch here would make ptxas wait for P V).
      // Paged: keys from a bad page-table entry (holes, the K stage's words) are masked as well.
      // TMA boxes: one bit per box in word 0, box i of the tile = elements i / 8 of each row's
      // accumulator, read into a register before the stage is released. Gather: one bit per
      // key, read here from smem (kGather releases the K stage after the mask).
      auto mask_holes = [&](auto& s, uint32_t holes, int stage) {
        if constexpr (kGather) {
          uint32_t words[Cfg::kHoleWords];
#pragma unroll
          for (int w = 0; w < Cfg::kHoleWords; ++w)  // this thread's columns start at col0
            words[w] = reinterpret_cast<volatile uint32_t const*>(shared.page_holes[stage])[w] >>
                       coord.col0;
#pragma unroll
          for (int i = 0; i < size(s); ++i)
            if ((words[AccCoord::Col(i) / 32] >> (AccCoord::Col(i) % 32)) & 1u) s(i) = -INFINITY;
        } else {
#pragma unroll
          for (int i = 0; i < size(s); ++i)
            if ((holes >> (AccCoord::Col(i) / Cfg::kPageBoxRows)) & 1u) s(i) = -INFINITY;
        }
      };
      auto mask = [&](auto& s, int n, uint32_t holes, int stage) {
        if constexpr (kPaged) mask_holes(s, holes, stage);
        int begin[2], end[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          // The q row of tile row r (PackGQA: the row it holds a head of), recomputed here: one
          // more register live across the main loop made hd256 spill.
          const int row_diag = (row_base + 8 * r) / scheduler.Pack() + diag;
          end[r] = key_end;
          if (params.window_right >= 0) end[r] = min(end[r], row_diag + params.window_right + 1);
          begin[r] = params.window_left >= 0 ? row_diag - params.window_left : 0;
          end[r] -= n * kBlockN + coord.col0;  // relative to this thread's first column
          begin[r] -= n * kBlockN + coord.col0;
        }
#pragma unroll
        for (int i = 0; i < size(s); ++i) {
          const int r = (i / 2) % 2;
          if (AccCoord::Col(i) >= end[r] || AccCoord::Col(i) < begin[r]) s(i) = -INFINITY;
        }
      };
      // Softcap, before the mask: s -> cap tanh(scale s / cap), as cap - 2 cap / (1 + e^{2x})
      // (one MUFU.EX2 + one MUFU.RCP; saturates to +-cap without NaN for large |x|).
      auto apply_softcap = [&](auto& s) {
#pragma unroll
        for (int i = 0; i < size(s); ++i) {
          const float e = Exp2Ftz(s(i) * (Cfg::kFp8 ? params.softcap_exp2_scale * qk_descale
                                                    : params.softcap_exp2_scale));
          s(i) = fmaf(-2.f * params.softcap, __fdividef(1.f, 1.f + e), params.softcap);
        }
      };

      // Paged: the first (last-key) tile's page tail (mainloop_load.cuh PageTailRows; scores
      // masked, but P V would still multiply 0 by them) is zeroed in its V stage before any P V
      // reads it. Both consumers write the same zeros; each fences its own writes for its
      // wgmma. (fp8: the producer zeroes it in the staged V before its transpose.)
      [[maybe_unused]] auto zero_v_tail = [&](int n) {
        const int tail = key_end - n * kBlockN;  // keys of tile n; rows from here are past them
        const int rows = PageTailRows(tail, kBlockN, params.page_box_rows);
        if (rows == 0) return;  // warpgroup-uniform
        pipe_v.consumer_wait(read_v);
        Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), LayoutK{});
#pragma unroll 1
        for (int i = thread_in_wg; i < rows * Cfg::kHeadDim; i += 128)
          sV(tail + i / Cfg::kHeadDim, i % Cfg::kHeadDim, read_v.index()) = Element(0);
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(128, epilogue_barrier);
      };
      // The K stage's holes (paged): TMA boxes, its box bits, read before the stage is
      // released; gather, whether it has any (the mask reads the words). 0 otherwise.
      auto load_holes = [&]() -> uint32_t {
        if constexpr (kPaged) {
          auto words = reinterpret_cast<volatile uint32_t const*>(shared.page_holes[read_k.index()]);
          uint32_t any = words[0];
          if constexpr (kGather) {
#pragma unroll
            for (int w = 1; w < Cfg::kHoleWords; ++w) any |= words[w];
          }
          return any;
        } else {
          return 0u;
        }
      };
      if (!tiles.empty()) {
        auto hand_over = [&](bool last) {
          if (!(last && last_tile && consumer == 1))
            cutlass::arch::NamedBarrier::arrive(kConsumerThreads, other_turn);
        };

        int n = tiles.n_end - 1;
        Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kRows>, Int<kBlockN>>{});
        pipe_k.consumer_wait(read_k);
        const uint32_t holes0 = load_holes();
        const int stage0 = read_k.index();
        cutlass::arch::NamedBarrier::sync(kConsumerThreads, my_turn);
        Gemm<true, false>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
        hand_over(n == tiles.n_begin);
        warpgroup_wait<0>();
        // Gather: the mask reads the stage's hole words, so the stage is released after it.
        if constexpr (!kGather) {
          pipe_k.consumer_release(read_k);
          ++read_k;
        }
        if constexpr (kSoftcap) apply_softcap(tSrS);
        mask(tSrS, n, holes0, stage0);
        if constexpr (kGather) {
          pipe_k.consumer_release(read_k);
          ++read_k;
        }
        if constexpr (kPaged && !Cfg::kFp8) zero_v_tail(n);
        // Early rescale: the correction of the latest softmax step waits here until the next
        // step's S is issued (the first one scales O = 0: harmless).
        float correction[2];
        softmax.Step<Cfg::kTile.max_chains>(tSrS, correction);
        Tensor tOrP = ToA<Cfg>(tSrS);

        // Waits for the next K stage, reads its holes (load_holes) and then waits for this
        // warpgroup's turn on the tensor cores, so that the paged kernels' hole-word read and
        // test complete under that wait instead of delaying the consumer's arrival at it.
        // H100, bench_attention_paged.py chunked prefill (B 8 x 1024 after 4k, hd128), same call
        // against the read and test before the turn: +1.5% at pages of 16, +1.8% at 64 (0.94 ->
        // 0.95-0.96x the contiguous call); mixed, verify and dense prefill unchanged.
        auto wait_k = [&]() -> uint32_t {
          pipe_k.consumer_wait(read_k);
          const uint32_t holes = load_holes();
          cutlass::arch::NamedBarrier::sync(kConsumerThreads, my_turn);
          return holes;
        };
        // One step: S_n issued with P_{n+1} V_{n+1}; softmax of S_n while P V runs. The caller
        // has waited for K_n and its turn (wait_k); K_n's holes are `holes`.
        auto step = [&](int n, auto masked, [[maybe_unused]] uint32_t holes) {
          // Gather steps that test holes read them in the mask: the K stage is released after it.
          constexpr bool kLateRelease = kGather && (decltype(masked)::value || !kHolesBranch);
          Tensor s = partition_fragment_C(mma_qk, Shape<Int<kRows>, Int<kBlockN>>{});
          [[maybe_unused]] const int stage = read_k.index();
          Gemm<true, false>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), s);
          // O is idle here (the last P V completed); the tensor cores are busy with S.
          if constexpr (Cfg::kEarlyRescale) ScaleRows(tOrO, correction);
          pipe_v.consumer_wait(read_v);
          Gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
          hand_over(n == tiles.n_begin);
          warpgroup_wait<1>();
          if constexpr (!kLateRelease) {
            pipe_k.consumer_release(read_k);
            ++read_k;
          }
          if constexpr (kSoftcap) apply_softcap(s);
          if constexpr (decltype(masked)::value) mask(s, n, holes, stage);
          else if constexpr (kPaged && !kHolesBranch) mask_holes(s, holes, stage);
          if constexpr (kLateRelease) {
            pipe_k.consumer_release(read_k);
            ++read_k;
          }
          float corr[2];
          softmax.Step<Cfg::kTile.max_chains>(s, corr);
          warpgroup_wait<0>();
          pipe_v.consumer_release(read_v);
          ++read_v;
          if constexpr (Cfg::kEarlyRescale) {
            correction[0] = corr[0];
            correction[1] = corr[1];
          } else {
            ScaleRows(tOrO, corr);
          }
          Tensor p = ToA<Cfg>(s);
#pragma unroll
          for (int i = 0; i < size(p); ++i) tOrP(i) = p(i);
        };
        // The remaining tiles, n_end - 2 down to n_begin, in three straight passes: the masked
        // right edge (>= n_mask_begin), the unmasked middle (>= n_mask_end), the masked left
        // edge (the rest, < n_mask_end). A tile in [n_mask_begin, n_mask_end) (narrow window)
        // goes with the first pass. One loop around both kinds of step kept the state of both
        // live at once and spilled (benchmarks/notes/NOTES_sm90.md, spill fix). Persistent: only a
        // count lives across the middle (its step uses no n); the left edge's range and start come from
        // the held tile again (n there is min(n_end - 2, n_mask_begin - 1, n_mask_end - 1)).
        for (n = tiles.n_end - 2; n >= tiles.n_mask_begin; --n)
          step(n, cute::true_type{}, wait_k());
        for (int c = n - tiles.n_mask_end; c >= 0; --c, --n) {
          // Paged: a middle tile with holes takes the masked step, chosen between steps (no
          // wgmma in flight), so the unmasked step stays free of the per-element test (+2-3%
          // measured against testing every middle tile). Not at hd256 (!kHolesBranch): the two
          // kinds of step in one loop put its O accumulator in local memory (ptxas -v: a
          // 1152-byte stack frame); its unmasked step tests the holes instead. Either step takes
          // the holes read here, not a second wait and read of the same stage.
          const uint32_t holes = wait_k();
          if constexpr (kPaged && kHolesBranch) {
            if (holes != 0) {
              step(n, cute::true_type{}, holes);
              continue;
            }
          }
          step(n, cute::false_type{}, holes);
        }
        const KeyTiles left =
            kPersistent ? scheduler.Keys(LoadTile(shared.held[consumer])) : tiles;
        if constexpr (kPersistent)
          n = min(left.n_end - 2, min(left.n_mask_begin, left.n_mask_end) - 1);
        for (; n >= left.n_begin; --n) step(n, cute::true_type{}, wait_k());

        if constexpr (Cfg::kEarlyRescale) ScaleRows(tOrO, correction);
        pipe_v.consumer_wait(read_v);
        Gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
        warpgroup_wait<0>();
        pipe_v.consumer_release(read_v);
        ++read_v;
      }
      return epilogue.Store(tile, row_base, thr_pv, sOmine, tOrO, softmax);
    };

    if constexpr (!kPersistent) {
      if (!scheduler.Keys(launch_tile).empty()) {
        start_turns();
        shared.barrier_q.wait(0);
      }
      run_tile(launch_tile, true);
    } else {
      start_turns();
      for (int iter = 0;;) {
        shared.barrier_q.wait(iter & 1);
        CompilerFence();
        const int t = *reinterpret_cast<volatile int*>(&shared.tile);
        if (t < 0) break;
        WorkTile w = scheduler.Item(t);
        scheduler.Resolve(w);  // true: the producer published only tiles that resolve
        StoreTile(shared.held[consumer], w, iter);
        iter = run_tile(w, false);
      }
      // Meets consumer 1's last hand-over.
      if (consumer == 0) cutlass::arch::NamedBarrier::sync(kConsumerThreads, my_turn);
      if (thread_in_wg == 0) tma_store_wait<0>();
    }
  }
#endif
}

}  // namespace jax_sgl::cuda::sm90
