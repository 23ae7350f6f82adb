// The sm_90a flash attention backward kernels (dense layout), FlashAttention-3 style:
//
// FlashBwdSm90Kernel: one CTA per (128 keys, kv head, batch); shapes and the per-step math are in
// bwd_config.h. Warpgroup 0 is the producer: one thread loads K and V once (TMA) and then, for
// every step (q head of the GQA group x block of kBlockM query rows that can see the CTA's keys),
// the Q tile with its lse2 row values and the dO tile with its D values into kStages-deep rings
// (cutlass::PipelineTmaAsync; the row values ride on the tiles' barriers as bulk copies).
// Warpgroups 1 and 2 own 64 keys each. dK and dV stay in registers until the end and are stored
// once through smem by TMA: no atomics for them, and the q heads of a GQA group are summed in
// order inside the CTA, so dK and dV are deterministic.
// dQ gets a contribution from every key block: each step's dQ part (float32, 64 x 64 per
// consumer) is added to dq_accum with red.global.add.v4.f32, in the accumulator's own register
// order (see DqAccumIndex), and FlashBwdSm90DqConvertKernel turns the sums into dQ. The order of
// the float additions varies from run to run: this dQ is not bitwise reproducible. With dq_accum
// == nullptr the kernel skips dQ (the deterministic mode computes it with the dQ kernel of
// bwd_dq_kernel.cuh, or the sm80 one).
//
// seqused_k (dense): keys past a sequence's count are masked like keys past seqlen_k, and the
// causal diagonal / window ends at its last used key.
// Masking: a step is masked when its rows or the CTA's keys run past the ends or a row of the
// step does not see every key of the CTA (causal diagonal, sliding window: bottom-right
// aligned); the other steps skip the mask code. Rows whose window misses the CTA's keys are not
// visited at all. Q/dO rows past seqlen_q are zero-filled by TMA; dK/dV rows past seqlen_k
// are clipped by the TMA store.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "ffi/cuda/attention/flash_bwd_launch.h"  // FindPaddedSeq
#include "ffi/cuda/attention/sm90/bwd/config.h"
#include "ffi/cuda/attention/sm90/bwd/varlen_block.cuh"
#include "ffi/cuda/attention/sm90/fwd/softmax.h"  // AccCoord
#include "ffi/cuda/attention/sm90/gmem_view.h"  // HeadTiles
#include "ffi/cuda/attention/sm90/wgmma.cuh"

