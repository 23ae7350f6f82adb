// The sm_90a flash attention forward kernel (dense layout). A work tile is 128 query rows of one
// (q head, batch); by the head dim's tile choice (tile_size.h) one CTA runs per tile, or #SMs
// persistent CTAs (Cfg::kPersistent) loop over tiles. Warpgroup 0 is the producer: one thread issues the TMA loads of Q and of the K/V tiles
// into a kStages-deep smem ring (cutlass::PipelineTmaAsync: full/empty mbarriers per stage).
// Warpgroups 1 and 2 are consumers, 64 query rows each:
//   - S = Q K^T and O += P V on wgmma; P stays in registers (RS wgmma).
//   - The S of tile j is issued together with the P V of tile j+1 (ptxas places the P V wait
//     above the softmax, so the softmax hides behind the other warpgroup's GEMMs, not this one's).
//   - Ping-pong: a pair of named barriers makes the two consumers issue their GEMMs in turn, so
//     one warpgroup's softmax hides behind the other's GEMMs.
// Keys are walked from the last tile down: tiles that cross the causal diagonal / right window
// edge or the end of the keys come first, those that cross the left window edge last, and only
// these are masked; tiles wholly outside the window (or above the diagonal) are never loaded.
// Softcap (cap tanh(scale s / cap) before the mask) is its own instantiation (kSoftcap) and runs
// on every tile.
// The output goes registers -> smem (the Q buffer of the same warpgroup, or its own buffer when
// persistent and smem allows) -> TMA store.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "ffi/common/attention_geometry.h"
#include "ffi/cuda/attention/sm90/fwd/config.h"
#include "ffi/cuda/attention/sm90/fwd/softmax.h"
#include "ffi/cuda/attention/sm90/tma_load.h"

