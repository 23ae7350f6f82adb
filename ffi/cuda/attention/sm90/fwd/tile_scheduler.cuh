// The sm_90a flash forward's tile scheduler: which work tiles (128 query rows of one (q head,
// batch), or a share of one's keys under the tail or key split) a CTA runs, in what order, and
// which key tiles each visits. Non-persistent kernels run the grid's one tile per CTA; persistent
// ones start at blockIdx.x and take the next from a stride or a counter. The consumers read their current
// tile back from smem (HeldTile) rather than keep it in registers across the main loop.
#pragma once

#include <cute/tensor.hpp>

#include "ffi/common/attention_geometry.h"
#include "ffi/cuda/attention/sm90/fwd/config.h"

namespace jax_sgl::cuda::sm90 {

// Varlen: tile index `index` as a work tile, or false past the last sequence's last tile.
// Sequences in order, each as (q head, row block) with the row block inner and, when causal,
// longest first, the order DecodeTile gives dense calls: the CTAs running at once then read the
// K/V of one sequence's few kv heads, which stay in L2 while its q heads' tiles run. (Q heads
// outer over all the sequences' row blocks made each kv head's K/V a working set of every
// sequence: 1.55x FA3's DRAM reads on the paged chunked prefill, ncu session 22.) An O(batch)
// scan of cu_seqlens per tile instead of a prefix-sum pass: batch is small next to a tile's work.
// Lengths clamp like attention_seq.h GetSeqBounds, so bad index arrays never leave the buffers.
// pack: tile rows per q row (PackGQA, TileScheduler::Pack), so a sequence of q_len rows has
// ceil(q_len * pack / block_m) blocks; heads: the tile heads (kv heads when packed).
template <typename Params>
__device__ bool VarlenTile(Params const& params, int index, int heads, int block_m, int pack,
                           WorkTile& w) {
  int blocks = 1, r = 0;
  if (params.cu_seqlens_q == nullptr) {
    blocks = (params.seqlen_q * pack + block_m - 1) / block_m;
    if (blocks == 0) return false;
    w.batch = index / (blocks * heads);
    r = index % (blocks * heads);
    w.q_row0 = w.batch * params.seqlen_q;
    w.q_len = params.seqlen_q;
  } else {
    int acc = 0, b = 0;
    for (; b < params.batch; ++b) {
      const RowRange rows = ClampedRows(params.cu_seqlens_q[b], params.cu_seqlens_q[b + 1],
                                        params.total_q);
      blocks = (int(rows.len) * pack + block_m - 1) / block_m;
      if (index < acc + blocks * heads) {
        r = index - acc;
        w.q_row0 = int(rows.begin);
        w.q_len = int(rows.len);
        break;
      }
      acc += blocks * heads;
    }
    w.batch = b;
  }
  if (w.batch >= params.batch) return false;
  w.head = r / blocks;
  w.m_block = params.causal ? blocks - 1 - r % blocks : r % blocks;
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

// Key tiles [n_begin, n_end) a CTA visits (producer and consumers both derive them from here),
// and which of them need masking: those >= n_mask_begin (right edge: causal / window right, end
// of the keys) and those < n_mask_end (left edge: window left). Tiles outside the range hold no
// visible key for any row of the CTA and are never loaded.
struct KeyTiles {
  int n_begin;
  int n_end;         // <= n_begin: no visible key at all (the rows get 0 and LSE -inf)
  int n_mask_begin;
  int n_mask_end;
  // q rows [row_first, row_last] are the CTA's (its tile's first and last).
  __device__ KeyTiles(int row_first, int row_last, int block_n, int seqlen_q, int seqlen_k,
                      int left, int right) {
    // Row i sees keys [i + diag - left, i + diag + right]: the CTA's last row bounds the range
    // above, its first row below; every row sees [last - left, first + right] unmasked.
    const int diag = seqlen_k - seqlen_q;
    const int first = row_first + diag, last = row_last + diag;
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
// The tile is an index (split -1: the whole tile), which DecodeTile (dense) or VarlenTile maps.
template <typename Params>
__device__ __forceinline__ WorkTile ItemIndex(Params const& params, int t) {
  if (t < params.num_whole_tiles) return {t, 0, 0};
  const int u = t - params.num_whole_tiles;
  WorkTile w{params.num_whole_tiles + u / params.tail_splits, 0, 0};
  w.split = u % params.tail_splits;
  return w;
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

// The scheduler of one kernel instantiation: tile geometry for the producer and the consumers.
// kVarlen: packed sequences (cu_seqlens_q / cu_seqlens_k, seqused_k), each tile with its own
// geometry (VarlenTile); else the call's dense geometry. kPack (the paged kernel): the call may
// pack the q heads of a GQA group into the tile rows (params.pack, launch.cuh).
template <typename Cfg, bool kVarlen, typename Params, bool kPack = false>
struct TileScheduler {
  Params const& params;

  // PackGQA: tile row m is q row m / Pack() of q head w.head * Pack() + m % Pack(), so a tile
  // holds the rows of all the q heads that share one kv head (w.head is then that kv head) and
  // calls of few q rows per sequence still fill its 128 rows. 1: row m is q row m of q head
  // w.head.
  __device__ __forceinline__ int Pack() const {
    if constexpr (kPack) return params.pack;
    else return 1;
  }
  __device__ __forceinline__ int KvHead(WorkTile const& w) const {
    return w.head * Pack() / params.group;
  }

  // Non-persistent: the CTA's one tile; causal CTAs with more rows have more key tiles, launch
  // them first. Varlen: the grid's linear index, which Resolve maps.
  __device__ __forceinline__ WorkTile LaunchTile() const {
    if constexpr (kVarlen) return {int(blockIdx.y * gridDim.x + blockIdx.x), 0, 0};
    return {params.causal ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x),
            int(blockIdx.y), int(blockIdx.z)};
  }
  // Persistent: the first work item and the one after t; Valid(t): t names a work item (else
  // the CTA is done).
  __device__ __forceinline__ int First() const { return int(blockIdx.x); }
  __device__ __forceinline__ int Next(int t) const { return NextTile(t, params.tile_counter); }
  __device__ __forceinline__ bool Valid(int t) const { return t < params.num_tiles; }
  __device__ __forceinline__ WorkTile Item(int t) const {
    WorkTile w = ItemIndex(params, t);
    if constexpr (!kVarlen) {
      const int split = w.split;
      w = DecodeTile(w.m_block, params.num_m_blocks, params.tile_heads, params.causal);
      w.split = split;
    }
    return w;
  }
  // Varlen: tile indices (a bound of linear row blocks x tile heads) name (sequence, head, row
  // block) through VarlenTile; indices past the last sequence's tiles do nothing: false.
  __device__ __forceinline__ bool Resolve(WorkTile& w) const {
    if constexpr (kVarlen)
      return VarlenTile(params, w.m_block, params.tile_heads, Cfg::kBlockM, Pack(), w);
    else return true;
  }
  // The sequence geometry of a tile: the call's (dense) or the tile's own (varlen).
  __device__ __forceinline__ int SeqlenQ(WorkTile const& w) const {
    return kVarlen ? w.q_len : params.seqlen_q;
  }
  __device__ __forceinline__ int SeqlenK(WorkTile const& w) const {
    return kVarlen ? w.k_len : params.seqlen_k;
  }
  // Whether work items may be key shares: the dense tail split, or the paged key split (kPack
  // is the paged kernel's; KernelParams::split_o).
  static constexpr bool kShares = Cfg::kPersistent && (!kVarlen || kPack);

  // The key tiles of a work tile (its share of them under the tail or key split: of the tiles
  // its rows visit, so a causal or windowed tile splits only those).
  __device__ __forceinline__ KeyTiles Keys(WorkTile const& w) const {
    const int row0 = w.m_block * Cfg::kBlockM;
    KeyTiles tiles(row0 / Pack(), (row0 + Cfg::kBlockM - 1) / Pack(), Cfg::kBlockN, SeqlenQ(w),
                   SeqlenK(w), params.window_left, params.window_right);
    if constexpr (kShares) {
      if (w.split >= 0) tiles.Split(w.split, params.tail_splits);
    }
    return tiles;
  }
};

}  // namespace jax_sgl::cuda::sm90
