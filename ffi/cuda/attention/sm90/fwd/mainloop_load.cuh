// The sm_90a flash forward's producer: one thread of warpgroup 0 issues the TMA loads of Q and of
// the K/V tiles, for every work tile the scheduler hands this CTA, into the smem the consumers
// read: Q behind its own barrier, K and V each in a kStages-deep ring (cutlass::PipelineTmaAsync:
// full/empty mbarriers per stage). Persistent CTAs publish each tile's index next to its Q (and -1
// at the end), so the consumers follow the producer's order.
//
// kPaged: K/V come from a page pool through the page table. The producer is then the whole
// warpgroup: in each warp, lane i holds one page-table entry (PageWindow) and resolves box i of
// Cfg::kPageBoxRows keys of a key tile, and warp w issues the boxes i = w mod 4 (a warp's TMA
// issues run one lane at a time); thread 0 issues Q and arrives on the barriers. Boxes past the
// keys or behind an entry outside the pool load TMA's zero fill, so no byte outside the pool is
// read and the ring's byte count is that of a dense tile. kGather (page sizes no TMA box fits:
// not a multiple of Cfg::kPageBoxRows, a token pool among them): the producer is the whole
// warpgroup and copies the tile row by row with cp.async instead (GatherPages).
//
// fp8 (Cfg::kFp8): the producer is the whole warpgroup. Each V tile is loaded with its K (TMA
// by thread 0, or paged: the same page boxes or gather as K) into the `v` staging ring, behind
// its own v_staged barrier, and at the tile's V turn all 128 threads write it transposed into the
// `vt` ring the consumers read (fp8.cuh TransposeV), then arrive on that ring's full barrier
// (128 arrivals, kernel.cuh).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "ffi/cuda/attention/common/mma.cuh"
#include "ffi/cuda/attention/sm90/fwd/config.h"
#include "ffi/cuda/attention/sm90/fwd/fp8.cuh"
#include "ffi/cuda/attention/sm90/fwd/gemm.cuh"
#include "ffi/cuda/attention/sm90/fwd/kernel_params.h"
#include "ffi/cuda/attention/sm90/fwd/tile_scheduler.cuh"
#include "ffi/cuda/attention/sm90/gmem_view.h"
#include "ffi/cuda/attention/sm90/tma_load.h"

namespace jax_sgl::cuda::sm90 {

// Paged: the page-table entries [base, base + 32) of one work tile's row, one per lane of the
// producer warp; `page` is num_pages (a TMA coordinate past the pool: zero fill) where the entry
// is outside [0, num_pages) or past the sequence's keys. One load serves 32 entries, i.e.
// 32 * page_size / kBlockN key tiles, so the page-table read latency shows once per window.
struct PageWindow {
  int base;
  int page;
};

// Paged TMA boxes: the box holding a sequence's last key also holds the page's rows after it (a
// page's unused tail: any bits, NaN included), which P V must not read. Of key tile n with
// `tail` = keys - n * block_n keys, the rows from `tail` to the end of its box; 0 when the tile
// holds no key or ends on a box boundary. (Boxes past the keys hold TMA's zero fill.)
__device__ __forceinline__ int PageTailRows(int tail, int block_n, int box_rows) {
  if (tail <= 0 || tail >= block_n) return 0;
  return (box_rows - tail % box_rows) % box_rows;
}

template <typename Cfg, bool kVarlen, bool kPaged = false, bool kGather = false>
struct MainloopLoad {
  using Pipeline = typename Cfg::Pipeline;
  using PipelineState = cutlass::PipelineState<Cfg::kStages>;
  using Scheduler = TileScheduler<Cfg, kVarlen, KernelParams<Cfg>, kPaged>;
  static constexpr int kBlockN = Cfg::kBlockN;
  static_assert(!kPaged || kVarlen, "paged K/V is a varlen geometry");
  static_assert(!kGather || kPaged, "the gather loads pages");
  // Producer threads: the warpgroup when paged (page boxes, gather) or fp8 (V transpose), else
  // one thread issuing every TMA.
  static constexpr int kThreads = kPaged || Cfg::kFp8 ? 128 : 1;