namespace jax_sgl::cuda::sm90 {

template <typename Cfg>
using Element_t = typename Cfg::Element;

template <typename Cfg>
struct KernelParams {
  typename Cfg::TmaQ tma_q;
  typename Cfg::TmaKV tma_k;
  typename Cfg::TmaKV tma_v;
  typename Cfg::TmaO tma_o;
  typename Cfg::GmemShape q_shape;   // [seqlen_q, head_dim, num_heads, batch]
  typename Cfg::GmemShape kv_shape;  // [seqlen_k, head_dim, num_kv_heads, batch]
  float* lse;                        // [batch, num_heads, seqlen_q] or nullptr
  int seqlen_q;
  int seqlen_k;
  int num_heads;
  int group;                         // num_heads / num_kv_heads
  float softmax_scale;               // 1 under softcap (the capped scores are already scaled)
  bool causal;                       // bottom-right aligned; orders the tiles (longest first)
  // Visible keys of query row i: i + diag - window_left <= j <= i + diag + window_right, with
  // diag = seqlen_k - seqlen_q (bottom-right aligned); < 0: no bound on that side. Causal comes
  // in as window_right = 0.
  int window_left;
  int window_right;
  float softcap;                     // 0: off; else scores -> softcap * tanh(scale * s / softcap)
  float softcap_exp2_scale;          // 2 log2(e) scale / softcap: tanh(x) = 1 - 2 / (1 + e^{2x})
  int num_m_blocks;                  // ceil(seqlen_q / kBlockM)
  int num_tiles;                     // work items: tiles, each tail tile counted tail_splits times
  int* tile_counter;                 // persistent, dynamic order (NextTile): tiles handed out past
                                     // the first wave, zeroed before the launch; else nullptr
  // Varlen kernel only (kVarlen; launch.cuh): the TMA views are packed [total, head_dim, heads,
  // 1] and each sequence's rows start at its own offset; geometry as in attention_seq.h.
  const int32_t* cu_seqlens_q;       // [batch + 1] or nullptr (dense q: seqlen_q rows each)
  const int32_t* cu_seqlens_k;       // [batch + 1] or nullptr (dense k: seqlen_k rows each)
  const int32_t* seqused_k;          // [batch] or nullptr
  int total_q;
  int total_k;
  int batch;
  Element_t<Cfg>* out;               // O, stored row by row (never past a sequence's end)
  // Tail split (dense persistent, launch.cuh): tiles from num_whole_tiles on are the last,
  // partial wave's; each runs as tail_splits items over shares of its key tiles, which store O
  // (float32, normalized by their own sums) and LSE in tail_o / tail_lse for
  // FlashFwdSm90TailCombine. tail_splits 0: off (num_whole_tiles = num_tiles).
  int num_whole_tiles;
  int tail_splits;
  float* tail_o;                     // [tail tile, split, kBlockM, head_dim]
  float* tail_lse;                   // [tail tile, split, kBlockM]
};

// Varlen: the linear row block `lin` (sequences in order, each ceil(q_len / block_m) blocks)
// of q head `head` as a work tile, or false past the last sequence's last block. An O(batch) scan
// of cu_seqlens per tile instead of a prefix-sum pass: batch is small next to a tile's work.
// Lengths clamp like attention_seq.h GetSeqBounds, so bad index arrays never leave the buffers.
template <typename Params>
__device__ bool VarlenTile(Params const& params, int lin, int head, int block_m, WorkTile& w) {
  w.head = head;
  if (params.cu_seqlens_q == nullptr) {
    const int blocks = (params.seqlen_q + block_m - 1) / block_m;
    w.batch = lin / blocks;
    w.m_block = lin % blocks;
    w.q_row0 = w.batch * params.seqlen_q;
    w.q_len = params.seqlen_q;
  } else {
    int acc = 0, b = 0;
    for (; b < params.batch; ++b) {
      const RowRange r = ClampedRows(params.cu_seqlens_q[b], params.cu_seqlens_q[b + 1],
                                     params.total_q);
      const int blocks = (int(r.len) + block_m - 1) / block_m;
      if (lin < acc + blocks) {
        w.m_block = lin - acc;
        w.q_row0 = int(r.begin);
        w.q_len = int(r.len);
        break;
      }
      acc += blocks;
    }
    w.batch = b;
  }
  if (w.batch >= params.batch) return false;
  int cap;
  if (params.cu_seqlens_k != nullptr) {
    const RowRange r = ClampedRows(params.cu_seqlens_k[w.batch], params.cu_seqlens_k[w.batch + 1],
                                   params.total_k);
    w.k_row0 = int(r.begin);
    cap = int(r.len);
  } else {
    w.k_row0 = w.batch * params.seqlen_k;
    cap = params.seqlen_k;
  }
  w.k_len = params.seqused_k != nullptr ? int(ClampIndex(params.seqused_k[w.batch], 0, cap)) : cap;
  return true;
}

// Persistent order of the work tiles: (batch, head) outer, so the CTAs running at once share the
// K/V of few heads in L2 (q heads of one kv head are adjacent), row blocks inner, longest first
// when causal (the short ones then fill the tail).
__device__ __forceinline__ WorkTile DecodeTile(int t, int num_m_blocks, int num_heads,
                                               bool causal) {
  const int m = t % num_m_blocks, bh = t / num_m_blocks;
  return {causal ? num_m_blocks - 1 - m : m, bh % num_heads, bh / num_heads};
}

// The tile a persistent CTA takes after tile t: every CTA starts at blockIdx.x. With a counter
// (causal, whose tiles differ up to num_m_blocks-fold) the next free tile, greedy in DecodeTile's
// order; else a static stride (non-causal tiles cost the same).
__device__ __forceinline__ int NextTile(int t, int* counter) {
  return counter != nullptr ? int(gridDim.x) + atomicAdd(counter, 1) : t + int(gridDim.x);
}

// Named barriers (ids after CUTLASS's reserved ones): one per consumer for its GEMM turn, one per
// consumer for its epilogue.
enum class Barrier : uint32_t { kTurn0 = 0, kTurn1 = 1, kEpilogue0 = 2, kEpilogue1 = 3 };

// Key tiles [n_begin, n_end) a CTA visits (producer and consumers both derive them from here),
// and which of them need masking: those >= n_mask_begin (right edge: causal / window right, end
// of the keys) and those < n_mask_end (left edge: window left). Tiles outside the range hold no
// visible key for any row of the CTA and are never loaded.
struct KeyTiles {
  int n_begin;
  int n_end;         // <= n_begin: no visible key at all (the rows get 0 and LSE -inf)
  int n_mask_begin;
  int n_mask_end;
  __device__ KeyTiles(int m0, int block_m, int block_n, int seqlen_q, int seqlen_k, int left,
                      int right) {
    // Row i sees keys [i + diag - left, i + diag + right]: the CTA's last row bounds the range
    // above, its first row below; every row sees [last - left, first + right] unmasked.
    const int diag = seqlen_k - seqlen_q;
    const int first = m0 + diag, last = m0 + block_m - 1 + diag;
    const int hi = right < 0 ? seqlen_k : min(seqlen_k, max(0, last + right + 1));
    const int lo = left < 0 ? 0 : max(0, first - left);
    n_begin = lo / block_n;
    n_end = lo < hi ? (hi + block_n - 1) / block_n : n_begin;
    const int unmasked_hi = right < 0 ? seqlen_k : min(seqlen_k, max(0, first + right + 1));
    const int unmasked_lo = left < 0 ? 0 : max(0, last - left);
    n_mask_begin = max(n_begin, min(n_end, unmasked_hi / block_n));
    n_mask_end = min(n_end, max(n_begin, (unmasked_lo + block_n - 1) / block_n));
  }
  __device__ bool empty() const { return n_end <= n_begin; }
  // Keeps share `split` of `splits` (contiguous, in order) of the tiles; the masked edges stay
  // masked where the share still holds them.
  __device__ void Split(int split, int splits) {
    const int n = max(0, n_end - n_begin);
    const int b = n_begin + n * split / splits, e = n_begin + n * (split + 1) / splits;
    n_mask_begin = max(b, min(e, n_mask_begin));
    n_mask_end = min(e, max(b, n_mask_end));
    n_begin = b;
    n_end = e;
  }
};

// Work item t of a persistent CTA: tile t while t < num_whole_tiles; past it, tail tile
// num_whole_tiles + u / tail_splits with key share u % tail_splits (u = t - num_whole_tiles).
template <typename Params>
__device__ __forceinline__ WorkTile ItemTile(Params const& params, int t) {
  if (t < params.num_whole_tiles)
    return DecodeTile(t, params.num_m_blocks, params.num_heads, params.causal);
  const int u = t - params.num_whole_tiles;
  WorkTile w = DecodeTile(params.num_whole_tiles + u / params.tail_splits, params.num_m_blocks,
                          params.num_heads, params.causal);
  w.split = u % params.tail_splits;
  return w;
}

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

// Compiler-only fence around the smem tile index that rides on the Q barrier: mbarrier.arrive
// releases and try_wait acquires in hardware, but CUTLASS's asm statements clobber no memory.
__device__ __forceinline__ void CompilerFence() { asm volatile("" ::: "memory"); }

// A consumer's held tile, field by field through volatile accesses: each read is a fresh smem load,
// never a register kept from before the main loop. Every thread of the warpgroup writes the same
// values; each reads back before it releases Q, so the next tile's write comes after all reads.
__device__ __forceinline__ void StoreTile(HeldTile& slot, WorkTile const& w, int iter) {
  volatile int* p = reinterpret_cast<volatile int*>(&slot);
  p[0] = w.m_block; p[1] = w.head; p[2] = w.batch;
  p[3] = w.q_row0; p[4] = w.q_len; p[5] = w.k_row0; p[6] = w.k_len;
  p[7] = w.split; p[8] = iter;
}
__device__ __forceinline__ WorkTile LoadTile(HeldTile const& slot) {
  volatile const int* p = reinterpret_cast<volatile const int*>(&slot);
  WorkTile w{p[0], p[1], p[2]};
  w.q_row0 = p[3]; w.q_len = p[4]; w.k_row0 = p[5]; w.k_len = p[6];
  w.split = p[7];
  return w;
}
__device__ __forceinline__ int LoadTileIter(HeldTile const& slot) {
  return reinterpret_cast<volatile const int*>(&slot)[8];
}
static_assert(sizeof(HeldTile) == 9 * sizeof(int));

// kVarlen: packed q / k / v (cu_seqlens_q / cu_seqlens_k, seqused_k): per-tile sequence geometry
// (VarlenTile), row offsets into the TMA views, O stored row by row with a predicate per row.
// A separate instantiation, so the dense kernel's code is exactly what it was.
// kSoftcap: scores capped before the mask (KernelParams::softcap != 0), picked per call by the
// launcher. Its own instantiation, as in the backward: the plain kernel holds no softcap code.
template <typename Cfg, bool kVarlen = false, bool kSoftcap = false>
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