namespace jax_sgl::cuda::sm90 {

template <typename Cfg>
struct BwdKernelParams {
  typename Cfg::TmaRows tma_q;
  typename Cfg::TmaRows tma_do;
  typename Cfg::TmaKV tma_k;
  typename Cfg::TmaKV tma_v;
  typename Cfg::TmaKVStore tma_dk;
  typename Cfg::TmaKVStore tma_dv;
  typename Cfg::GmemShape q_shape;   // [seqlen_q, head_dim, num_heads, batch] (q, dout)
  typename Cfg::GmemShape kv_shape;  // [seqlen_k, head_dim, num_kv_heads, batch] (k, v, dk, dv)
  const float* lse2;  // [batch, num_heads, ws_rows]: lse * log2(e), +inf for fully masked rows
  const float* dsum;  // [batch, num_heads, ws_rows]: D = rowsum(dO * O) - dlse
  float* dq_accum;    // [batch, num_heads, m_blocks, kBlockM * head_dim] (zeroed), or nullptr
  const int* seqused_k;  // [batch]: keys of each sequence (<= seqlen_k), or nullptr (all)
  int seqlen_q;
  int seqlen_k;
  int num_heads;
  int group;          // num_heads / num_kv_heads
  int ws_rows;        // seqlen_q rounded up to kBlockM: every step's row values are in bounds
  float softmax_scale;
  float scale_log2;   // softmax_scale * log2(e)
  float softcap_scale;  // softmax_scale / softcap (softcap only)
  float cap_log2;       // softcap * log2(e); 0: no softcap
  // Row i sees keys [i + diag - window_left, i + diag + window_right] (diag = k_len - seqlen_q:
  // bottom-right aligned), -1 = unbounded; causal is window_right = 0.
  int window_left;
  int window_right;
  // Tail split (launch.cuh, Sm90BwdTailSplitRequested): key blocks from num_whole on, in
  // (key block, kv head, batch) order, are the last, partial wave's. The main kernel skips them;
  // the kTail kernel runs each on tail_splits CTAs over shares of its steps, which store dK
  // (scaled) and dV in float32 to tail_dk / tail_dv for FlashBwdSm90TailSum. Off: num_whole is
  // every block.
  int n_blocks;        // key blocks per (kv head, batch)
  int num_whole;
  int tail_splits;
  float* tail_dk;      // [tail block, split, kBlockN, head_dim]
  float* tail_dv;
  // Causal launch order (launch.cuh BwdSectionHeads): > 0 runs the grid's blocks key block major
  // within sections of section_heads (kv head, batch) pairs, so the longest blocks (low key
  // blocks see the most rows) go first across a section and the grid ends on short ones; a
  // section's Q, dO and dQ accumulators fit in L2. 0: the grid's own order (key block fastest).
  int section_heads;
  // Varlen (the kVarlen instantiations only; appended, so the dense kernels' fields
  // keep their places): q / dout and k / v as packed rows [total, head dim, heads, 1], one CTA
  // per linear key block of all sequences (varlen_block.cuh), the workspace per sequence at
  // PaddedSeqRow0, dK / dV stored row by row.
  const int* cu_seqlens_q;  // [batch + 1], or nullptr (dense)
  const int* cu_seqlens_k;
  int total_q;
  int total_k;
  int batch;
  typename Cfg::Element* dk;  // [total_k, num_kv_heads, head_dim]
  typename Cfg::Element* dv;
};

// Named barriers (ids after CUTLASS's reserved ones).
enum class BwdBarrier : uint32_t {
  kDsReady = 0,
  kMmaDone = 1,
  kEpilogue0 = 2,
  kEpilogue1 = 3,
};

// Query-row blocks a CTA with keys [n0, n0 + block_n) visits, per q head: [m_begin, m_end), the
// blocks of the rows whose key window reaches one of those keys: rows from n0 - diag -
// window_right (the first whose window ends at or past n0) to n_last - diag + window_left.
struct RowBlocks {
  int m_begin;
  int m_end;
  __device__ RowBlocks(int n0, int block_m, int block_n, int seqlen_q, int k_len, int window_left,
                       int window_right) {
    const int diag = k_len - seqlen_q;
    const int n_last = min(n0 + block_n, k_len) - 1;
    const int first_row = window_right >= 0 ? max(0, n0 - diag - window_right) : 0;
    const int last_row =
        window_left >= 0 ? min(seqlen_q - 1, n_last - diag + window_left) : seqlen_q - 1;
    m_begin = first_row / block_m;
    m_end = last_row < first_row ? m_begin : last_row / block_m + 1;
  }
};

// Float offset of element i (flat accumulator index, softmax.h's AccCoord order) of thread t's
// dQ part within its 64 x 64 block of dq_accum: groups of 4 consecutive registers (i = 4 j + e)
// are one 16-byte vector, and the 128 threads' vectors of a group j are contiguous, so a warp's
// reduction covers 512 consecutive bytes. The convert kernel inverts it (DqAccumRowCol).
constexpr __host__ __device__ __forceinline__ int DqAccumIndex(int j, int thread) {
  return (j * 128 + thread) * 4;
}

// Row and column within the consumer's 64 x 64 part of the float at offset f of its block.
__device__ __forceinline__ void DqAccumRowCol(int f, int* row, int* col) {
  const int e = f % 4, thread = (f / 4) % 128, j = f / 512;
  *row = 16 * (thread / 32) + (thread % 32) / 4 + 8 * (e / 2);
  *col = 8 * j + 2 * (thread % 4) + e % 2;
}

// Stores a 16-bit fragment in accumulator order (softmax.h's AccCoord) to its smem partition. The
// two columns c = 0, 1 of a pair are adjacent in the smem layouts used here (dS rows-contiguous,
// dK / dV head-dim contiguous) and inside one 16-byte swizzle chunk: one 32-bit st.shared each,
// where the element-wise copy compiles to generic 16-bit stores.
template <typename Frag, typename SmemTensor>
__device__ __forceinline__ void StorePairs(Frag const& frag, SmemTensor& smem) {
  using Element = typename Frag::value_type;
  static_assert(sizeof(Element) == 2);
#pragma unroll
  for (int i = 0; i < size(frag); i += 2) {
    const uint32_t addr = cast_smem_ptr_to_uint(raw_pointer_cast(&smem(i)));
    const Element pair[2] = {frag(i), frag(i + 1)};
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr),
                 "r"(*reinterpret_cast<const uint32_t*>(pair)));
  }
}

// The plain path's score math, shared by the dK/dV and dQ kernels (lse(i), dsum(i): element i's
// log2-domain lse and D). P = exp2(s scale_log2 - lse) in place, 0 where `masked` and !visible(i).
template <typename Acc, typename Lse, typename Visible>
__device__ __forceinline__ void ScoresToP(Acc& s, float scale_log2, bool masked, Lse lse,
                                          Visible visible) {
  if (masked) {
#pragma unroll
    for (int i = 0; i < size(s); ++i)
      s(i) = visible(i) ? Exp2Ftz(fmaf(s(i), scale_log2, -lse(i))) : 0.f;
  } else {
#pragma unroll
    for (int i = 0; i < size(s); ++i) s(i) = Exp2Ftz(fmaf(s(i), scale_log2, -lse(i)));
  }
}

// dS = P (dP - D) in place in dp.
template <typename AccP, typename AccDp, typename Dsum>
__device__ __forceinline__ void PToDs(const AccP& p, AccDp& dp, Dsum dsum) {
#pragma unroll
  for (int i = 0; i < size(dp); ++i) dp(i) = p(i) * (dp(i) - dsum(i));
}