  KernelParams<Cfg> const& params;
  Scheduler const& scheduler;
  typename Cfg::SharedStorage& shared;
  Pipeline& pipe_k;
  Pipeline& pipe_v;

  // Paged: makes the window hold the entries [e_lo, e_hi] (at most 32 apart), loading the 32
  // that end at e_hi when it does not: key tiles come last first, so the next tiles' entries
  // are the lower ones. Warp-uniform (all lanes pass the same e_lo, e_hi).
  __device__ __forceinline__ void Refill(PageWindow& win, WorkTile const& w, int e_lo,
                                         int e_hi) const {
    if (e_lo >= win.base && e_hi < win.base + 32) return;
    win.base = max(0, e_hi - 31);
    const int entry = win.base + int(threadIdx.x % 32);
    const int page_rows = params.page_boxes * Cfg::kPageBoxRows;
    const int n_entries = (w.k_len + page_rows - 1) / page_rows;  // <= max_pages
    const int page =
        entry < n_entries ? params.page_table[int64_t(w.batch) * params.max_pages + entry] : -1;
    win.page = page >= 0 && page < params.num_pages ? page : params.num_pages;
  }

  // The pages of the keys a producer thread resolves in key tile n's K load (GatherPages'
  // write_rows: keys n kBlockN + t + 128 p), -1 past the keys. Read one K load ahead (load_tile):
  // resolved in the load itself, the page-table read's latency sat between the ring's empty slot
  // and the first copy of every tile (ncu, H100, pages of 1: the producer's long-scoreboard
  // stalls, the tensor pipe 39% busy against FA3's 67%).
  static constexpr int kGatherKeysPerThread = (kBlockN + 127) / 128;
  struct GatherPagesAhead {
    int page[kGatherKeysPerThread];
  };
  __device__ __forceinline__ GatherPagesAhead ReadPagesAhead(WorkTile const& w, int n) const {
    GatherPagesAhead ahead;
#pragma unroll
    for (int p = 0; p < kGatherKeysPerThread; ++p) {
      const int r = 128 * p + int(threadIdx.x), key = n * kBlockN + r;
      ahead.page[p] = r < kBlockN && key < w.k_len
                          ? params.page_table[int64_t(w.batch) * params.max_pages +
                                              params.page_div.Div(uint32_t(key))]
                          : -1;
    }
    return ahead;
  }