  extern __shared__ __align__(1024) char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);

  const int warpgroup = threadIdx.x / 128;
  const int thread_in_wg = threadIdx.x % 128;
  // Non-persistent: the CTA's one tile; causal CTAs with more rows have more key tiles, launch them first.
  WorkTile launch_tile{params.causal ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x),
                      int(blockIdx.y), int(blockIdx.z)};
  // Persistent and varlen: tile indices name (linear row block, head); the sequence comes from
  // VarlenTile. Blocks past the last sequence's rows (the grid is a bound) do nothing.
  auto resolve = [&](WorkTile& w) {
    if constexpr (kVarlen) return VarlenTile(params, w.m_block, w.head, kBlockM, w);
    else return true;
  };
  if constexpr (kVarlen && !kPersistent) {
    if (!resolve(launch_tile)) return;  // the whole CTA, before any barrier
  }
  // The sequence geometry of a tile: the call's (dense) or the tile's own (varlen).
  auto seqlen_q = [&](WorkTile const& w) { return kVarlen ? w.q_len : params.seqlen_q; };
  auto seqlen_k = [&](WorkTile const& w) { return kVarlen ? w.k_len : params.seqlen_k; };
  auto key_tiles = [&](WorkTile const& w) {
    KeyTiles tiles(w.m_block * kBlockM, kBlockM, kBlockN, seqlen_q(w), seqlen_k(w),
                   params.window_left, params.window_right);
    if constexpr (kPersistent && !kVarlen) {
      if (w.split >= 0) tiles.Split(w.split, params.tail_splits);
    }
    return tiles;
  };
  // [rows, head dim] view of one head's rows of a TMA tensor: dense picks the batch, varlen
  // starts at the sequence's row of the packed tensor (its batch extent is 1).
  auto head_rows = [&](auto const& m, int head, int batch, int row0) {
    if constexpr (kVarlen) return domain_offset(make_coord(row0, _0{}), m(_, _, head, _0{}));
    else return m(_, _, head, batch);
  };

  // Barriers: set up by warp 0, made visible to all before any role starts.
  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Cfg::kKVTileBytes;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer
                                    : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = kConsumerThreads;
  Pipeline pipe_k(shared.pipe_k, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipe_v(shared.pipe_v, pipe_params, Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    shared.barrier_q.init(1);
    // Q is free again when every consumer thread finished its last wgmma on it (separate O), or
    // when each consumer's O store out of the Q buffer has completed.
    if constexpr (kPersistent)
      shared.barrier_q_empty.init(Cfg::kSeparateO ? kConsumerThreads : Cfg::kConsumers);
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Cfg::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Cfg::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Cfg::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(shared.v.data()), typename Cfg::SmemLayoutVt{});
  Tensor sO = make_tensor(make_smem_ptr(Cfg::kSeparateO ? shared.o.data() : shared.q.data()),
                          typename Cfg::SmemLayoutQ{});

  if (warpgroup == 0) {
    // ---- Producer ------------------------------------------------------------------------
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (threadIdx.x != 0) return;
    Tensor mQ = params.tma_q.get_tma_tensor(params.q_shape);
    Tensor mK = params.tma_k.get_tma_tensor(params.kv_shape);
    Tensor mV = params.tma_v.get_tma_tensor(params.kv_shape);
    // The K/V ring states run on across the tiles of a persistent CTA. Both rings see the same
    // number of loads per tile, V one behind K inside it (load_tile's order), so one count of K
    // loads gives both states: the producer has 24 registers, and two states spilled.
    uint32_t k_loads = 0;
    auto write_state = [](uint32_t count) {  // as make_producer_start_state, advanced count times
      return PipelineState(int(count % Cfg::kStages), 1u ^ ((count / Cfg::kStages) & 1u), count);
    };
    // Loads one work tile in the order the consumers use it: K[last], Q, then (K[n], V[n+1])
    // pairs, then V[first]. claim_q() runs just before Q is written (persistent: waits for the
    // consumers to be done with the previous Q, then publishes the tile).
    auto load_tile = [&](WorkTile const& w, KeyTiles const& tiles, auto&& claim_q) {
      const int kv_head = w.head / params.group;
      // [64, D, m/64] rows of this (batch, head); [N, D, n] keys of this (batch, kv head).
      // Varlen: boxes that run past a sequence's end read the next sequence's rows (or TMA's
      // zero fill past the buffer): masked as keys past k_len, unused as q rows past q_len.
      Tensor gQ = local_tile(head_rows(mQ, w.head, w.batch, w.q_row0), typename Cfg::RowsD{},
                             make_coord(_, _0{}));
      Tensor gK = local_tile(head_rows(mK, kv_head, w.batch, w.k_row0),
                             Shape<Int<kBlockN>, Int<Cfg::kHeadDim>>{}, make_coord(_, _0{}));
      Tensor gV = local_tile(head_rows(mV, kv_head, w.batch, w.k_row0),
                             Shape<Int<kBlockN>, Int<Cfg::kHeadDim>>{}, make_coord(_, _0{}));
      auto tQ = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                              group_modes<0, 2>(gQ));
      auto tK = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                              group_modes<0, 2>(gK));
      auto tV = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                              group_modes<0, 2>(gV));
      auto tQg = get<0>(tQ);
      auto tQs = get<1>(tQ);
      auto tKg = get<0>(tK);
      auto tKs = get<1>(tK);
      auto tVg = get<0>(tV);
      auto tVs = get<1>(tV);
      auto load_k = [&](int n) {
        const PipelineState write_k = write_state(k_loads++);
        pipe_k.producer_acquire(write_k);
        copy(NoCacheHint(params.tma_k.with(*pipe_k.producer_get_barrier(write_k))), tKg(_, n),
             tKs(_, write_k.index()));
      };
      // behind: K loads of this tile issued since the K of this V.
      auto load_v = [&](int n, uint32_t behind) {
        const PipelineState write_v = write_state(k_loads - behind);
        pipe_v.producer_acquire(write_v);
        copy(NoCacheHint(params.tma_v.with(*pipe_v.producer_get_barrier(write_v))), tVg(_, n),
             tVs(_, write_v.index()));
      };
      if (!tiles.empty()) load_k(tiles.n_end - 1);
      claim_q();
      shared.barrier_q.arrive_and_expect_tx(2 * Cfg::kQHalfBytes);
      for (int half = 0; half < Cfg::kConsumers; ++half)
        copy(NoCacheHint(params.tma_q.with(reinterpret_cast<uint64_t&>(shared.barrier_q))),
             tQg(_, 2 * w.m_block + half), tQs(_, half));
      // Rolled: nvcc unrolled it 4x, and the addresses of the unrolled copies did not fit the
      // producer's 24 registers (varlen spilled); the producer waits on the ring anyway.
