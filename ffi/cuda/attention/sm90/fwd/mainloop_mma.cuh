// The sm_90a flash forward's consumer main loop: one warpgroup's 64 query rows of a work tile
// against its key tiles, last first. S = Q K^T and O += P V on wgmma with P kept in registers (RS
// wgmma), the online softmax (softmax.h) between them. The S of tile n is issued together with the
// P V of tile n+1 (ptxas still places the P V wait above the softmax, so the softmax hides behind
// the other warpgroup's GEMMs). Ping-pong: a pair of named barriers makes the two consumers issue
// their GEMMs in turn. Only tiles that cross the causal diagonal / right window edge or the end of
// the keys (first) and the left window edge (last) are masked; softcap (its own instantiation)
// runs on every tile.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "ffi/cuda/attention/sm90/fwd/config.h"
#include "ffi/cuda/attention/sm90/fwd/kernel_params.h"
#include "ffi/cuda/attention/sm90/fwd/softmax.h"
#include "ffi/cuda/attention/sm90/fwd/tile_scheduler.cuh"

namespace jax_sgl::cuda::sm90 {

// Named barriers (ids after CUTLASS's reserved ones): one per consumer for its GEMM turn, one per
// consumer for its epilogue.
enum class Barrier : uint32_t { kTurn0 = 0, kTurn1 = 1, kEpilogue0 = 2, kEpilogue1 = 3 };

// One wgmma GEMM batch: C (+)= A B over the K blocks, committed as one group; the caller waits.
// kARegs: A is a register fragment (fenced like the accumulator) rather than smem descriptors.
template <bool kZeroInit, bool kARegs, typename Mma, typename TA, typename TB, typename TC>
__device__ __forceinline__ void Gemm(Mma& mma, TA const& a, TB const& b, TC& c) {
  if constexpr (kARegs) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kARegs) warpgroup_fence_operand(const_cast<TA&>(a));
}

// P as the A operand of P V: the accumulator's (2, 2, N/8) values regrouped as
// ((2, 2, 2), 1, N/16), same order, so the conversion is element-wise.
template <typename Element, int kBlockN, typename TensorS>
__device__ __forceinline__ auto ToP(TensorS const& s) {
  Tensor p = make_tensor<Element>(Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>>{});
#pragma unroll
  for (int i = 0; i < size(s); ++i) p(i) = Element(s(i));
  return p;
}

template <typename Cfg, bool kVarlen, bool kSoftcap>
struct MainloopMma {
  using Element = typename Cfg::Element;
  using Pipeline = typename Cfg::Pipeline;
  using PipelineState = cutlass::PipelineState<Cfg::kStages>;
  using Scheduler = TileScheduler<Cfg, kVarlen, KernelParams<Cfg>>;
  static constexpr int kBlockN = Cfg::kBlockN;
  static constexpr int kRows = Cfg::kWarpgroupRows;
  static constexpr int kConsumerThreads = 128 * Cfg::kConsumers;
  static constexpr bool kPersistent = Cfg::kPersistent;

  KernelParams<Cfg> const& params;
  Scheduler const& scheduler;
  typename Cfg::SharedStorage& shared;
  Pipeline& pipe_k;
  Pipeline& pipe_v;
  PipelineState& read_k;  // the ring states run on across the tiles of a persistent CTA
  PipelineState& read_v;
  AccCoord const& coord;
  int const& consumer;
  uint32_t const& my_turn;
  uint32_t const& other_turn;

