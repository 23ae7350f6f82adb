// Which sequence and block a CTA of the sm_90a backward's varlen instantiations runs
// (cu_seqlens_q and cu_seqlens_k, which the API gives together), and where that sequence's rows
// live: the grid's x is the linear key block of all sequences for the dK/dV kernels (each
// ceil(k rows / kBlockN) blocks, in order), the linear row block for the dQ kernel, as the
// forward's VarlenTile linearizes row blocks. An O(batch) scan of cu_seqlens per CTA instead of
// a prefix-sum pass: batch is small next to a CTA's work. Lengths clamp like attention_seq.h
// GetSeqBounds, so bad index arrays never leave the buffers.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "ffi/common/attention_geometry.h"
#include "ffi/cuda/attention/flash_bwd_launch.h"  // PaddedSeqRow0

namespace jax_sgl::cuda::sm90 {

struct BwdSeqBlock {
  int batch;
  int n_block;     // key block within the sequence (the dK/dV kernels; the dQ kernel: row block)
  int q_row0;      // first row of the sequence in packed q / dout
  int q_len;
  int k_row0;      // first row in packed k / v / dk / dv
  int k_len;       // keys the sequence uses (seqused_k)
  int64_t ws_row0;  // padded workspace row of (sequence, head 0, row 0); head h adds h * ws_rows
};

// Linear block `lin` of the sequences' rows [cu[b], cu[b + 1]) cut into ceil(len / block) blocks
// each, in order: its sequence b, the block within it and the sequence's rows. False past the
// last sequence's last block (the grid is a bound).
__device__ __forceinline__ bool LinearSeqBlock(const int* cu, int batch, int64_t total, int lin,
                                               int block, int& b, int& within, RowRange& rows) {
  int acc = 0;
  for (b = 0; b < batch; ++b) {
    rows = ClampedRows(cu[b], cu[b + 1], total);
    const int blocks = (int(rows.len) + block - 1) / block;
    if (lin < acc + blocks) {
      within = lin - acc;
      return true;
    }
    acc += blocks;
  }
  return false;
}

// Linear block `lin` of all sequences: key blocks of block keys for the dK/dV kernels, row blocks
// of block rows for the dQ kernel (kRowBlocks; n_block is then the row block); the workspace
// padded to ws_align rows.
template <bool kRowBlocks = false, typename Params>
__device__ bool BwdVarlenBlock(Params const& params, int lin, int block, int ws_align,
                               BwdSeqBlock& s) {
  int b;
  RowRange r;
  if (!LinearSeqBlock(kRowBlocks ? params.cu_seqlens_q : params.cu_seqlens_k, params.batch,
                      kRowBlocks ? params.total_q : params.total_k, lin, block, b, s.n_block, r))
    return false;
  const RowRange k =
      kRowBlocks ? ClampedRows(params.cu_seqlens_k[b], params.cu_seqlens_k[b + 1], params.total_k)
                 : r;
  const RowRange q =
      kRowBlocks ? r
                 : ClampedRows(params.cu_seqlens_q[b], params.cu_seqlens_q[b + 1], params.total_q);
  s.batch = b;
  s.k_row0 = int(k.begin);
  s.k_len = params.seqused_k != nullptr ? int(ClampIndex(params.seqused_k[b], 0, k.len))
                                        : int(k.len);
  s.q_row0 = int(q.begin);
  s.q_len = int(q.len);
  s.ws_row0 = PaddedSeqRow0(q.begin, b, ws_align);
  return true;
}

// Rows [0, rows) of a [rows, kHeadDim] smem tile to dst (row r at dst + r * row_stride) by the
// 128 threads of a warpgroup, one 16-byte chunk (8 features: whole under every swizzle used) a
// thread at a time: varlen stores, where a TMA box would write into the next sequence.
template <int kHeadDim, typename Element, typename Tile>
__device__ __forceinline__ void StoreSmemRows(Element* dst, int64_t row_stride, int rows,
                                              Tile const& tile, int thread_in_wg) {
  constexpr int kChunks = kHeadDim / 8;
  const int live = rows * kChunks;
#pragma unroll 4
  for (int idx = thread_in_wg; idx < live; idx += 128) {
    const int r = idx / kChunks, c = idx % kChunks;
    *reinterpret_cast<uint4*>(dst + r * row_stride + c * 8) =
        *reinterpret_cast<const uint4*>(cute::raw_pointer_cast(&tile(r, c * 8)));
  }
}

}  // namespace jax_sgl::cuda::sm90
