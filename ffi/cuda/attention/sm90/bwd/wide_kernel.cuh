// The sm_90a flash attention backward for the wide head dims (192, 256; dense layout):
// FlashBwdSm90WideKernel, one CTA per (64 keys, kv head, batch); shapes and the per-step math are
// in wide_config.h. It shares kernel.cuh's parameters (BwdKernelParams, without the tail split),
// step order, masking rules, score math and dq_accum layout (DqAccumIndex per consumer part, so
// FlashBwdSm90DqConvertKernel converts it); what differs is who owns what: the two consumers
// split the head dim of dK, dV and dQ and the query rows of S^T / dP^T, and P^T, dS^T go through
// smem because each consumer's dV / dK GEMM reads all of them.
// dK and dV are stored once at the end through the K / V smem by TMA (deterministic); dQ goes to
// dq_accum, or with dq_accum == nullptr (deterministic=True) nowhere: dq_kernel.cuh computes it.
// kVarlen (cu_seqlens_q and cu_seqlens_k): one CTA per linear key block of all sequences
// (varlen_block.cuh), Q / dO / K / V tiles at the sequence's rows of packed views, the row
// values and dq_accum in the padded workspace (PaddedSeqRow0), dK / dV stored row by row from
// smem (a TMA box would run into the next sequence's rows). Rows of a tile past the sequence's end
// are the next sequence's (finite): masked like rows past seqlen_q, so they add nothing.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "ffi/cuda/attention/sm90/bwd/kernel.cuh"
#include "ffi/cuda/attention/sm90/bwd/varlen_block.cuh"
#include "ffi/cuda/attention/sm90/bwd/wide_config.h"
#include "ffi/cuda/attention/sm90/gmem_view.h"  // HeadTiles

namespace jax_sgl::cuda::sm90 {

// kSoftcap: the softcap path, else the plain one (one kernel each, as FlashBwdSm90Kernel).
template <typename Cfg, bool kSoftcap, bool kVarlen = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    FlashBwdSm90WideKernel(CUTE_GRID_CONSTANT BwdKernelParams<Cfg> const params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Cfg::Element;
  using Pipeline = typename Cfg::Pipeline;
  using PipelineState = cutlass::PipelineState<Cfg::kStages>;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kHalf = Cfg::kHalf;
  constexpr int kScoreRows = Cfg::kScoreRows;
  constexpr int kConsumerThreads = 128 * Cfg::kConsumers;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);

