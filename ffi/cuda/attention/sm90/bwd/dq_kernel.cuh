// The sm_90a deterministic dQ kernel of the attention backward: one CTA per (128 query rows, q
// head, batch), shapes and math in dq_config.h. It runs after the dK/dV kernel (kernel.cuh or
// wide_kernel.cuh, launched without dq_accum) when deterministic=True: every dQ row is the sum
// over key tiles in one fixed order, inside one CTA, so two runs give the same bits.
// kVarlen (cu_seqlens_q and cu_seqlens_k): one CTA per linear 128-row block of all sequences
// (varlen_block.cuh), Q / dO / K / V at the sequence's rows of packed views, the row values at
// the workspace's per-sequence padding (PaddedSeqRow0), dQ stored row by row (a TMA box would
// write into the next sequence).
// Warpgroup 0: one thread TMA-loads the CTA's Q and dO halves once and streams the visible K / V
// tiles (both on one stage of a PipelineTmaAsync ring). Warpgroups 1 and 2: 64 rows each, lse2
// and D of their rows in registers (rows past seqlen_q get lse2 = +inf, so their P is 0).
// Causal / sliding window (bottom-right aligned) and seqused_k as in bwd_kernel.cuh: only the key
// tiles some row of the CTA sees are loaded; only tiles that cross a row's window edge or the
// key end mask.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "ffi/cuda/attention/sm90/bwd/dq_config.h"
#include "ffi/cuda/attention/sm90/bwd/kernel.cuh"  // StorePairs (Gemm, AccToA: sm90/wgmma.cuh)
#include "ffi/cuda/attention/sm90/bwd/varlen_block.cuh"
#include "ffi/cuda/attention/sm90/fwd/softmax.h"      // AccCoord
#include "ffi/cuda/attention/sm90/gmem_view.h"  // HeadTiles

namespace jax_sgl::cuda::sm90 {

template <typename Cfg>
struct BwdDqKernelParams {
  typename Cfg::TmaRows tma_q;
  typename Cfg::TmaRows tma_do;
  typename Cfg::TmaKV tma_k;
  typename Cfg::TmaKV tma_v;
  typename Cfg::TmaRowsStore tma_dq;
  typename Cfg::GmemShape q_shape;   // [seqlen_q, head_dim, num_heads, batch] (q, dout, dq)
  typename Cfg::GmemShape kv_shape;  // [seqlen_k, head_dim, num_kv_heads, batch]
  const float* lse2;                 // [batch, num_heads, ws_rows], as in BwdKernelParams
  const float* dsum;                 // [batch, num_heads, ws_rows]
  const int* seqused_k;              // [batch] or nullptr
  int seqlen_q;
  int seqlen_k;
  int num_heads;
  int group;
  int ws_rows;
  float softmax_scale;
  float scale_log2;
  float softcap_scale;  // as in BwdKernelParams
  float cap_log2;
  int window_left;   // as in BwdKernelParams: -1 unbounded, causal = window_right 0
  int window_right;
  // Varlen (the kVarlen instantiation only; appended, so the dense kernel's fields keep their
  // places): q / dout / dq and k / v as packed rows [total, head dim, heads, 1], the row values
  // in the workspace padded per sequence to ws_align rows.
  const int* cu_seqlens_q;  // [batch + 1], or nullptr (dense)
  const int* cu_seqlens_k;
  int total_q;
  int total_k;
  int batch;
  int ws_align;
  typename Cfg::Element* dq;  // [total_q, num_heads, head_dim]
};

enum class BwdDqBarrier : uint32_t { kEpilogue0 = 0, kEpilogue1 = 1 };

template <typename Cfg, bool kVarlen = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    FlashBwdSm90DqKernel(CUTE_GRID_CONSTANT BwdDqKernelParams<Cfg> const params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Cfg::Element;
  using Pipeline = typename Cfg::Pipeline;
  using PipelineState = cutlass::PipelineState<Cfg::kStages>;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kRows = Cfg::kWarpgroupRows;
  constexpr int kConsumerThreads = 128 * Cfg::kConsumers;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);