// Whether a step of rows [row0, row0 + block_m) against the CTA's keys [n0, n0 + block_n) needs
// the mask: its rows or keys run past the ends, or a row does not see every key (causal
// diagonal, sliding window: bottom-right aligned, diag = k_len - q_len).
template <typename Cfg>
__device__ __forceinline__ bool StepMasked(BwdKernelParams<Cfg> const& params, int row0,
                                           int block_m, int n0, int block_n, int q_len,
                                           int k_len, int diag) {
  return n0 + block_n > k_len || row0 + block_m > q_len ||
         (params.window_right >= 0 && row0 + diag + params.window_right < n0 + block_n - 1) ||
         (params.window_left >= 0 && row0 + block_m - 1 + diag - params.window_left > n0);
}

// Whether query row `row` sees key `key`.
template <typename Cfg>
__device__ __forceinline__ bool KeyVisible(BwdKernelParams<Cfg> const& params, int key, int row,
                                           int q_len, int k_len, int diag) {
  return key < k_len && row < q_len &&
         (params.window_right < 0 || key <= row + diag + params.window_right) &&
         (params.window_left < 0 || key >= row + diag - params.window_left);
}

// Keys of sequence `batch`: seqused_k's count clamped to [0, seqlen_k], or seqlen_k.
__device__ __forceinline__ int UsedKeys(const int* seqused_k, int batch, int seqlen_k) {
  return seqused_k == nullptr ? seqlen_k : min(max(seqused_k[batch], 0), seqlen_k);
}

// The softcap path's score math (x = cap tanh(s scale / cap), so dS also takes x' = 1 - tanh^2):
// P and dS in one pass once both GEMMs are done. P in place in s (0 where `masked` and
// !visible(i)), dS = P (dP - D) x' in place in dp.
template <typename AccS, typename AccDp, typename Lse, typename Dsum, typename Visible>
__device__ __forceinline__ void SoftcapScoresToPDs(AccS& s, AccDp& dp, float softcap_scale,
                                                   float cap_log2, bool masked, Lse lse,
                                                   Dsum dsum, Visible visible) {
#pragma unroll
  for (int i = 0; i < size(s); ++i) {
    const float t = tanhf(s(i) * softcap_scale);
    const float p = !masked || visible(i) ? Exp2Ftz(fmaf(t, cap_log2, -lse(i))) : 0.f;
    dp(i) = p * (dp(i) - dsum(i)) * (1.f - t * t);
    s(i) = p;
  }
}

// Adds a consumer's float32 dQ part (accumulator order) to its block of dq_accum at dst.
// The vectors are one thread address plus constants (DqAccumIndex(j, t) = DqAccumIndex(0, t) +
// 512 j): each reduction then takes [base + immediate], where offsets summed in 32 bits gave
// eight 64-bit addresses a step (16 IADD3 / IMAD.X), sixteen registers held until the queued
// reductions had read them: ncu's per-SASS samples (H100, causal S 4k) put 9.5% of the main
// kernel's warp stalls on the next step's first write of one of them (long scoreboard). The
// offsets are written into the instruction: given as pointer sums, ptxas formed each address.
template <typename Acc>
__device__ __forceinline__ void RedAddDqPart(float* dst, const Acc& dq, int thread_in_wg) {
  float* base = dst + DqAccumIndex(0, thread_in_wg);
  constexpr int kVectors = decltype(size(dq))::value / 4;
  cute::for_each(cute::make_int_sequence<kVectors>{}, [&](auto j) {
    asm volatile("red.global.add.v4.f32 [%0+%5], {%1, %2, %3, %4};" ::"l"(base),
                 "f"(dq(4 * j)), "f"(dq(4 * j + 1)), "f"(dq(4 * j + 2)), "f"(dq(4 * j + 3)),
                 "n"(int(sizeof(float)) * DqAccumIndex(decltype(j)::value, 0))
                 : "memory");
  });
}

// dK x softmax_scale and dV, in the input dtype, into their smem partitions (the K / V tiles,
// free once every consumer's last GEMM that reads them is done).
template <typename Element, typename AccK, typename AccV, typename SmemK, typename SmemV>
__device__ __forceinline__ void StoreDkDv(const AccK& dk_acc, const AccV& dv_acc,
                                          float softmax_scale, SmemK& sk, SmemV& sv) {
  Tensor dk = make_tensor_like<Element>(dk_acc);
  Tensor dv = make_tensor_like<Element>(dv_acc);
#pragma unroll
  for (int i = 0; i < size(dk_acc); ++i) {
    dk(i) = Element(dk_acc(i) * softmax_scale);
    dv(i) = Element(dv_acc(i));
  }
  StorePairs(dk, sk);
  StorePairs(dv, sv);
}