  const int warpgroup = WarpgroupIndex();  // warp-uniform to ptxas (sm90/wgmma.cuh)
  const int thread_in_wg = threadIdx.x % 128;
  const int kv_head = blockIdx.y;
  BwdSeqBlock seq;
  if constexpr (kVarlen) {
    if (!BwdVarlenBlock(params, int(blockIdx.x), kBlockN, kBlockM, seq)) return;  // whole CTA
  } else {
    seq.n_block = blockIdx.x;  // causal: low key blocks have the most rows, launched first
    seq.batch = blockIdx.z;
    seq.q_row0 = seq.k_row0 = 0;  // the TMA views' batch mode places the sequence
    seq.q_len = params.seqlen_q;
    // Keys of this sequence (seqused_k): as FlashBwdSm90Kernel.
    seq.k_len = UsedKeys(params.seqused_k, seq.batch, params.seqlen_k);
    seq.ws_row0 = int64_t(seq.batch) * params.num_heads * params.ws_rows;
  }
  const int n_block = seq.n_block, batch = seq.batch, q_len = seq.q_len, k_len = seq.k_len;
  const int n0 = n_block * kBlockN;
  const RowBlocks rows(n0, kBlockM, kBlockN, q_len, k_len, params.window_left,
                       params.window_right);
  const int m_steps = n0 < k_len ? rows.m_end - rows.m_begin : 0;  // per q head
  const int steps = m_steps * params.group;

  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Cfg::kRowsTileBytes + Cfg::kRowFloatsBytes;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer
                                    : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = kConsumerThreads;
  Pipeline pipe_q(shared.pipe_q, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipe_do(shared.pipe_do, pipe_params, Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) shared.barrier_kv.init(1);
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Cfg::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Cfg::SmemLayoutKV{});
  Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Cfg::SmemLayoutRows{});
  Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename Cfg::SmemLayoutRows{});

  if (warpgroup == 0) {
    // ---- Producer ------------------------------------------------------------------------
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (threadIdx.x != 0) return;
    auto tK = HeadTiles<kVarlen, typename Cfg::KeysD>(params.tma_k, params.kv_shape, sK, kv_head,
                                                      batch, seq.k_row0);
    auto tV = HeadTiles<kVarlen, typename Cfg::KeysD>(params.tma_v, params.kv_shape, sV, kv_head,
                                                      batch, seq.k_row0);
    shared.barrier_kv.arrive_and_expect_tx(2 * Cfg::kKVTileBytes);
    auto& bar_kv = reinterpret_cast<uint64_t&>(shared.barrier_kv);
    copy(params.tma_k.with(bar_kv, 0), get<0>(tK)(_, n_block), get<1>(tK)(_, 0));
    copy(params.tma_v.with(bar_kv, 0), get<0>(tV)(_, n_block), get<1>(tV)(_, 0));

    PipelineState write_q = cutlass::make_producer_start_state<Pipeline>();
    PipelineState write_do = cutlass::make_producer_start_state<Pipeline>();
    // Step order: q head by q head, each over its row blocks.
    for (int g = 0; g < (steps > 0 ? params.group : 0); ++g) {
      const int head = kv_head * params.group + g;
      auto tQ = HeadTiles<kVarlen, typename Cfg::RowsD>(params.tma_q, params.q_shape, sQ, head,
                                                        batch, seq.q_row0);
      auto tdO = HeadTiles<kVarlen, typename Cfg::RowsD>(params.tma_do, params.q_shape, sdO, head,
                                                         batch, seq.q_row0);
      const int64_t row_values = seq.ws_row0 + int64_t(head) * params.ws_rows;
      for (int m = rows.m_begin; m < rows.m_end; ++m)
        ProduceStep(params, shared, pipe_q, pipe_do, write_q, write_do, tQ, tdO, m, row_values);
    }
    return;
  }

  // ---- Consumers -------------------------------------------------------------------------
  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
  const int consumer = warpgroup - 1;

  Tensor sQt = make_tensor(make_smem_ptr(shared.q.data()), typename Cfg::SmemLayoutRowsT{});
  Tensor sdOt = make_tensor(make_smem_ptr(shared.dout.data()), typename Cfg::SmemLayoutRowsT{});
  Tensor sKt = make_tensor(make_smem_ptr(shared.k.data()), typename Cfg::SmemLayoutKt{});
  Tensor sPt = make_tensor(make_smem_ptr(shared.p.data()), typename Cfg::SmemLayoutPt{});
  Tensor sdSt = make_tensor(make_smem_ptr(shared.ds.data()), typename Cfg::SmemLayoutPt{});
  Tensor sdS = make_tensor(make_smem_ptr(shared.ds.data()), typename Cfg::SmemLayoutDs{});

  typename Cfg::MmaSdP mma_sdp;
  typename Cfg::MmaKV mma_kv;
  typename Cfg::MmaDq mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(thread_in_wg);
  auto thr_kv = mma_kv.get_thread_slice(thread_in_wg);
  auto thr_dq = mma_dq.get_thread_slice(thread_in_wg);

  // Scores: this consumer's 32 query rows of the tile, against all 64 keys over the head dim.
  using ScoreRows = Shape<Int<kScoreRows>, Int<Cfg::kHeadDim>, Int<Cfg::kStages>>;
  Tensor tSrK = thr_sdp.partition_fragment_A(sK(_, _, 0));
  Tensor tSrQ = thr_sdp.partition_fragment_B(
      local_tile(sQ, ScoreRows{}, make_coord(consumer, _0{}, _0{})));  // [.., stage]
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV(_, _, 0));
  Tensor tdPrdO = thr_sdp.partition_fragment_B(
      local_tile(sdO, ScoreRows{}, make_coord(consumer, _0{}, _0{})));  // [.., stage]
  // Where this consumer's P^T / dS^T columns go, as the S^T accumulator holds them: [.., buffer].
  using ScoreCols = Shape<Int<kBlockN>, Int<kScoreRows>, _2>;
  Tensor tPsP = thr_sdp.partition_C(local_tile(sPt, ScoreCols{}, make_coord(_0{}, consumer, _0{})));
  Tensor tdSsdS =
      thr_sdp.partition_C(local_tile(sdSt, ScoreCols{}, make_coord(_0{}, consumer, _0{})));
  // dV / dK over this consumer's features: all of P^T / dS^T against dO / Q's columns.
  using HalfRows = Shape<Int<kHalf>, Int<kBlockM>, Int<Cfg::kStages>>;
  Tensor tdVrP = thr_kv.partition_fragment_A(sPt);    // [.., buffer]
  Tensor tdKrdS = thr_kv.partition_fragment_A(sdSt);  // [.., buffer]
  Tensor tdVrdO = thr_kv.partition_fragment_B(
      local_tile(sdOt, HalfRows{}, make_coord(consumer, _0{}, _0{})));  // [.., stage]
  Tensor tdKrQ = thr_kv.partition_fragment_B(
      local_tile(sQt, HalfRows{}, make_coord(consumer, _0{}, _0{})));  // [.., stage]
  // dQ part: this consumer's columns of the tile, against all 64 keys.
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);  // [.., buffer]
  Tensor tdQrK = thr_dq.partition_fragment_B(
      local_tile(sKt, Shape<Int<kHalf>, Int<kBlockN>>{}, make_coord(consumer, _0{})));

  Tensor tdVrdV = partition_fragment_C(mma_kv, typename Cfg::KeysHalf{});
  Tensor tdKrdK = partition_fragment_C(mma_kv, typename Cfg::KeysHalf{});
  clear(tdVrdV);
  clear(tdKrdK);

  const AccCoord coord(thread_in_wg);
  const int key_base = n0 + coord.row0;  // key of accumulator row r = 0
  const int diag = k_len - q_len;

  // K and V land even when there is no step: the epilogue reuses their smem.
  shared.barrier_kv.wait(0);
  PipelineState read_q, read_do;
  for (int step = 0; step < steps; ++step) {
    const int g = step / m_steps;
    const int m = rows.m_begin + step % m_steps;
    const int head = kv_head * params.group + g;
    const int buf = step % 2;
    const int row0 = m * kBlockM;
    const int my_row0 = row0 + consumer * kScoreRows;  // query row of this consumer's column 0

    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kScoreRows>>{});
    Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kScoreRows>>{});
    pipe_q.consumer_wait(read_q);
    Gemm<true, false>(mma_sdp, tSrK, tSrQ(_, _, _, read_q.index()), tSrS);
    pipe_do.consumer_wait(read_do);
    Gemm<true, false>(mma_sdp, tdPrV, tdPrdO(_, _, _, read_do.index()), tdPrdP);

    // P^T = exp2(S^T scale log2e - lse2), zero where masked. Columns are query rows.
    const float* lse2 = shared.lse2[read_q.index()] + consumer * kScoreRows + coord.col0;
    const float* dsum = shared.dsum[read_do.index()] + consumer * kScoreRows + coord.col0;
    // Unmasked: every row of the step (both consumers' halves) sees every key of the CTA.
    const bool masked = StepMasked(params, row0, kBlockM, n0, kBlockN, q_len, k_len, diag);
    auto lse = [&](int i) { return lse2[AccCoord::Col(i)]; };
    auto d = [&](int i) { return dsum[AccCoord::Col(i)]; };
    auto visible = [&](int i) {
      return KeyVisible(params, key_base + AccCoord::Row(i),
                        my_row0 + coord.col0 + AccCoord::Col(i), q_len, k_len, diag);
    };
    Tensor tPrP = make_tensor_like<Element>(tSrS);
    if constexpr (!kSoftcap) {
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);  // no read of S^T above the wait
      ScoresToP(tSrS, params.scale_log2, masked, lse, visible);