  const int warpgroup = WarpgroupIndex();  // warp-uniform to ptxas (sm90/wgmma.cuh)
  const int thread_in_wg = threadIdx.x % 128;
  // With a right window bound (causal) later rows see more keys: launch them first (varlen:
  // later sequences first too; the blocks past the last sequence's come first and return).
  const int lin = params.window_right >= 0 ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  [[maybe_unused]] BwdSeqBlock seq{};
  if constexpr (kVarlen) {
    if (!BwdVarlenBlock<true>(params, lin, kBlockM, params.ws_align, seq)) return;  // whole CTA
  }
  const int m_block = kVarlen ? seq.n_block : lin;
  const int head = blockIdx.y;
  const int batch = kVarlen ? seq.batch : int(blockIdx.z);
  const int kv_head = head / params.group;
  const int m0 = m_block * kBlockM;
  const int k_len = kVarlen ? seq.k_len : UsedKeys(params.seqused_k, batch, params.seqlen_k);
  // Rows of this sequence (dense reads params.seqlen_q at each use, as before varlen).
  const int diag = k_len - (kVarlen ? seq.q_len : params.seqlen_q);
  // Key tiles [n_begin, n_end): from the first row's window start to the last row's window end.
  const int wl = params.window_left, wr = params.window_right;
  const int key_begin = wl >= 0 ? max(0, m0 + diag - wl) : 0;
  const int key_end = wr >= 0 ? min(k_len, m0 + kBlockM + diag + wr) : k_len;
  const int n_begin = key_begin / kBlockN;
  const int n_end = key_end > key_begin ? (key_end + kBlockN - 1) / kBlockN : n_begin;

  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = 2 * Cfg::kKVTileBytes;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer
                                    : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = kConsumerThreads;
  Pipeline pipe_kv(shared.pipe_kv, pipe_params, Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) shared.barrier_rows.init(1);
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Cfg::SmemLayoutRows{});
  Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename Cfg::SmemLayoutRows{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Cfg::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Cfg::SmemLayoutKV{});

  if (warpgroup == 0) {
    // ---- Producer ------------------------------------------------------------------------
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (threadIdx.x != 0) return;
    const int q_row0 = kVarlen ? seq.q_row0 : 0;
    auto tQ = HeadTiles<kVarlen, typename Cfg::RowsD>(params.tma_q, params.q_shape, sQ, head, batch,
                                                      q_row0);
    auto tdO = HeadTiles<kVarlen, typename Cfg::RowsD>(params.tma_do, params.q_shape, sdO, head,
                                                       batch, q_row0);
    // Q and dO always land (even with no key tile): the epilogue reuses the Q smem.
    shared.barrier_rows.arrive_and_expect_tx(2 * Cfg::kConsumers * Cfg::kRowsHalfBytes);
    auto& bar_rows = reinterpret_cast<uint64_t&>(shared.barrier_rows);
    for (int half = 0; half < Cfg::kConsumers; ++half) {
      copy(params.tma_q.with(bar_rows, 0), get<0>(tQ)(_, 2 * m_block + half), get<1>(tQ)(_, half));
      copy(params.tma_do.with(bar_rows, 0), get<0>(tdO)(_, 2 * m_block + half),
           get<1>(tdO)(_, half));
    }
    const int k_row0 = kVarlen ? seq.k_row0 : 0;
    auto tK = HeadTiles<kVarlen, typename Cfg::KeysD>(params.tma_k, params.kv_shape, sK, kv_head,
                                                      batch, k_row0);
    auto tV = HeadTiles<kVarlen, typename Cfg::KeysD>(params.tma_v, params.kv_shape, sV, kv_head,
                                                      batch, k_row0);
    PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    for (int n = n_begin; n < n_end; ++n) {
      pipe_kv.producer_acquire(write);
      uint64_t* bar = pipe_kv.producer_get_barrier(write);
      copy(params.tma_k.with(*bar, 0), get<0>(tK)(_, n), get<1>(tK)(_, write.index()));
      copy(params.tma_v.with(*bar, 0), get<0>(tV)(_, n), get<1>(tV)(_, write.index()));
      ++write;
    }
  } else {
    // ---- Consumers -----------------------------------------------------------------------
    cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    const int consumer = warpgroup - 1;
    Tensor sKt = make_tensor(make_smem_ptr(shared.k.data()), typename Cfg::SmemLayoutKt{});

    typename Cfg::MmaS mma_s;
    typename Cfg::MmaDq mma_dq;
    auto thr_s = mma_s.get_thread_slice(thread_in_wg);
    auto thr_dq = mma_dq.get_thread_slice(thread_in_wg);
    Tensor tSrQ = thr_s.partition_fragment_A(sQ(_, _, consumer));
    Tensor tSrdO = thr_s.partition_fragment_A(sdO(_, _, consumer));
    Tensor tSrK = thr_s.partition_fragment_B(sK);   // [.., stage]
    Tensor tSrV = thr_s.partition_fragment_B(sV);   // [.., stage]
    Tensor tdQrK = thr_dq.partition_fragment_B(sKt);  // [.., stage]
    Tensor tdQrdQ = partition_fragment_C(mma_dq, typename Cfg::RowsD{});
    clear(tdQrdQ);

    const AccCoord coord(thread_in_wg);
    const int row_base = m0 + consumer * kRows + coord.row0;  // query row of r = 0
    float lse2[2], dsum[2];
    const int64_t row_values = kVarlen
        ? seq.ws_row0 + int64_t(head) * params.ws_rows
        : (int64_t(batch) * params.num_heads + head) * params.ws_rows;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_base + 8 * r;
      const bool ok = row < (kVarlen ? seq.q_len : params.seqlen_q);
      lse2[r] = ok ? params.lse2[row_values + row] : INFINITY;
      dsum[r] = ok ? params.dsum[row_values + row] : 0.f;
    }

    shared.barrier_rows.wait(0);
    PipelineState read;
    for (int n = n_begin; n < n_end; ++n) {
      Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kRows>, Int<kBlockN>>{});
      Tensor tSrdP = partition_fragment_C(mma_s, Shape<Int<kRows>, Int<kBlockN>>{});
      pipe_kv.consumer_wait(read);
      Gemm<true, false>(mma_s, tSrQ, tSrK(_, _, _, read.index()), tSrS);
      Gemm<true, false>(mma_s, tSrdO, tSrV(_, _, _, read.index()), tSrdP);
      // Unmasked: every row of the CTA sees every key of the tile.
      const bool masked = (n + 1) * kBlockN > k_len ||
                          (wr >= 0 && (n + 1) * kBlockN - 1 > m0 + diag + wr) ||
                          (wl >= 0 && n * kBlockN < m0 + kBlockM - 1 + diag - wl);
      // Per row r the visible keys [begin[r], end[r]), relative to this thread's column 0.
      int begin[2], end[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row_diag = row_base + 8 * r + diag;
        end[r] = wr >= 0 ? min(k_len, row_diag + wr + 1) : k_len;
        begin[r] = wl >= 0 ? row_diag - wl : 0;
        end[r] -= n * kBlockN + coord.col0;
        begin[r] -= n * kBlockN + coord.col0;
      }
      auto lse = [&](int i) { return lse2[AccCoord::Row(i) / 8]; };
      auto d = [&](int i) { return dsum[AccCoord::Row(i) / 8]; };
      auto visible = [&](int i) {
        const int r = AccCoord::Row(i) / 8;
        return AccCoord::Col(i) >= begin[r] && AccCoord::Col(i) < end[r];
      };
      if (params.cap_log2 == 0.f) {
        warpgroup_wait<1>();
        warpgroup_fence_operand(tSrS);
        ScoresToP(tSrS, params.scale_log2, masked, lse, visible);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrdP);
        PToDs(tSrS, tSrdP, d);
      } else {
        // Softcap (as in kernel.cuh): P and dS in one pass after both GEMMs.
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrS);
        warpgroup_fence_operand(tSrdP);