// The producer's loads of step (row block m): the Q tile with its lse2 row values and the dO tile
// with its D values into the next stages of their rings (the row values ride on the tiles'
// barriers as bulk copies). Shared by FlashBwdSm90Kernel and FlashBwdSm90WideKernel.
template <typename Cfg, typename Pipeline, typename State, typename TQ, typename TdO>
__device__ __forceinline__ void ProduceStep(BwdKernelParams<Cfg> const& params,
                                            typename Cfg::SharedStorage& shared, Pipeline& pipe_q,
                                            Pipeline& pipe_do, State& write_q, State& write_do,
                                            TQ const& tQ, TdO const& tdO, int m,
                                            int64_t row_values) {
  pipe_q.producer_acquire(write_q);
  uint64_t* bar_q = pipe_q.producer_get_barrier(write_q);
  copy(params.tma_q.with(*bar_q, 0), get<0>(tQ)(_, m), get<1>(tQ)(_, write_q.index()));
  SM90_BULK_COPY_G2S::copy(params.lse2 + row_values + m * Cfg::kBlockM, bar_q,
                           shared.lse2[write_q.index()], Cfg::kRowFloatsBytes);
  ++write_q;
  pipe_do.producer_acquire(write_do);
  uint64_t* bar_do = pipe_do.producer_get_barrier(write_do);
  copy(params.tma_do.with(*bar_do, 0), get<0>(tdO)(_, m), get<1>(tdO)(_, write_do.index()));
  SM90_BULK_COPY_G2S::copy(params.dsum + row_values + m * Cfg::kBlockM, bar_do,
                           shared.dsum[write_do.index()], Cfg::kRowFloatsBytes);
  ++write_do;
}

// kSoftcap: the softcap path, else the plain one; the launcher picks per call. One kernel holding
// both paths runs ptxas out of registers, and it then serializes every wgmma (C7512).
// kTail: the tail split's shares (1-D grid, BwdKernelParams), a kernel of its own so that the
// main one keeps its block coordinates in the special registers (computed ones, held across
// the main loop, spilled at hd64).
// kVarlen (cu_seqlens_q and cu_seqlens_k): one CTA per linear key block of all sequences
// (varlen_block.cuh), Q / dO / K / V tiles at the sequence's rows of packed views, the row
// values and dq_accum in the padded workspace (PaddedSeqRow0), dK / dV stored row by row from
// smem (a TMA box would run into the next sequence's rows), as FlashBwdSm90WideKernel's. Rows of
// a tile past the sequence's end are the next sequence's (finite): masked like rows past
// seqlen_q, so they add nothing.
template <typename Cfg, bool kSoftcap, bool kTail = false, bool kVarlen = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    FlashBwdSm90Kernel(CUTE_GRID_CONSTANT BwdKernelParams<Cfg> const params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Cfg::Element;
  using Pipeline = typename Cfg::Pipeline;
  using PipelineState = cutlass::PipelineState<Cfg::kStages>;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kKeys = Cfg::kWarpgroupKeys;
  constexpr int kConsumerThreads = 128 * Cfg::kConsumers;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);

  const int warpgroup = WarpgroupIndex();  // warp-uniform to ptxas (sm90/wgmma.cuh)
  const int thread_in_wg = threadIdx.x % 128;
  int n_block = blockIdx.x;  // causal: low key blocks have the most rows, launched first
  int kv_head = blockIdx.y;
  int batch = blockIdx.z;
  int share = 0;
  [[maybe_unused]] BwdSeqBlock seq{};
  if constexpr (kVarlen) {
    static_assert(!kTail, "the tail split serves dense calls");
    if (!BwdVarlenBlock(params, int(blockIdx.x), kBlockN, kBlockM, seq)) return;  // whole CTA
    n_block = seq.n_block;
    batch = seq.batch;
  } else if constexpr (kTail) {
    const int block = params.num_whole + int(blockIdx.x) / params.tail_splits;
    share = int(blockIdx.x) % params.tail_splits;
    const int kv_heads = params.num_heads / params.group;
    n_block = block % params.n_blocks;
    kv_head = block / params.n_blocks % kv_heads;
    batch = block / params.n_blocks / kv_heads;
  } else {
    const int block = (batch * int(gridDim.y) + kv_head) * int(gridDim.x) + n_block;
    if (block >= params.num_whole)
      return;  // a tail block: the kTail kernel runs it (the whole CTA, before any barrier)
    if (params.section_heads > 0) {
      const int section = block / (params.section_heads * params.n_blocks);
      const int first = section * params.section_heads;
      const int heads = min(params.section_heads, int(gridDim.y * gridDim.z) - first);
      const int within = block - first * params.n_blocks;
      n_block = within / heads;
      const int pair = first + within % heads;
      kv_head = pair % int(gridDim.y);
      batch = pair / int(gridDim.y);
    }
  }
  const int n0 = n_block * kBlockN;
  // Keys of this sequence: the causal diagonal and the key mask use k_len (as the sm80 kernels
  // and the reference do); a CTA wholly past it has no step and stores zero dK, dV.
  const int k_len = kVarlen ? seq.k_len : UsedKeys(params.seqused_k, batch, params.seqlen_k);
  // Rows of this sequence. Dense reads params.seqlen_q at each use, as before varlen: a local
  // copy captured by the consumers' lambdas changed the dense kernels' SASS (32 LDC more).
