// Host launcher of the sm_90a flash forward: builds the TMA descriptors for one call (dense
// [batch, seq, heads, head_dim] tensors) and launches one CTA per (128 query rows, q head, batch),
// or, where the head dim's tile choice is persistent (tile_size.h), one CTA per SM.
// Included only by the generated instantiations/sm90_fwd_*.cu files.
#pragma once

#include <algorithm>

#include "ffi/common/numeric.h"
#include "ffi/cuda/attention/common/cutlass_type.h"
#include "ffi/cuda/attention/common/device.h"
#include "ffi/cuda/attention/common/launch.cuh"
#include "ffi/cuda/attention/sm90/fwd/kernel.cuh"
#include "ffi/cuda/attention/sm90/fwd/launch.h"
#include "ffi/cuda/attention/sm90/fwd/page_map.h"
#include "ffi/cuda/attention/sm90/fwd/tail_combine.cuh"

namespace jax_sgl::cuda {
namespace sm90 {

using cuda::CutlassType;

// [rows, head_dim, kv heads, blocks] view of K or V at the params' strides (attention_params.h):
// a dense [batch, rows, kv heads, head_dim] buffer or packed rows (blocks = batch); a fused K/V
// buffer is either too. (A page pool has TMA maps of its own, page_map.h.)
template <typename Cfg>
auto KvTensor(const void* ptr, int rows, int head_dim, int heads, int blocks, int64_t row,
              int64_t head) {
  using E = typename Cfg::Element;
  return make_tensor(make_gmem_ptr(static_cast<E*>(const_cast<void*>(ptr))),
                     make_shape(rows, head_dim, heads, blocks),
                     make_stride(row, _1{}, head, row * rows));
}

// [rows, head_dim, heads, batch] view of a dense [batch, rows, heads, head_dim] buffer of E
// (the config's element, or its output's: bf16 O of an fp8 forward).
template <typename Cfg, typename E = typename Cfg::Element>
auto DenseTensor(const void* ptr, int rows, int head_dim, int heads, int batch) {
  const int64_t row = int64_t(heads) * head_dim;
  return make_tensor(make_gmem_ptr(static_cast<E*>(const_cast<void*>(ptr))),
                     make_shape(rows, head_dim, heads, batch),
                     make_stride(row, _1{}, int64_t(head_dim), row * rows));
}

template <typename T, int kHeadDim>
using FwdConfig = FlashConfig<typename CutlassType<T>::type, kHeadDim>;

}  // namespace sm90

// Dense calls launch FlashFwdSm90Kernel<Cfg, false, kSoftcap>, whose code does not change with varlen;
// calls with cu_seqlens_q, varlen k/v or seqused_k (dispatch.cc keeps them off it under
// JAX_SGL_DISABLE=sm90_varlen) launch the kVarlen instantiation: packed [total, D, H, 1] TMA views and
// a grid (persistent: tile range) of linear row blocks x q heads, a bound that the kernel maps
// onto (sequence, q head, row block) tiles (tile_scheduler.cuh VarlenTile).
// Paged calls with key_splits > 1 (Sm90KeySplits, persistent tile choices only) run every tile
// as key_splits shares, leaving float32 partials in scratch for the caller's combine.
template <typename T, int kHeadDim>
cudaError_t LaunchFlashFwdSm90(const AttentionParams& p, int key_splits, void* scratch,
                               cudaStream_t stream) {
  using Cfg = sm90::FwdConfig<T, kHeadDim>;
  using namespace cute;
  const bool varlen =
      p.cu_seqlens_q != nullptr || p.kv_layout != KvLayout::kDense || p.seqused_k != nullptr;
  const bool paged = p.kv_layout == KvLayout::kPaged;
  // Keys per sequence at most: paged sequences see up to max_pages pages (the kernel's seqlen_k,
  // from which VarlenTile clamps seqused_k).
  const int key_bound = paged ? p.max_pages * p.page_size : p.seqlen_k;
  // The tiles (Sm90TileGrid). PackGQA (paged only, Sm90PackGqa): a tile's rows are (q row, head
  // of the GQA group) pairs, pack tile rows per q row, and the tiles go per kv head.
  const Sm90Tiles grid_tiles = Sm90TileGrid(p, Cfg::kBlockM);
  const int pack = grid_tiles.pack;
  const int tile_heads = grid_tiles.tile_heads;
  const int num_m_blocks = grid_tiles.num_m_blocks;
  const int tile_batches = grid_tiles.tile_batches;
  const int num_tiles = int(grid_tiles.count());
  if (key_splits > 1 && !(paged && Cfg::kPersistent)) return cudaErrorInvalidValue;
  // Varlen views every tensor as packed rows (dense q or k alike: [batch * seqlen] rows).
  const int rows_q = varlen ? int(p.total_q) : p.seqlen_q;
  const int rows_k = varlen ? int(p.total_k) : p.seqlen_k;
  auto q = sm90::DenseTensor<Cfg>(p.q, rows_q, kHeadDim, p.num_heads, tile_batches);
  auto k = sm90::KvTensor<Cfg>(p.k, rows_k, kHeadDim, p.num_kv_heads, tile_batches,
                               p.k_row_stride, p.k_head_stride);
  auto v = sm90::KvTensor<Cfg>(p.v, rows_k, kHeadDim, p.num_kv_heads, tile_batches,
                               p.v_row_stride, p.v_head_stride);
  auto o = sm90::DenseTensor<Cfg, typename Cfg::ElementOut>(p.out, rows_q, kHeadDim, p.num_heads,
                                                            tile_batches);
  using KVTile = Shape<Int<Cfg::kBlockN>, Int<kHeadDim>>;
  // Paged: TMA boxes where the page size allows them (dispatch.cc checked page_size %
  // kPageBoxRows == 0), else the producer warpgroup's cp.async gather (mainloop_load.cuh
  // GatherPages, its own instantiation). Other calls leave the page maps empty: their kernels
  // never read them.
  const bool gather = paged && Sm90PagedGather(p);
  const bool wide = paged && !gather && Cfg::kPageBoxRowsWide > Cfg::kPageBoxRows &&
                    p.page_size % Cfg::kPageBoxRowsWide == 0;
  const int page_box_rows = gather ? 1 : wide ? Cfg::kPageBoxRowsWide : Cfg::kPageBoxRows;
  CUtensorMap k_page_map{}, v_page_map{};
  if (paged && !gather) {
    const CUtensorMapDataType type = TensorMapType<T>(Cfg::kFp8);
    constexpr int kBytes = int(sizeof(typename Cfg::Element));
    const int64_t pool_rows = int64_t(p.num_pages) * p.page_size;
    if (!sm90::EncodePageMap(&k_page_map, type, kBytes, p.k, kHeadDim, p.num_kv_heads, pool_rows,
                             p.k_row_stride, p.k_head_stride, page_box_rows) ||
        !sm90::EncodePageMap(&v_page_map, type, kBytes, p.v, kHeadDim, p.num_kv_heads, pool_rows,
                             p.v_row_stride, p.v_head_stride, page_box_rows))
      return cudaErrorInvalidValue;
  }
  // Window bounds as the kernel wants them (kernel.cuh KernelParams): causal is a right bound of
  // 0, and a bound that no row reaches (left >= seqlen_k - 1, right >= seqlen_q - 1) is none,
  // which also keeps the kernel's index sums far from int overflow. Varlen bounds the lengths by
  // the buffers' rows (dispatch.cc keeps total_q + total_k below 2^30).
  int window_left = p.window_left, window_right = p.causal ? 0 : p.window_right;
  if (window_left >= (paged ? key_bound : varlen ? rows_k : p.seqlen_k - 1)) window_left = -1;
  if (window_right >= (varlen ? rows_q : p.seqlen_q - 1)) window_right = -1;
  const bool softcap = p.softcap > 0.f;
  // Tail split (Sm90TailSplitRequested, ChooseTailSplit): each tile of the last, partial wave
  // runs as items over shares of its key tiles, merged by FlashFwdSm90TailCombine; a short
  // prefill (at most half a wave in all) is all tail, i.e. split-KV over every SM.
  int num_sms = 0;
  TailSplit split{0, 0};
  if constexpr (Cfg::kPersistent) {
    if (cudaError_t err = CurrentSmCount(&num_sms); err != cudaSuccess) return err;
    if (!varlen && Sm90TailSplitRequested(p))
      split = ChooseTailSplit(num_tiles, num_sms, (p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN);
  }
  // Key split (paged): every tile is a "tail" tile, from tile 0 on.
  const bool key_split = key_splits > 1;
  const int tail_tiles = key_split ? num_tiles : split.tail;
  const int tail_splits = key_split ? key_splits : split.splits;
  const int num_items = num_tiles - tail_tiles + tail_tiles * tail_splits;
  // Scratch (Sm90ScratchBytes): the counter, then O of one 128-row block per SM, then its LSE.
  static_assert(Cfg::kBlockM == 128, "Sm90TailBytes sizes 128-row blocks");
  float* tail_o = reinterpret_cast<float*>(static_cast<char*>(scratch) + kSm90CounterBytes);
  float* tail_lse = tail_o + int64_t(num_sms) * Cfg::kBlockM * kHeadDim;
  // Key split: O [split, total_q, num_heads, head_dim], then LSE [split, total_q, num_heads], as
  // LaunchSplitCombine reads them (Sm90KeySplitBytes).
  float* split_o = tail_o;
  float* split_lse = split_o + int64_t(key_splits) * p.total_q * p.num_heads * kHeadDim;
  // Persistent CTAs take their tiles from a counter when causal (tiles of unequal cost), else in a
  // static stride (a counter for non-causal calls too measured -1.2% to +2.7%: no clear gain).
  const bool dynamic_tiles = Cfg::kPersistent && p.causal;
  sm90::KernelParams<Cfg> params{
      make_tma_copy(SM90_TMA_LOAD{}, q, typename Cfg::SmemLayoutQHalf{}, typename Cfg::RowsD{},
                    _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, k, typename Cfg::SmemLayoutKVTile{}, KVTile{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, v, typename Cfg::SmemLayoutKVTile{}, KVTile{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, o, typename Cfg::SmemLayoutOHalf{}, typename Cfg::RowsD{},
                    _1{}),
      q.shape(),
      k.shape(),
      p.lse,
      p.seqlen_q,
      key_bound,
      p.num_heads,
      p.num_heads / p.num_kv_heads,
      tile_heads,
      softcap ? 1.f : p.softmax_scale,
      p.causal,
      window_left,
      window_right,
      softcap ? p.softcap : 0.f,
      softcap ? 2.f * float(M_LOG2E) * p.softmax_scale / p.softcap : 0.f,
      num_m_blocks,
      num_items,
      dynamic_tiles ? static_cast<int*>(scratch) : nullptr,
      p.cu_seqlens_q,
      p.kv_layout == KvLayout::kVarlen ? p.cu_seqlens_k : nullptr,
      p.seqused_k,
      rows_q,
      rows_k,
      p.batch,
      static_cast<typename Cfg::ElementOut*>(p.out),
      num_tiles - tail_tiles,
      tail_splits,
      tail_tiles > 0 && !key_split ? tail_o : nullptr,
      tail_tiles > 0 && !key_split ? tail_lse : nullptr,
      p.sinks,
      k_page_map,
      v_page_map,
      paged ? p.page_table : nullptr,
      paged ? p.max_pages : 0,
      paged ? p.page_size / Cfg::kPageBoxRows : 1,
      paged ? p.num_pages : 0,
      page_box_rows,
      p.page_size,
      FastDiv(uint32_t(paged ? p.page_size : 1)),
      static_cast<const typename Cfg::Element*>(p.k),
      static_cast<const typename Cfg::Element*>(p.v),
      p.k_row_stride,
      p.k_head_stride,
      p.v_row_stride,
      p.v_head_stride,
      pack,
      static_cast<const typename Cfg::Element*>(p.q),
      p.q_descale,
      p.k_descale,
      p.v_descale,
      key_split ? split_o : nullptr,
      key_split ? split_lse : nullptr,
  };
  // Softcap has its own instantiations (kernel.cuh kSoftcap), so the plain ones carry none of it.
  auto kernel = gather   ? (softcap ? sm90::FlashFwdSm90Kernel<Cfg, true, true, true, true>
                                    : sm90::FlashFwdSm90Kernel<Cfg, true, false, true, true>)
                : paged  ? (softcap ? sm90::FlashFwdSm90Kernel<Cfg, true, true, true>
                                    : sm90::FlashFwdSm90Kernel<Cfg, true, false, true>)
                : varlen ? (softcap ? sm90::FlashFwdSm90Kernel<Cfg, true, true>
                                    : sm90::FlashFwdSm90Kernel<Cfg, true, false>)
                         : (softcap ? sm90::FlashFwdSm90Kernel<Cfg, false, true>
                                    : sm90::FlashFwdSm90Kernel<Cfg, false, false>);
  dim3 grid(num_m_blocks, tile_heads, tile_batches);
  if constexpr (Cfg::kPersistent) {
    grid = dim3(std::min(num_items, num_sms));
    // The counter starts at 0 for every call (kernel.cuh NextTile).
    if (dynamic_tiles) {
      if (cudaError_t err = cudaMemsetAsync(scratch, 0, sizeof(int), stream); err != cudaSuccess)
        return err;
    }
  }
  if (cudaError_t err = LaunchWithSmem(kernel, grid, Cfg::kThreads,
                                       sizeof(typename Cfg::SharedStorage), stream, params);
      err != cudaSuccess)
    return err;
  if (tail_tiles > 0 && !key_split) {
    using Element = typename Cfg::ElementOut;
    const sm90::TailCombineParams<Element> combine{
        tail_o, tail_lse, static_cast<Element*>(p.out), p.lse, num_tiles - tail_tiles,
        tail_splits, num_m_blocks, p.num_heads, p.seqlen_q, p.sinks};
    sm90::FlashFwdSm90TailCombine<Element, kHeadDim, Cfg::kBlockM>
        <<<dim3(tail_tiles, Cfg::kBlockM / sm90::kTailWarps),
           32 * sm90::kTailWarps, 0, stream>>>(combine);
  }
  return cudaGetLastError();
}

}  // namespace jax_sgl::cuda

// Instantiates one (storage type T, head dim D) of the launchers above (instantiations/).
#define JAX_SGL_INSTANTIATE_SM90_FWD(T, D)               \
  namespace jax_sgl::cuda {                              \
  template cudaError_t LaunchFlashFwdSm90<T, D>(         \
      const AttentionParams&, int, void*, cudaStream_t); \
  }
