// The sm_90a flash forward's kernel parameters: the launcher (launch.cuh) fills them per call,
// every part of the kernel (tile scheduler, mainloop load and mma, epilogue) reads them.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "ffi/common/attention_params.h"  // HeadDescale
#include "ffi/cuda/attention/common/fast_div.h"
#include "ffi/cuda/attention/sm90/fwd/config.h"

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
  int tile_heads;                    // heads of the tile order: num_heads / pack
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
  typename Cfg::ElementOut* out;     // O, stored row by row (never past a sequence's end)
  // Tail split (dense persistent, launch.cuh; the paged key split reuses the item numbering,
  // with its own partials below): tiles from num_whole_tiles on are the last,
  // partial wave's; each runs as tail_splits items over shares of its key tiles, which store O
  // (float32, normalized by their own sums) and LSE in tail_o / tail_lse for
  // FlashFwdSm90TailCombine. tail_splits 0: off (num_whole_tiles = num_tiles).
  int num_whole_tiles;
  int tail_splits;
  float* tail_o;                     // [tail tile, split, kBlockM, head_dim]
  float* tail_lse;                   // [tail tile, split, kBlockM]
  // Attention sinks (attention_sink.h): the epilogue applies them from the LSE, the tail combine
  // to merged tail tiles (never to a share).
  const float* sinks;                // [num_heads] or nullptr
  // Paged kernel only (kPaged, not kGather): K/V pools as 5-D TMA maps (EncodePageMap: 128
  // bytes of columns, 8 rows, column block, kv head, 8-row group of the pool), loaded box by box
  // (page_box_rows keys, every column) through page_table [batch, max_pages]. seqlen_k is then
  // max_pages * page_size, each sequence's key bound. Entries outside [0, num_pages) load zeros
  // (a row group past the pool) and are masked like keys past the end.
  CUtensorMap k_page_map;
  CUtensorMap v_page_map;
  const int32_t* page_table;
  int max_pages;
  int page_boxes;                    // page_size / kPageBoxRows (the launcher checked it divides)
  int num_pages;
  int page_box_rows;                 // rows per TMA box: kPageBoxRowsWide where it divides
                                     // page_size and is wider, else kPageBoxRows
  // Paged gather (the kGather instantiation; mainloop_load.cuh): the producer warpgroup copies
  // K/V rows with cp.async through the page table instead of TMA boxes, for any page size.
  // page_box_rows is then 1 (the loads zero-fill every row past the keys).
  int page_size;
  FastDiv page_div;  // by page_size (the gather's page lookups)
  // K / V of (pool row r, kv head h) at pool + r * row_stride + h * head_stride (AttentionParams'
  // strides: a fused K/V buffer too).
  const Element_t<Cfg>* k_pool;
  const Element_t<Cfg>* v_pool;
  int64_t k_row_stride, k_head_stride;
  int64_t v_row_stride, v_head_stride;
  // PackGQA (paged kernel only; TileScheduler::Pack): q heads per tile row group, 1 or group.
  // pack > 1: the consumers load Q from q row by row and store O the same way.
  int pack;
  const Element_t<Cfg>* q;           // [total_q, num_heads, head_dim]
  // fp8 (Cfg::kFp8): the per-head descales (AttentionParams), placed as the CPU kernel does:
  // q_descale * k_descale into the softmax scale, v_descale onto O.
  HeadDescale q_descale;
  HeadDescale k_descale;
  HeadDescale v_descale;
  // Key split (paged, persistent; Sm90KeySplits): num_whole_tiles is 0 and every tile runs as
  // tail_splits shares of the key tiles it visits (KeyTiles::Split). Each share writes its rows'
  // O (float32, normalized by its own sum) and LSE, without sinks, here instead of out / lse;
  // LaunchSplitCombine merges them (and applies the sinks). nullptr: off.
  float* split_o;                    // [split, total_q, num_heads, head_dim]
  float* split_lse;                  // [split, total_q, num_heads]
};

}  // namespace jax_sgl::cuda::sm90