  // Paged gather: key tile n of this sequence into stage `stage` of sKV by the 128 producer
  // threads, one 16-byte cp.async per (row, chunk), completing on the stage's full barrier
  // (initialized for 128 asynchronous arrivals + the leader's, kernel.cuh). A K load
  // (write_rows) first resolves each key through the page table, one key per thread, and
  // publishes its pool row (-1: past the keys or a bad entry, loaded as zeros) in a slot of
  // shared.gather_rows, and the stage's per-key hole words; the V load of the same tile, one K
  // load later, reads the same rows. Three slots, by K load count: the K load after that V load
  // writes another slot, and the one after it only once every thread has passed the producer
  // barrier of the first, i.e. has finished that V load.
  //
  // Why 32-bit rows: per copy the loop spends a 32 x 32 -> 64-bit product (row x row stride in
  // bytes), its 64-bit add to the thread's base, the ignore-source test of the row and the LDGSTS
  // (5 SASS instructions), the rows four to a shared load. Published 64-bit row addresses cost a
  // 64-bit add and a 64-bit null test more per copy, and with integer divisions by the page size
  // (now FastDiv) the producer took 510 instructions a warp and tile, a quarter of the kernel's
  // (ncu, H100, chunked prefill at pages of 1).
  template <typename SKV>
  __device__ __forceinline__ void GatherPages(WorkTile const& w, SKV const& sKV, int kv,
                                              int kv_head, uint64_t* bar, int n, int stage,
                                              uint32_t k_load,
                                              GatherPagesAhead const* ahead) const {
    const bool write_rows = ahead != nullptr;  // a K load: resolve the keys from their pages
    using E = Element_t<Cfg>;
    constexpr int kChunkElems = Cfg::kChunkElems;
    constexpr int kChunks = Cfg::kRowChunks;                     // 16-byte chunks per row
    constexpr int kThreadsPerRow = kChunks < 16 ? kChunks : 16;  // 8 rows per pass from 256 bytes
    constexpr int kPerRow = kChunks / kThreadsPerRow;            // chunks per thread and row
    constexpr int kRowsPerPass = 128 / kThreadsPerRow;           // a multiple of 8
    constexpr int kPasses = kBlockN / kRowsPerPass;
    // A row's bytes within its swizzle atom: 128, or 64 (e4m3 hd64's 64-byte atoms).
    constexpr int kAtomRowBytes = kChunks * 16 < 128 ? kChunks * 16 : 128;
    static_assert(kRowsPerPass % 8 == 0 && Cfg::kBlockN % kRowsPerPass == 0);
    static_assert(kChunks * 16 == 64 || kChunks * 16 % 128 == 0, "rows of 64 or 128k bytes");
    const int t = int(threadIdx.x);
    int* rows = shared.gather_rows[k_load % 3];
    // Key r's slot: the rows one thread copies (r % kRowsPerPass fixed, pass r / kRowsPerPass)
    // side by side, so that it reads them with vector loads.
    auto slot_of = [](int r) { return (r % kRowsPerPass) * kPasses + r / kRowsPerPass; };
    if (write_rows) {
#pragma unroll
      for (int p = 0; p < kGatherKeysPerThread; ++p) {
        const int r = 128 * p + t, key = n * kBlockN + r;
        const int page = ahead->page[p];  // -1 past the keys
        const int in_page = key - int(params.page_div.Div(uint32_t(key))) * params.page_size;
        const int row = page >= 0 && page < params.num_pages
                            ? page * params.page_size + in_page
                            : -1;
        if (r < kBlockN) rows[slot_of(r)] = row;
        const uint32_t bad = __ballot_sync(0xffffffffu, row < 0);
        if (t % 32 == 0 && r < kBlockN)
          *reinterpret_cast<volatile uint32_t*>(&shared.page_holes[stage][r / 32]) = bad;
      }
      cutlass::arch::NamedBarrier::sync(128, uint32_t(Barrier::kProducer));
    }
    // Thread t copies chunks c and c + 16, c + 32, ... (kPerRow of them) of rows t / kThreadsPerRow
    // + kRowsPerPass j: every row it copies has the same row % 8, so under the 128-byte swizzle
    // (16-byte chunk index ^ row % 8; the 64-byte one XORs with row / 2 % 4) its smem address
    // moves by kAtomRowBytes a row, and a chunk 16 to the right (256 bytes) is two 128-byte
    // atom columns of the tile further. A hole copies 0 bytes (zero fill) and reads nothing: its
    // address (from row -1) is never used.
    const int chunk = t % kThreadsPerRow;
    const uint32_t smem =
        cute::cast_smem_ptr_to_uint(&sKV(t / kThreadsPerRow, kChunkElems * chunk, stage));
    const E* head = (kv ? params.v_pool : params.k_pool) +
                    int64_t(kv_head) * (kv ? params.v_head_stride : params.k_head_stride);
    const uint64_t base = reinterpret_cast<uint64_t>(head + kChunkElems * chunk);
    // Below 2^32 (dispatch.cc, VarlenUnsupported).
    const uint32_t stride =
        uint32_t((kv ? params.v_row_stride : params.k_row_stride) * int64_t(sizeof(E)));
    const int* my_rows = rows + (t / kThreadsPerRow) * kPasses;
    // kBatch passes' rows are read before their copies are issued: the copies' "memory" clobber
    // keeps the compiler from moving a read above an earlier copy, and one read per copy left
    // every copy behind a shared-memory load's latency (ncu, page 1: the consumers waiting on
    // the K / V full barriers). Eight (against four, H100, page 1: chunked prefill +6%, mixed
    // batch +3%); fewer where the passes are not a multiple of eight (hd256's 80-key tile: ten
    // passes, two).
    constexpr int kBatch = kPasses % 8 == 0 ? 8 : kPasses % 4 == 0 ? 4 : kPasses % 2 == 0 ? 2 : 1;
#pragma unroll 1
    for (int j0 = 0; j0 < kPasses; j0 += kBatch) {
      int entries[kBatch];
      if constexpr (kBatch % 4 == 0) {
#pragma unroll
        for (int b = 0; b < kBatch; b += 4) {
          const int4 v = *reinterpret_cast<const int4*>(my_rows + j0 + b);
          entries[b] = v.x, entries[b + 1] = v.y, entries[b + 2] = v.z, entries[b + 3] = v.w;
        }
      } else if constexpr (kBatch == 2) {
        const int2 v = *reinterpret_cast<const int2*>(my_rows + j0);
        entries[0] = v.x, entries[1] = v.y;
      } else {
        entries[0] = my_rows[j0];
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int j = j0 + b;
        uint64_t src;
        asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(src) : "r"(entries[b]), "r"(stride), "l"(base));
#pragma unroll
        for (int k = 0; k < kPerRow; ++k)
          asm volatile(
              "{\n .reg .pred p;\n setp.lt.s32 p, %2, 0;\n"
              " cp.async.cg.shared.global [%0], [%1], 16, p;\n}\n" ::"r"(
                  smem + j * (kRowsPerPass * kAtomRowBytes) + k * 2 * (kBlockN * 128)),
              "l"(src + 256 * k), "r"(entries[b])
              : "memory");
      }
    }
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(
                     cute::cast_smem_ptr_to_uint(bar))
                 : "memory");
    // The +1 arrival: after the hole words (written before the producer barrier above).
    if (t == 0) cutlass::arch::ClusterBarrier::arrive(bar);
  }

  // fp8 over paged TMA boxes: key tile n's page tail (PageTailRows; scores masked, but P V would
  // multiply 0 by them) is zeroed in the staged V before the transpose reads it (the 16-bit
  // kernels' consumers zero it in their V stage, kernel.cuh zero_v_tail; here the consumers read
  // V^T only). The gather's rows past the keys hold cp.async's zero fill already.
  __device__ __forceinline__ void ZeroStagedTail(WorkTile const& w, int n, int stage) const {
    const int tail = scheduler.SeqlenK(w) - n * kBlockN;  // rows from here are past the keys
    const int rows = PageTailRows(tail, kBlockN, params.page_box_rows);
    if (rows == 0) return;  // warpgroup-uniform
    constexpr int kChunks = Cfg::kRowChunks;
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Cfg::SmemLayoutKVRows{});
#pragma unroll 1
    for (int i = int(threadIdx.x); i < rows * kChunks; i += 128)
      *reinterpret_cast<uint4*>(&sV(tail + i / kChunks, Cfg::kChunkElems * (i % kChunks), stage)) =
          make_uint4(0, 0, 0, 0);
    cutlass::arch::NamedBarrier::sync(128, uint32_t(Barrier::kProducer));
  }

  // The producer's whole run (one thread; the warpgroup when paged or fp8): the launch tile
  // (non-persistent), or the scheduler's tiles until none is left (persistent).
  __device__ __forceinline__ void Run(WorkTile const& launch_tile) {
    // The thread that issues loads and arrives on barriers (PipelineTmaAsync's is_leader).
    const bool leader = kThreads == 1 || threadIdx.x == 0;
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Cfg::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Cfg::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Cfg::SmemLayoutKV{});
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
      const int kv_head = scheduler.KvHead(w);
      // [64, D, m/64] rows of this (batch, head); [N, D, n] keys of this (batch, kv head).
      // Varlen: boxes that run past a sequence's end read the next sequence's rows (or TMA's
      // zero fill past the buffer): masked as keys past k_len, unused as q rows past q_len.
      auto tQ = HeadTiles<kVarlen, typename Cfg::RowsD>(params.tma_q, params.q_shape, sQ, w.head,
                                                        w.batch, w.q_row0);
      auto tK = HeadTiles<kVarlen, typename Cfg::KeysD>(params.tma_k, params.kv_shape, sK, kv_head,
                                                        w.batch, w.k_row0);
      auto tV = HeadTiles<kVarlen, typename Cfg::KeysD>(params.tma_v, params.kv_shape, sV, kv_head,
                                                        w.batch, w.k_row0);
      auto tQg = get<0>(tQ);
      auto tQs = get<1>(tQ);
      auto tKg = get<0>(tK);
      auto tKs = get<1>(tK);
      auto tVg = get<0>(tV);
      auto tVs = get<1>(tV);
      // Paged: key tile n of this sequence into stage `stage` of sKV, lane i loading box i (the
      // boxes' page lookups and TMA issues then run side by side: one lane issuing them in turn
      // kept the tensor cores waiting, 0.40x the contiguous kernel). Arrives on the stage's full
      // barrier itself (is_leader is off for the paged kernel's rings) after writing the K
      // stage's holes (holes != nullptr): mbarrier.arrive releases and the consumers' wait
      // acquires, so they see them once the barrier completes.
      [[maybe_unused]] PageWindow win_k{-(1 << 30), 0}, win_v{-(1 << 30), 0};
      auto load_pages = [&](CUtensorMap const& map, Element_t<Cfg>* ring, PageWindow& win,
                            uint64_t* bar, int n, int stage, uint32_t* holes) {
        const int g0 = n * Cfg::kPageBoxes;  // the tile's first box
        Refill(win, w, g0 / params.page_boxes, (g0 + Cfg::kPageBoxes - 1) / params.page_boxes);
        const int lane = int(threadIdx.x % 32);
        const int box = g0 + min(lane, Cfg::kPageBoxes - 1);
        const int entry = box / params.page_boxes;
        int page = __shfl_sync(0xffffffffu, win.page, entry - win.base);
        if (box * Cfg::kPageBoxRows >= w.k_len) page = params.num_pages;  // past the keys
        const uint32_t bad = __ballot_sync(0xffffffffu, page == params.num_pages);
        if (leader) {
          if (holes != nullptr)
            *reinterpret_cast<volatile uint32_t*>(holes) = bad & ((1u << Cfg::kPageBoxes) - 1);
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, Cfg::kKVTileBytes);
        }
        __syncwarp();
        // Lane i loads box i of page_box_rows keys (a wide box: lane i takes over what lane
        // i * ratio found for its first 16 keys; a box never straddles a page), all its columns
        // in one load: the ring's row groups hold whole rows (Cfg::SmemLayoutKVRows).
        constexpr int kWide = Cfg::kPageBoxRowsWide / Cfg::kPageBoxRows;
        const bool wide = kWide > 1 && params.page_box_rows == Cfg::kPageBoxRowsWide;
        const int from = min(wide ? lane * kWide : lane, 31);
        const int box_page = __shfl_sync(0xffffffffu, page, from);
        const int in_page = __shfl_sync(0xffffffffu, box - entry * params.page_boxes, from);
        // Each warp issues a quarter of the boxes: the TMA instruction takes its operands from
        // uniform registers, so the lanes of one warp issuing loads go one after another (an
        // elected-lane loop in the SASS); four warps issue theirs side by side.
        const bool mine = lane % 4 == int(threadIdx.x / 32);
        if (mine && lane < (wide ? kBlockN / Cfg::kPageBoxRowsWide : Cfg::kPageBoxes)) {
          // The box's first 8-row group of the pool (past the pool for a bad entry: TMA's zero
          // fill; pages hold whole groups, tile_size.h).
          const int group = box_page * (params.page_size >> 3) + in_page * (Cfg::kPageBoxRows / 8);
          const int row0 = lane * (wide ? Cfg::kPageBoxRowsWide : Cfg::kPageBoxRows);
          TmaLoadNoHintOp::copy(&map, bar, ring + (stage * kBlockN + row0) * Cfg::kHeadDim, 0, 0,
                                0, kv_head, group);
        }
      };
      // Gather: the pages of the next K load's keys, read one K load ahead (ReadPagesAhead).
      [[maybe_unused]] GatherPagesAhead pages_next;
      if constexpr (kGather)
        if (!tiles.empty()) pages_next = ReadPagesAhead(w, tiles.n_end - 1);
      auto load_k = [&](int n) {
        [[maybe_unused]] GatherPagesAhead pages_now;
        if constexpr (kGather) {
          pages_now = pages_next;
          if (n > tiles.n_begin) pages_next = ReadPagesAhead(w, n - 1);  // K tiles run down
        }
        const PipelineState write_k = write_state(k_loads++);
        pipe_k.producer_acquire(write_k);
        if constexpr (kPaged) {
          if constexpr (kGather)
            GatherPages(w, sK, 0, kv_head, pipe_k.producer_get_barrier(write_k), n, write_k.index(),
                        k_loads - 1, &pages_now);
          else
            load_pages(params.k_page_map, shared.k.data(), win_k,
                       pipe_k.producer_get_barrier(write_k), n, write_k.index(),
                       shared.page_holes[write_k.index()]);
          if constexpr (Cfg::kFp8) {
            // V of the same tile into the staging slot of the same index, from the same pages
            // (the gather's rows just published, the page window just filled), as below.
            auto* staged = reinterpret_cast<uint64_t*>(&shared.v_staged[write_k.index()]);
            if constexpr (kGather)
              GatherPages(w, sV, 1, kv_head, staged, n, write_k.index(), k_loads - 1, nullptr);
            else
              load_pages(params.v_page_map, shared.v.data(), win_k, staged, n, write_k.index(),
                         nullptr);
          }
        } else if constexpr (Cfg::kFp8) {
          // V of the same tile into the staging slot of the same index: the slot's previous
          // tile was transposed (load_v) before this K load, past the producers' barrier there.
          if (leader) {
            copy(NoCacheHint(params.tma_k.with(*pipe_k.producer_get_barrier(write_k))),
                 tKg(_, n), tKs(_, write_k.index()));
            auto& staged = shared.v_staged[write_k.index()];
            staged.arrive_and_expect_tx(Cfg::kKVTileBytes);
            copy(NoCacheHint(params.tma_v.with(reinterpret_cast<uint64_t&>(staged))), tVg(_, n),
                 tVs(_, write_k.index()));
          }
        } else
          copy(NoCacheHint(params.tma_k.with(*pipe_k.producer_get_barrier(write_k))), tKg(_, n),
               tKs(_, write_k.index()));
      };
      // behind: K loads of this tile issued since the K of this V.
      auto load_v = [&](int n, uint32_t behind) {
        const PipelineState write_v = write_state(k_loads - behind);
        if constexpr (Cfg::kFp8) {
          // The staged tile (loaded with its K, `behind` K loads ago, into slot write_v.index())
          // -> V^T stage write_v.index() once the consumers released it.
          const uint32_t count = k_loads - behind;
          shared.pipe_v.empty_barrier_[write_v.index()].wait(write_v.phase());
          shared.v_staged[write_v.index()].wait((count / Cfg::kStages) & 1u);
          // Paged TMA boxes fill the staging ring by whole rows (config.h SmemLayoutKVRows).
          using LayoutV = std::conditional_t<kPaged && !kGather, typename Cfg::SmemLayoutKVRows,
                                             typename Cfg::SmemLayoutKV>;
          if constexpr (kPaged && !kGather) {
            if (n == tiles.n_end - 1) ZeroStagedTail(w, n, write_v.index());
          }
          TransposeV<Cfg, LayoutV>(cute::cast_smem_ptr_to_uint(shared.v.data()),
                                   cute::cast_smem_ptr_to_uint(shared.vt.data()), write_v.index(),
                                   int(threadIdx.x));
          cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> wgmma reads
          shared.pipe_v.full_barrier_[write_v.index()].arrive();
          // Every thread has read the staging slot before the next K load's TMA refills it.
          cutlass::arch::NamedBarrier::sync(128, uint32_t(Barrier::kProducer));
          return;
        }
        pipe_v.producer_acquire(write_v);
        if constexpr (kPaged) {
          // V of tile n: the K load of tile n was `behind` K loads ago, into this stage index.
          if constexpr (kGather)
            GatherPages(w, sV, 1, kv_head, pipe_v.producer_get_barrier(write_v), n, write_v.index(),
                        k_loads - behind, nullptr);
          else
            load_pages(params.v_page_map, shared.v.data(), win_v,
                       pipe_v.producer_get_barrier(write_v), n, write_v.index(), nullptr);
        } else
          copy(NoCacheHint(params.tma_v.with(*pipe_v.producer_get_barrier(write_v))), tVg(_, n),
               tVs(_, write_v.index()));
      };
      if (!tiles.empty()) load_k(tiles.n_end - 1);
      claim_q();
      if (leader) {
        if (scheduler.Pack() > 1) {
          shared.barrier_q.arrive();  // PackGQA: the consumers load Q themselves
        } else {
          shared.barrier_q.arrive_and_expect_tx(2 * Cfg::kQHalfBytes);
          for (int half = 0; half < Cfg::kConsumers; ++half)
            copy(NoCacheHint(params.tma_q.with(reinterpret_cast<uint64_t&>(shared.barrier_q))),
                 tQg(_, 2 * w.m_block + half), tQs(_, half));
        }
      }
      // Rolled: nvcc unrolled it 4x, and the addresses of the unrolled copies did not fit the
      // producer's 24 registers (varlen spilled); the producer waits on the ring anyway.