#pragma unroll
        for (int i = 0; i < size(tSrS); ++i) {
          const int r = AccCoord::Row(i) / 8;
          const float t = tanhf(tSrS(i) * params.softcap_scale);
          const float p =
              !masked || visible(i) ? Exp2Ftz(fmaf(t, params.cap_log2, -lse2[r])) : 0.f;
          tSrdP(i) = p * (tSrdP(i) - dsum[r]) * (1.f - t * t);
        }
      }
      Tensor tdSrdS = AccToA<Element, kBlockN>(tSrdP);
      Gemm<false, true>(mma_dq, tdSrdS, tdQrK(_, _, _, read.index()), tdQrdQ);
      warpgroup_wait<0>();
      pipe_kv.consumer_release(read);
      ++read;
    }
    warpgroup_fence_operand(tdQrdQ);

    // ---- Epilogue: dQ x softmax_scale -> this consumer's Q half -> TMA store --------------
    // The half is free: only this warpgroup read it, and its last wgmma has completed.
    Tensor tdQsQ = thr_dq.partition_C(sQ(_, _, consumer));
    Tensor dq = make_tensor_like<Element>(tdQrdQ);
#pragma unroll
    for (int i = 0; i < size(tdQrdQ); ++i) dq(i) = Element(tdQrdQ(i) * params.softmax_scale);
    StorePairs(dq, tdQsQ);
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(128, uint32_t(BwdDqBarrier::kEpilogue0) + consumer);
    if constexpr (kVarlen) {
      // Row by row: one 16-byte chunk (8 features, whole under the swizzle) a thread at a time;
      // rows past the sequence's end are left alone (the next sequence's, or the zero fill).
      const int row0 = m0 + consumer * kRows;
      const int64_t row_stride = int64_t(params.num_heads) * Cfg::kHeadDim;
      StoreSmemRows<Cfg::kHeadDim>(
          params.dq + (int64_t(seq.q_row0) + row0) * row_stride + head * Cfg::kHeadDim,
          row_stride, max(0, min(seq.q_len - row0, kRows)), sQ(_, _, consumer), thread_in_wg);
    } else if (thread_in_wg == 0) {
      Tensor mdQ = params.tma_dq.get_tma_tensor(params.q_shape);
      Tensor gdQ = local_tile(mdQ(_, _, head, batch), typename Cfg::RowsD{},
                              make_coord(2 * m_block + consumer, _0{}));
      auto cta = params.tma_dq.get_slice(_0{});
      copy(params.tma_dq, cta.partition_S(sQ(_, _, consumer)), cta.partition_D(gdQ));
      tma_store_arrive();
      tma_store_wait<0>();
    }
  }
#endif
}

}  // namespace jax_sgl::cuda::sm90