#define JAX_SGL_BWD_Q_LEN (kVarlen ? seq.q_len : params.seqlen_q)
  const RowBlocks rows(n0, kBlockM, kBlockN, JAX_SGL_BWD_Q_LEN, k_len, params.window_left,
                       params.window_right);
  const int m_steps = n0 < k_len ? rows.m_end - rows.m_begin : 0;  // per q head
  // Steps [step_begin, step_end): all of them, or the kTail CTA's share.
  const int step_begin = kTail ? m_steps * params.group * share / params.tail_splits : 0;
  const int step_end = kTail ? m_steps * params.group * (share + 1) / params.tail_splits
                             : m_steps * params.group;

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
    const int k_row0 = kVarlen ? seq.k_row0 : 0;
    auto tK = HeadTiles<kVarlen, typename Cfg::KeysD>(params.tma_k, params.kv_shape, sK, kv_head,
                                                      batch, k_row0);
    auto tV = HeadTiles<kVarlen, typename Cfg::KeysD>(params.tma_v, params.kv_shape, sV, kv_head,
                                                      batch, k_row0);
    shared.barrier_kv.arrive_and_expect_tx(2 * Cfg::kConsumers * Cfg::kKVHalfBytes);
    auto& bar_kv = reinterpret_cast<uint64_t&>(shared.barrier_kv);
    for (int half = 0; half < Cfg::kConsumers; ++half) {
      copy(params.tma_k.with(bar_kv, 0), get<0>(tK)(_, 2 * n_block + half), get<1>(tK)(_, half));
      copy(params.tma_v.with(bar_kv, 0), get<0>(tV)(_, 2 * n_block + half), get<1>(tV)(_, half));
    }

    PipelineState write_q = cutlass::make_producer_start_state<Pipeline>();
    PipelineState write_do = cutlass::make_producer_start_state<Pipeline>();
    // Step order: q head by q head, each over its row blocks (g = step / m_steps).
    const int g_end = step_end > step_begin ? (step_end - 1) / m_steps + 1 : 0;
    for (int g = kTail ? step_begin / max(m_steps, 1) : 0; g < g_end; ++g) {
      const int head = kv_head * params.group + g;
      const int q_row0 = kVarlen ? seq.q_row0 : 0;
      auto tQ = HeadTiles<kVarlen, typename Cfg::RowsD>(params.tma_q, params.q_shape, sQ, head,
                                                        batch, q_row0);
      auto tdO = HeadTiles<kVarlen, typename Cfg::RowsD>(params.tma_do, params.q_shape, sdO, head,
                                                         batch, q_row0);
      const int64_t row_values =
          kVarlen ? seq.ws_row0 + int64_t(head) * params.ws_rows
                  : (int64_t(batch) * params.num_heads + head) * params.ws_rows;
      const int m_lo = rows.m_begin + (kTail ? max(step_begin - g * m_steps, 0) : 0);
      const int m_hi = rows.m_begin + (kTail ? min(step_end - g * m_steps, m_steps) : m_steps);
      for (int m = m_lo; m < m_hi; ++m)
        ProduceStep(params, shared, pipe_q, pipe_do, write_q, write_do, tQ, tdO, m, row_values);
    }
  } else {
    // ---- Consumers -----------------------------------------------------------------------
    cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    const int consumer = warpgroup - 1;

    Tensor sQt = make_tensor(make_smem_ptr(shared.q.data()), typename Cfg::SmemLayoutRowsT{});
    Tensor sdOt = make_tensor(make_smem_ptr(shared.dout.data()), typename Cfg::SmemLayoutRowsT{});
    Tensor sKt = make_tensor(make_smem_ptr(shared.k.data()), typename Cfg::SmemLayoutKt{});
    Tensor sdS = make_tensor(make_smem_ptr(shared.ds.data()), typename Cfg::SmemLayoutDs{});
    Tensor sdSt = make_tensor(make_smem_ptr(shared.ds.data()), typename Cfg::SmemLayoutDsT{});

    typename Cfg::MmaSdP mma_sdp;
    typename Cfg::MmaKV mma_kv;
    typename Cfg::MmaDq mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(thread_in_wg);
    auto thr_kv = mma_kv.get_thread_slice(thread_in_wg);
    auto thr_dq = mma_dq.get_thread_slice(thread_in_wg);

    Tensor tSrK = thr_sdp.partition_fragment_A(sK(_, _, consumer));
    Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);     // [.., stage]
    Tensor tdPrV = thr_sdp.partition_fragment_A(sV(_, _, consumer));
    Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);  // [.., stage]
    Tensor tdVrdO = thr_kv.partition_fragment_B(sdOt);  // [.., stage]
    Tensor tdKrQ = thr_kv.partition_fragment_B(sQt);    // [.., stage]
    // This consumer's dS^T keys, as the S^T accumulator writes them: [.., buffer].
    Tensor tdSsdS = thr_sdp.partition_C(
        local_tile(sdSt, Shape<Int<kKeys>, Int<kBlockM>, _2>{}, make_coord(consumer, _0{}, _0{})));
    // dQ part: rows (hd64) or columns (hd128) of the tile, against all 128 keys.
    const int dq_m = consumer % Cfg::kDqSplitM, dq_n = consumer / Cfg::kDqSplitM;
    Tensor tdQrdS = thr_dq.partition_fragment_A(local_tile(
        sdS, Shape<Int<Cfg::kDqRows>, Int<kBlockN>, _2>{}, make_coord(dq_m, _0{}, _0{})));
    Tensor tdQrK = thr_dq.partition_fragment_B(
        local_tile(sKt, Shape<Int<Cfg::kDqCols>, Int<kBlockN>>{}, make_coord(dq_n, _0{})));

    Tensor tdVrdV = partition_fragment_C(mma_kv, typename Cfg::KeysD{});
    Tensor tdKrdK = partition_fragment_C(mma_kv, typename Cfg::KeysD{});
    clear(tdVrdV);
    clear(tdKrdK);

    const AccCoord coord(thread_in_wg);
    const int key_base = n0 + consumer * kKeys + coord.row0;  // key of accumulator row r = 0
    const int diag = k_len - JAX_SGL_BWD_Q_LEN;
    const bool keys_partial = n0 + kBlockN > k_len;

    // K and V land even when there is no step: the epilogue reuses their smem.
    shared.barrier_kv.wait(0);
    if (step_end > step_begin) {
      PipelineState read_q, read_do;
      for (int step = step_begin; step < step_end; ++step) {
        const int g = step / m_steps;
        const int m = rows.m_begin + step % m_steps;
        const int head = kv_head * params.group + g;
        const int buf = step % 2;
        const int row0 = m * kBlockM;

        Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kKeys>, Int<kBlockM>>{});
        Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kKeys>, Int<kBlockM>>{});
        pipe_q.consumer_wait(read_q);
        Gemm<true, false>(mma_sdp, tSrK, tSrQ(_, _, _, read_q.index()), tSrS);
        pipe_do.consumer_wait(read_do);
        Gemm<true, false>(mma_sdp, tdPrV, tdPrdO(_, _, _, read_do.index()), tdPrdP);

        // P^T = exp2(S^T scale log2e - lse2), zero where masked. Columns are query rows.
        const float* lse2 = shared.lse2[read_q.index()] + coord.col0;
        const float* dsum = shared.dsum[read_do.index()] + coord.col0;
        // Unmasked: every row of the step sees every key of the CTA.
        const bool masked =
            keys_partial || row0 + kBlockM > JAX_SGL_BWD_Q_LEN ||
            (params.window_right >= 0 && row0 + diag + params.window_right < n0 + kBlockN - 1) ||
            (params.window_left >= 0 && row0 + kBlockM - 1 + diag - params.window_left > n0);
        auto lse = [&](int i) { return lse2[AccCoord::Col(i)]; };
        auto d = [&](int i) { return dsum[AccCoord::Col(i)]; };
        auto visible = [&](int i) {
          const int key = key_base + AccCoord::Row(i);
          const int row = row0 + coord.col0 + AccCoord::Col(i);
          return key < k_len && row < JAX_SGL_BWD_Q_LEN &&
                 (params.window_right < 0 || key <= row + diag + params.window_right) &&
                 (params.window_left < 0 || key >= row + diag - params.window_left);
        };
        Tensor tPrP = make_tensor<Element>(
            Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockM / 16>>>{});  // AccToA's layout
        constexpr bool plain = !kSoftcap;
        if (plain) {
          warpgroup_wait<1>();
          warpgroup_fence_operand(tSrS);  // no read of S^T above the wait
          ScoresToP(tSrS, params.scale_log2, masked, lse, visible);
          // dV += P^T dO goes to the tensor cores before dP^T is waited for: it runs while dS^T
          // is computed (groups complete in order, so wait<1> below still means dP^T is done).
#pragma unroll
          for (int i = 0; i < size(tSrS); ++i) tPrP(i) = Element(tSrS(i));
          Gemm<false, true>(mma_kv, tPrP, tdVrdO(_, _, _, read_do.index()), tdVrdV);
          // dS^T = P^T (dP^T - D).
          warpgroup_wait<1>();
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
          Gemm<false, true>(mma_kv, tPrP, tdVrdO(_, _, _, read_do.index()), tdVrdV);
        }
        Tensor tdSrdS = AccToA<Element, kBlockM>(tdPrdP);
        // dK += dS^T Q goes to the tensor cores after dQ (as in FlashAttention-3): the wait for
        // dQ then leaves dK running while the dQ part is reduced (+0.6-1.6% fwd+bwd on the H200
        // against issuing it before dQ).
        auto issue_dk = [&]() {
          Gemm<false, true>(mma_kv, tdSrdS, tdKrQ(_, _, _, read_q.index()), tdKrdK);
        };

        if (params.dq_accum != nullptr) {
          Tensor tdSsdS_buf = tdSsdS(_, _, _, buf);
          StorePairs(tdSrdS, tdSsdS_buf);
          cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> wgmma reads
          // dq_accum: the workspace's rows x head dim, in kBlockM-row tiles.
          const int64_t dq_tile =
              kVarlen ? (seq.ws_row0 + int64_t(head) * params.ws_rows + row0) * Cfg::kHeadDim
                      : ((int64_t(batch) * params.num_heads + head) * (params.ws_rows / kBlockM) +
                         m) * (kBlockM * Cfg::kHeadDim);
          cutlass::arch::NamedBarrier::sync(kConsumerThreads, uint32_t(BwdBarrier::kDsReady));
          Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<Cfg::kDqRows>,
                                                             Int<Cfg::kDqCols>>{});
          Gemm<true, false>(mma_dq, tdQrdS(_, _, _, buf), tdQrK, tdQrdQ);
          issue_dk();
          warpgroup_wait<1>();  // dV and dQ done; dK runs on (it reads Q: released below)
          warpgroup_fence_operand(tdQrdQ);
          pipe_do.consumer_release(read_do);
          RedAddDqPart(params.dq_accum + dq_tile + consumer * Cfg::kDqPartFloats, tdQrdQ,
                       thread_in_wg);
          warpgroup_wait<0>();
          pipe_q.consumer_release(read_q);
        } else {
          issue_dk();
          warpgroup_wait<0>();
          pipe_q.consumer_release(read_q);
          pipe_do.consumer_release(read_do);
        }
        ++read_q;
        ++read_do;
      }
    }

    // ---- Epilogue: dK (x softmax_scale) and dV -> the K / V smem halves -> TMA store ------
    warpgroup_fence_operand(tdKrdK);
    warpgroup_fence_operand(tdVrdV);
    if constexpr (kTail) {
      // A share: dK and dV of its steps, float32, straight from registers to its slot of the
      // tail buffers (slot = this CTA's index; this consumer's 64 keys); FlashBwdSm90TailSum
      // adds the shares. K and V smem stay as they are: no wait for the other consumer.
      const int64_t key0 = int64_t(blockIdx.x) * kBlockN + consumer * kKeys;
      auto part = [&](float* base) {
        return thr_kv.partition_C(make_tensor(
            make_gmem_ptr(base + key0 * Cfg::kHeadDim),
            make_layout(typename Cfg::KeysD{}, make_stride(Int<Cfg::kHeadDim>{}, _1{}))));
      };
      Tensor tdKgdK = part(params.tail_dk);
      Tensor tdVgdV = part(params.tail_dv);
#pragma unroll
      for (int i = 0; i < size(tdKrdK); i += 2) {
        *reinterpret_cast<float2*>(&tdKgdK(i)) = make_float2(
            tdKrdK(i) * params.softmax_scale, tdKrdK(i + 1) * params.softmax_scale);
        *reinterpret_cast<float2*>(&tdVgdV(i)) = make_float2(tdVrdV(i), tdVrdV(i + 1));
      }
      return;
    }
    // Both consumers' dQ GEMMs read all of K: wait for both before overwriting it.
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, uint32_t(BwdBarrier::kMmaDone));
    Tensor tdKsK = thr_kv.partition_C(sK(_, _, consumer));
    Tensor tdVsV = thr_kv.partition_C(sV(_, _, consumer));
    StoreDkDv<Element>(tdKrdK, tdVrdV, params.softmax_scale, tdKsK, tdVsV);
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> TMA reads
    cutlass::arch::NamedBarrier::sync(128, uint32_t(BwdBarrier::kEpilogue0) + consumer);
    if constexpr (kVarlen) {
      // Row by row: this consumer's 64 keys of dK, then of dV; keys past the sequence's end are
      // left alone (they are the next sequence's rows, or the packed tail's).
      const int kv_heads = params.num_heads / params.group;
      const int key0 = n0 + consumer * kKeys;
      const int live = max(0, min(k_len - key0, kKeys));
      const int64_t row_stride = int64_t(kv_heads) * Cfg::kHeadDim;
      const int64_t base = (int64_t(seq.k_row0) + key0) * row_stride + kv_head * Cfg::kHeadDim;
      StoreSmemRows<Cfg::kHeadDim>(params.dk + base, row_stride, live, sK(_, _, consumer),
                                   thread_in_wg);
      StoreSmemRows<Cfg::kHeadDim>(params.dv + base, row_stride, live, sV(_, _, consumer),
                                   thread_in_wg);
    } else if (thread_in_wg == 0) {
      Tensor mdK = params.tma_dk.get_tma_tensor(params.kv_shape);
      Tensor mdV = params.tma_dv.get_tma_tensor(params.kv_shape);
      const int half = 2 * n_block + consumer;
      Tensor gdK = local_tile(mdK(_, _, kv_head, batch), typename Cfg::KeysD{},
                              make_coord(half, _0{}));
      Tensor gdV = local_tile(mdV(_, _, kv_head, batch), typename Cfg::KeysD{},
                              make_coord(half, _0{}));
      auto cta_dk = params.tma_dk.get_slice(_0{});
      auto cta_dv = params.tma_dv.get_slice(_0{});
      copy(params.tma_dk, cta_dk.partition_S(sK(_, _, consumer)), cta_dk.partition_D(gdK));
      copy(params.tma_dv, cta_dv.partition_S(sV(_, _, consumer)), cta_dv.partition_D(gdV));
      tma_store_arrive();
      tma_store_wait<0>();
    }
  }