#pragma unroll 1
      for (int n = tiles.n_end - 2; n >= tiles.n_begin; --n) {
        load_k(n);
        load_v(n + 1, 2);
      }
      if (!tiles.empty()) load_v(tiles.n_begin, 1);
    };
    if constexpr (!Cfg::kPersistent) {
      const KeyTiles tiles = scheduler.Keys(launch_tile);
      if (!tiles.empty()) load_tile(launch_tile, tiles, [] {});
    } else {
      // Every tile goes through the Q barrier, also one without keys (the consumers write its
      // zeros), and a final -1 tells the consumers to stop. Item ordinal iter may write Q once
      // the consumers released ordinal iter - 1.
      int iter = 0;
      // Paged and fp8: thread 0 takes the next tile (a counter must be read once) and tells the
      // warpgroup through smem (the second sync keeps the next write behind every read).
      auto next = [&](int t) {
        if constexpr (kThreads > 1) {
          if (leader) shared.next_tile = scheduler.Next(t);
          cutlass::arch::NamedBarrier::sync(128, uint32_t(Barrier::kProducer));
          const int next_t = *reinterpret_cast<volatile int*>(&shared.next_tile);
          cutlass::arch::NamedBarrier::sync(128, uint32_t(Barrier::kProducer));
          return next_t;
        } else {
          return scheduler.Next(t);
        }
      };
      for (int t = scheduler.First();; t = next(t)) {
        const bool valid = scheduler.Valid(t);
        auto claim_q = [&] {
          if (iter >= 1) shared.barrier_q_empty.wait((iter - 1) & 1);
          if (leader) *reinterpret_cast<volatile int*>(&shared.tile) = valid ? t : -1;
          CompilerFence();
        };
        if (!valid) {
          claim_q();
          if (leader) shared.barrier_q.arrive();
          break;
        }
        WorkTile w = scheduler.Item(t);
        if (!scheduler.Resolve(w)) continue;  // varlen: past the last sequence; never published
        load_tile(w, scheduler.Keys(w), claim_q);
        ++iter;
      }
    }
  }
};

}  // namespace jax_sgl::cuda::sm90