#pragma unroll
      for (int i = 0; i < size(tSrS); ++i) tPrP(i) = Element(tSrS(i));
      // dS^T = P^T (dP^T - D).
      warpgroup_wait<0>();
      warpgroup_fence_operand(tdPrdP);
      PToDs(tSrS, tdPrdP, d);
    } else {
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      warpgroup_fence_operand(tdPrdP);
      SoftcapScoresToPDs(tSrS, tdPrdP, params.softcap_scale, params.cap_log2, masked, lse, d,
                         visible);
#pragma unroll
      for (int i = 0; i < size(tSrS); ++i) tPrP(i) = Element(tSrS(i));
    }
    Tensor tdSrdS = make_tensor_like<Element>(tdPrdP);
#pragma unroll
    for (int i = 0; i < size(tdPrdP); ++i) tdSrdS(i) = Element(tdPrdP(i));
    {
      Tensor tPsP_buf = tPsP(_, _, _, buf);
      Tensor tdSsdS_buf = tdSsdS(_, _, _, buf);
      StorePairs(tPrP, tPsP_buf);
      StorePairs(tdSrdS, tdSsdS_buf);
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> wgmma reads
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, uint32_t(BwdBarrier::kDsReady));

    Gemm<false, false>(mma_kv, tdVrP(_, _, _, buf), tdVrdO(_, _, _, read_do.index()), tdVrdV);
    if (params.dq_accum != nullptr) {
      // dq_accum: the workspace's rows x head dim, in kBlockM-row tiles.
      const int64_t dq_tile =
          (seq.ws_row0 + int64_t(head) * params.ws_rows + row0) * Cfg::kHeadDim;
      Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHalf>>{});
      Gemm<true, false>(mma_dq, tdQrdS(_, _, _, buf), tdQrK, tdQrdQ);
      // dK after dQ: it runs while the dQ part is reduced (as in FlashBwdSm90Kernel).
      Gemm<false, false>(mma_kv, tdKrdS(_, _, _, buf), tdKrQ(_, _, _, read_q.index()), tdKrdK);
      warpgroup_wait<1>();  // dV and dQ done; dK runs on (it reads Q: released below)
      warpgroup_fence_operand(tdQrdQ);
      pipe_do.consumer_release(read_do);
      RedAddDqPart(params.dq_accum + dq_tile + consumer * Cfg::kDqPartFloats, tdQrdQ,
                   thread_in_wg);
      warpgroup_wait<0>();
      pipe_q.consumer_release(read_q);
    } else {
      Gemm<false, false>(mma_kv, tdKrdS(_, _, _, buf), tdKrQ(_, _, _, read_q.index()), tdKrdK);
      warpgroup_wait<0>();
      pipe_q.consumer_release(read_q);
      pipe_do.consumer_release(read_do);
    }
    ++read_q;
    ++read_do;
  }

  // ---- Epilogue: dK (x softmax_scale) and dV -> the K / V smem -> TMA store ---------------
  warpgroup_fence_operand(tdKrdK);
  warpgroup_fence_operand(tdVrdV);
  // Both consumers' dQ GEMMs read all of K: wait for both before overwriting it.
  cutlass::arch::NamedBarrier::sync(kConsumerThreads, uint32_t(BwdBarrier::kMmaDone));
  Tensor tdKsK = thr_kv.partition_C(
      local_tile(sK(_, _, 0), typename Cfg::KeysHalf{}, make_coord(_0{}, consumer)));
  Tensor tdVsV = thr_kv.partition_C(
      local_tile(sV(_, _, 0), typename Cfg::KeysHalf{}, make_coord(_0{}, consumer)));
  StoreDkDv<Element>(tdKrdK, tdVrdV, params.softmax_scale, tdKsK, tdVsV);
  cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> TMA reads
  cutlass::arch::NamedBarrier::sync(kConsumerThreads, uint32_t(BwdBarrier::kEpilogue0));
  // Each tile holds both consumers' halves: consumer 0 stores dK, consumer 1 dV.
  auto store = [&](auto const& tma, auto const& tile) {
    Tensor mdX = tma.get_tma_tensor(params.kv_shape);
    Tensor gdX =
        local_tile(mdX(_, _, kv_head, batch), typename Cfg::KeysD{}, make_coord(n_block, _0{}));
    auto cta = tma.get_slice(_0{});
    copy(tma, cta.partition_S(tile), cta.partition_D(gdX));
    tma_store_arrive();
    tma_store_wait<0>();
  };
  if constexpr (kVarlen) {
    // Row by row, each consumer its tile (dK, dV); rows past the sequence's keys left to the
    // zero fill.
    const int kv_heads = params.num_heads / params.group;
    Element* dst = (consumer == 0 ? params.dk : params.dv) +
                   (int64_t(seq.k_row0 + n0) * kv_heads + kv_head) * Cfg::kHeadDim;
    StoreSmemRows<Cfg::kHeadDim>(dst, int64_t(kv_heads) * Cfg::kHeadDim, min(k_len - n0, kBlockN),
                                 consumer == 0 ? sK(_, _, 0) : sV(_, _, 0), thread_in_wg);
  } else if (thread_in_wg == 0) {
    if (consumer == 0)
      store(params.tma_dk, sK(_, _, 0));
    else
      store(params.tma_dv, sV(_, _, 0));
  }
#endif
}

}  // namespace jax_sgl::cuda::sm90