#pragma unroll 1
      for (int n = tiles.n_end - 2; n >= tiles.n_begin; --n) {
        load_k(n);
        load_v(n + 1, 2);
      }
      if (!tiles.empty()) load_v(tiles.n_begin, 1);
    };
    if constexpr (!kPersistent) {
      const KeyTiles tiles = key_tiles(launch_tile);
      if (!tiles.empty()) load_tile(launch_tile, tiles, [] {});
    } else {
      // Every tile goes through the Q barrier, also one without keys (the consumers write its
      // zeros), and a final -1 tells the consumers to stop. Item ordinal iter may write Q once
      // the consumers released ordinal iter - 1.
      int iter = 0;
      for (int t = int(blockIdx.x);; t = NextTile(t, params.tile_counter)) {
        const bool valid = t < params.num_tiles;
        auto claim_q = [&] {
          if (iter >= 1) shared.barrier_q_empty.wait((iter - 1) & 1);
          *reinterpret_cast<volatile int*>(&shared.tile) = valid ? t : -1;
          CompilerFence();
        };
        if (!valid) {
          claim_q();
          shared.barrier_q.arrive();
          break;
        }
        WorkTile w = ItemTile(params, t);
        if (!resolve(w)) continue;  // varlen: past the last sequence; the consumers never see it
        load_tile(w, key_tiles(w), claim_q);
        ++iter;
      }
    }
  } else {
    // ---- Consumers -----------------------------------------------------------------------
    cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    const int consumer = warpgroup - 1;
    const uint32_t my_turn = uint32_t(Barrier::kTurn0) + consumer;
    const uint32_t other_turn = uint32_t(Barrier::kTurn0) + 1 - consumer;
    const uint32_t epilogue_barrier = uint32_t(Barrier::kEpilogue0) + consumer;

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
    // The first consumer goes first.
    auto start_turns = [&] {
      if (consumer == 1) cutlass::arch::NamedBarrier::arrive(kConsumerThreads, other_turn);
    };

    // P as the A operand of P V: the accumulator's (2, 2, N/8) values regrouped as
    // ((2, 2, 2), 1, N/16), same order, so the conversion is element-wise.
    auto to_p = [&](auto const& s) {
      Tensor p = make_tensor<Element>(
          Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>>{});
#pragma unroll
      for (int i = 0; i < size(s); ++i) p(i) = Element(s(i));
      return p;
    };

    // One work tile: main loop, then normalize, LSE and O -> smem -> TMA store. Q must be in smem.
    // last_tile (non-persistent): the CTA's only tile, where consumer 1 skips its last hand-over so
    // every arrive meets a sync; persistent CTAs keep handing over and consumer 0 syncs once more
    // at exit. Returns the ordinal of the next published tile (persistent).
    // always_inline: NVVM outlines this lambda otherwise, and ptxas then serializes every wgmma
    // (C7520).
    auto run_tile = [&](WorkTile const& tile, bool last_tile)
                        __attribute__((always_inline)) {
      const KeyTiles tiles = key_tiles(tile);
      Tensor tSrQ = thr_qk.partition_fragment_A(sQ(_, _, consumer));
      const int row_base = tile.m_block * kBlockM + consumer * kRows + coord.row0;  // row of r = 0
      const int diag = seqlen_k(tile) - seqlen_q(tile);
      const int key_end = seqlen_k(tile);
      OnlineSoftmax softmax(params.softmax_scale);
      clear(tOrO);

      // Masks keys past the end, right of the diagonal / window and left of the window, for key
      // tile n: each row r keeps the columns in [begin, end), so the test per element is two
      // compares + select, branch-free (a branch here would make ptxas wait for P V).
      auto mask = [&](auto& s, int n) {
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
      };
      // Softcap, before the mask: s -> cap tanh(scale s / cap), as cap - 2 cap / (1 + e^{2x})
      // (one MUFU.EX2 + one MUFU.RCP; saturates to +-cap without NaN for large |x|).
      auto apply_softcap = [&](auto& s) {
#pragma unroll
        for (int i = 0; i < size(s); ++i) {
          const float e = Exp2Ftz(s(i) * params.softcap_exp2_scale);
          s(i) = fmaf(-2.f * params.softcap, __fdividef(1.f, 1.f + e), params.softcap);
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
        cutlass::arch::NamedBarrier::sync(kConsumerThreads, my_turn);
        Gemm<true, false>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
        hand_over(n == tiles.n_begin);
        warpgroup_wait<0>();
        pipe_k.consumer_release(read_k);
        ++read_k;
        if constexpr (kSoftcap) apply_softcap(tSrS);
        mask(tSrS, n);
        // Early rescale: the correction of the latest softmax step waits here until the next
        // step's S is issued (the first one scales O = 0: harmless).
        float correction[2];
        softmax.Step(tSrS, correction);
        Tensor tOrP = to_p(tSrS);

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
          if constexpr (kSoftcap) apply_softcap(s);
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
          Tensor p = to_p(s);
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
        const KeyTiles left = kPersistent ? key_tiles(LoadTile(shared.held[consumer])) : tiles;
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
      // Persistent: the epilogue reads its tile (and the next Q phase) back from smem rather than
      // keep it in registers across the main loop, which needs them all: held there, it spilled.
      const WorkTile w = kPersistent ? LoadTile(shared.held[consumer]) : tile;
      const int next_iter = kPersistent ? LoadTileIter(shared.held[consumer]) + 1 : 0;
      // Row of r = 0 again; non-persistent keeps row_base, live anyway (hd256 spilled m_block).
      const int out_row =
          kPersistent ? w.m_block * kBlockM + consumer * kRows + coord.row0 : row_base;
      // With a separate O buffer, Q is done: the producer may load a later tile's into it.
      if constexpr (kPersistent && Cfg::kSeparateO) shared.barrier_q_empty.arrive();

      // ---- Epilogue: normalize, LSE, O -> smem -> TMA store --------------------------------
      float inv_sum[2], lse[2];
      softmax.Finish(params.softmax_scale, inv_sum, lse);
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
      if (params.lse != nullptr && coord.col0 == 0) {
        // Dense: [batch, heads, seqlen_q]; varlen q: [heads, total_q] (attention_params.h).
        float* lse_row =
            kVarlen && params.cu_seqlens_q != nullptr
                ? params.lse + int64_t(w.head) * params.total_q + w.q_row0
                : params.lse + (int64_t(w.batch) * params.num_heads + w.head) * params.seqlen_q;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = out_row + 8 * r;
          if (row < seqlen_q(w)) lse_row[row] = lse[r];
        }
      }
      if constexpr (kVarlen) {
        // Row by row from registers, because a TMA box would write the next sequence's rows.
        // Rows of this warpgroup's 64-row block past the sequence's end are skipped. Values 2j and 2j+1 of the accumulator are
        // adjacent columns of one row (even column), stored as one 32-bit word.
        const int block_row0 = out_row - coord.row0;  // tile row of this warpgroup's row 0
        const int rows_left = seqlen_q(w) - block_row0;
        const int64_t q_row0 = kVarlen ? int64_t(w.q_row0) : int64_t(w.batch) * params.seqlen_q;
        const int64_t row_stride = int64_t(params.num_heads) * Cfg::kHeadDim;
        Tensor gO = make_tensor(
            make_gmem_ptr(params.out + (q_row0 + block_row0) * row_stride +
                          int64_t(w.head) * Cfg::kHeadDim),
            make_layout(typename Cfg::RowsD{}, make_stride(row_stride, _1{})));
        Tensor tOgO = thr_pv.partition_C(gO);
        Tensor tOcO = thr_pv.partition_C(make_identity_tensor(typename Cfg::RowsD{}));
        static_assert(sizeof(Element) == 2);
#pragma unroll
        for (int i = 0; i < size(tOrO); i += 2) {
          if (get<0>(tOcO(i)) < rows_left) {
            const uint32_t lo = Element(tOrO(i)).raw(), hi = Element(tOrO(i + 1)).raw();
            *reinterpret_cast<uint32_t*>(&tOgO(i)) = lo | (hi << 16);
          }
        }
        if constexpr (kPersistent && !Cfg::kSeparateO) {
          // Every thread's last wgmma on Q has completed (wait<0> above): Q may be reloaded.
          cutlass::arch::NamedBarrier::sync(128, epilogue_barrier);
          if (thread_in_wg == 0) shared.barrier_q_empty.arrive();
        }
        return next_iter;
      }
      // sOmine is free: in the Q buffer, this warpgroup's last wgmma has completed (wait<0>
      // above) and only this warpgroup ever read it (with no key tile, a non-persistent CTA never loaded
      // Q at all); in its own buffer, once the previous tile's store has read it.
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
    };

    if constexpr (!kPersistent) {
      if (!key_tiles(launch_tile).empty()) {
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
        WorkTile w = ItemTile(params, t);
        resolve(w);  // true: the producer published only tiles that resolve
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