  // Masks keys past the end, right of the diagonal / window and left of the window, for key
  // tile n: each row r keeps the columns in [begin, end), so the test per element is two
  // compares + select, branch-free (a branch here would make ptxas wait for P V).
  template <typename TensorS>
  __device__ __forceinline__ void Mask(TensorS& s, int n, int row_base, int diag,
                                       int key_end) const {
    int begin[2], end[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row_diag = row_base + 8 * r + diag;
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
  }

  // Softcap, before the mask: s -> cap tanh(scale s / cap), as cap - 2 cap / (1 + e^{2x})
  // (one MUFU.EX2 + one MUFU.RCP; saturates to +-cap without NaN for large |x|).
  template <typename TensorS>
  __device__ __forceinline__ void Softcap(TensorS& s) const {
#pragma unroll
    for (int i = 0; i < size(s); ++i) {
      const float e = Exp2Ftz(s(i) * params.softcap_exp2_scale);
      s(i) = fmaf(-2.f * params.softcap, __fdividef(1.f, 1.f + e), params.softcap);
    }
  }

  template <typename TensorS>
  __device__ __forceinline__ static auto ToP(TensorS const& s) {
    return sm90::ToP<Element, kBlockN>(s);
  }

  // O (tOrO, cleared by the caller) and the softmax state of this warpgroup's rows over the key
  // tiles `tiles` of a work tile whose keys end at key_end, diag = key_end - its query rows (the
  // bottom-right causal alignment); Q (tSrQ) must be in smem. last_tile (non-persistent): the CTA's
  // only tile, where consumer 1 skips its last hand-over so every arrive meets a sync; persistent
  // CTAs keep handing over and consumer 0 syncs once more at exit.
  template <typename MmaQK, typename MmaPV, typename TQ, typename TK, typename TV, typename TO>
  __device__ __forceinline__ void Run(KeyTiles const& tiles, int row_base, int diag, int key_end,
                                      bool last_tile, MmaQK& mma_qk, MmaPV& mma_pv,
                                      TQ const& tSrQ, TK const& tSrK, TV const& tOrV, TO& tOrO,
                                      OnlineSoftmax& softmax) {
    auto mask = [&](auto& s, int n) { Mask(s, n, row_base, diag, key_end); };
    auto hand_over = [&](bool last) {
      if (!(last && last_tile && consumer == 1))
        cutlass::arch::NamedBarrier::arrive(kConsumerThreads, other_turn);
    };

    int n = tiles.n_end - 1;
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kRows>, Int<kBlockN>>{});
    pipe_k.consumer_wait(read_k);
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, my_turn);
    Gemm<true, false>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
    hand_over(n == tiles.n_begin);
    warpgroup_wait<0>();
    pipe_k.consumer_release(read_k);
    ++read_k;
    if constexpr (kSoftcap) Softcap(tSrS);
    mask(tSrS, n);
    // Early rescale: the correction of the latest softmax step waits here until the next
    // step's S is issued (the first one scales O = 0: harmless).
    float correction[2];
    softmax.Step(tSrS, correction);
    Tensor tOrP = ToP(tSrS);

    // One step: S_n issued with P_{n+1} V_{n+1}; softmax of S_n while P V runs.
    auto step = [&](int n, auto masked) {
      Tensor s = partition_fragment_C(mma_qk, Shape<Int<kRows>, Int<kBlockN>>{});
      pipe_k.consumer_wait(read_k);
      cutlass::arch::NamedBarrier::sync(kConsumerThreads, my_turn);
      Gemm<true, false>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), s);
      // O is idle here (the last P V completed); the tensor cores are busy with S.
      if constexpr (Cfg::kEarlyRescale) ScaleRows(tOrO, correction);
      pipe_v.consumer_wait(read_v);
      Gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
      hand_over(n == tiles.n_begin);
      warpgroup_wait<1>();
      pipe_k.consumer_release(read_k);
      ++read_k;
      if constexpr (kSoftcap) Softcap(s);
      if constexpr (decltype(masked)::value) mask(s, n);
      float corr[2];
      softmax.Step(s, corr);
      warpgroup_wait<0>();
      pipe_v.consumer_release(read_v);
      ++read_v;
      if constexpr (Cfg::kEarlyRescale) {
        correction[0] = corr[0];
        correction[1] = corr[1];
      } else {
        ScaleRows(tOrO, corr);
      }
      Tensor p = ToP(s);
#pragma unroll
      for (int i = 0; i < size(p); ++i) tOrP(i) = p(i);
    };
    // The remaining tiles, n_end - 2 down to n_begin, in three straight passes: the masked
    // right edge (>= n_mask_begin), the unmasked middle (>= n_mask_end), the masked left
    // edge (the rest, < n_mask_end). A tile in [n_mask_begin, n_mask_end) (narrow window)
    // goes with the first pass. One loop around both kinds of step kept the state of both
    // live at once and spilled (benchmarks/notes/NOTES_sm90.md, spill fix). Persistent: only a count lives
    // across the middle (its step uses no n); the left edge's range and start come from
    // the held tile again (n there is min(n_end - 2, n_mask_begin - 1, n_mask_end - 1)).
    for (n = tiles.n_end - 2; n >= tiles.n_mask_begin; --n) step(n, cute::true_type{});
    for (int c = n - tiles.n_mask_end; c >= 0; --c, --n) step(n, cute::false_type{});
    const KeyTiles left = kPersistent ? scheduler.Keys(LoadTile(shared.held[consumer])) : tiles;
    if constexpr (kPersistent)
      n = min(left.n_end - 2, min(left.n_mask_begin, left.n_mask_end) - 1);
    for (; n >= left.n_begin; --n) step(n, cute::true_type{});

    if constexpr (Cfg::kEarlyRescale) ScaleRows(tOrO, correction);
    pipe_v.consumer_wait(read_v);
    Gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
    warpgroup_wait<0>();
    pipe_v.consumer_release(read_v);
    ++read_v;
  }
};

}  // namespace jax_sgl::cuda::sm90