#undef JAX_SGL_BWD_Q_LEN
#endif
}

// dq_accum (float32, DqAccumIndex order, unscaled) -> dQ = softmax_scale * sum, in q's dtype and
// dense [batch, seqlen_q, num_heads, head_dim] layout. One CTA per (kBlockM rows, q head, batch);
// the tile goes through smem so both the reads and the 16-byte writes are contiguous. All of a
// thread's float4 loads are issued before the first smem store (a loop of load-then-store ran at
// 3.2 TB/s on the H200, ncu 2026-12-03), and each float pair of a row goes out as one 4-byte
// store: DqAccumRowCol puts elements 0, 1 (and 2, 3) of a float4 side by side in one row.
// kSeqPadded (varlen q, the wide kernel): dq_accum is [num_heads, m_blocks * kBlockM rows] in
// the workspace's per-sequence padding (PaddedSeqRow0), one CTA per (block of those rows, q
// head); seqlen_q is then total_q and dq packed [total_q, num_heads, head_dim]. A block no
// sequence owns (padding) does nothing.
template <typename Cfg, bool kSeqPadded = false>
__global__ void __launch_bounds__(256)
    FlashBwdSm90DqConvertKernel(const float* dq_accum, typename Cfg::Element* dq, int seqlen_q,
                                int num_heads, int m_blocks, float softmax_scale,
                                const int* cu_seqlens_q = nullptr, int batch_count = 0) {
  using Element = typename Cfg::Element;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kD = Cfg::kHeadDim;
  constexpr int kStride = kD + 8;  // 16-byte pad per row
  constexpr int kLoads = kBlockM * kD / (256 * 4);
  static_assert(kBlockM * kD % (256 * 4) == 0 && Cfg::kDqPartFloats % 1024 == 0);
  __shared__ __align__(16) Element tile[kBlockM * kStride];
  const int m = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const float* src =
      dq_accum + ((int64_t(batch) * num_heads + head) * m_blocks + m) * (kBlockM * kD);
  // kSeqPadded: the dq row of the block's row 0 and the sequence's rows from there on, as the
  // row block 0 of a "batch" of that many rows, so the store loop below serves both forms.
  int row_block = m;
  int64_t dq_row0 = 0;
  if constexpr (kSeqPadded) {
    const PaddedSeq s = FindPaddedSeq(cu_seqlens_q, batch_count, seqlen_q, int64_t(m) * kBlockM,
                                      kBlockM);
    if (s.rows_left <= 0) return;  // the whole CTA: padding
    dq_row0 = s.q_row;
    seqlen_q = s.rows_left;
    row_block = 0;
  }
  float4 x[kLoads];
#pragma unroll
  for (int l = 0; l < kLoads; ++l)
    x[l] = __ldcs(reinterpret_cast<const float4*>(src) + l * 256 + threadIdx.x);
  // Load l is float offset 1024 l + 4 t: part l / kPartLoads of the tile, and within it the
  // thread's offset 4 t plus 2 (l % kPartLoads) more 512-float groups j, i.e. 16 (l %
  // kPartLoads) columns to the right of where DqAccumRowCol puts offset 4 t. So one call places
  // every load. (kPartLoads: 4 for config.h's 64 x 64 parts, 6 / 8 for wide_config.h's.)
  constexpr int kPartLoads = Cfg::kDqPartFloats / 1024;
  static_assert(Cfg::kDqPartFloats % 1024 == 0 && kLoads % kPartLoads == 0);
  int r, c;
  DqAccumRowCol(threadIdx.x * 4, &r, &c);  // element 0; 2 and 3 are 8 rows down, 1 and 3 right
  Element* const at = tile + r * kStride + c;
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const int part = l / kPartLoads;
    Element* e = at + (part % Cfg::kDqSplitM) * Cfg::kDqRows * kStride +
                 (part / Cfg::kDqSplitM) * Cfg::kDqCols + 16 * (l % kPartLoads);
    const Element lo[2] = {Element(x[l].x * softmax_scale), Element(x[l].y * softmax_scale)};
    const Element hi[2] = {Element(x[l].z * softmax_scale), Element(x[l].w * softmax_scale)};
    *reinterpret_cast<uint32_t*>(e) = *reinterpret_cast<const uint32_t*>(lo);
    *reinterpret_cast<uint32_t*>(e + 8 * kStride) = *reinterpret_cast<const uint32_t*>(hi);
  }
  __syncthreads();
  constexpr int kChunks = kD / 8;  // 16-byte chunks per row
#pragma unroll
  for (int idx = threadIdx.x; idx < kBlockM * kChunks; idx += 256) {
    const int r = idx / kChunks, c = idx % kChunks;
    const int row = row_block * kBlockM + r;
    if (row >= seqlen_q) continue;
    Element* out =
        dq + ((kSeqPadded ? dq_row0 + row : int64_t(batch) * seqlen_q + row) * num_heads + head) *
                 kD +
             c * 8;
    *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(tile + r * kStride + c * 8);
  }
}

}  // namespace jax_sgl::cuda::sm90
