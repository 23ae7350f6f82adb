// Per-sequence geometry of an attention call, shared by every backend: where sequence b's rows of
// q and k start, how long they are, where key j of a paged sequence lives, and which keys query
// row i may see. Every quantity derived from user index arrays is clamped to the buffers, so a bad
// cu_seqlens, seqused_k or page table never makes a kernel read or write out of bounds. The scalar
// math lives in attention_geometry.h, which the Metal kernels include too.
#pragma once

#include <cstdint>

#include "ffi/common/attention_geometry.h"
#include "ffi/common/attention_params.h"
#include "ffi/common/host_device.h"
#include "ffi/common/numeric.h"

namespace jax_sgl {

struct SeqBounds {
  int64_t q_row0;  // first row of q/out for this sequence
  int q_len;
  int64_t k_row0;  // first row of k/v (dense and varlen layouts)
  int k_len;       // keys visible to this sequence
  int64_t lse_row0;  // first lse column: 0 (dense, per-batch block) or q_row0 (varlen)
};

JAX_SGL_HD int64_t ClampI64(int64_t x, int64_t lo, int64_t hi) { return ClampIndex(x, lo, hi); }

JAX_SGL_HD SeqBounds GetSeqBounds(const AttentionParams& p, int b) {
  SeqBounds s;
  if (p.cu_seqlens_q) {
    const RowRange r = ClampedRows(p.cu_seqlens_q[b], p.cu_seqlens_q[b + 1], p.total_q);
    s.q_row0 = r.begin;
    s.q_len = int(r.len);
    s.lse_row0 = r.begin;
  } else {
    s.q_row0 = int64_t(b) * p.seqlen_q;
    s.q_len = p.seqlen_q;
    s.lse_row0 = 0;
  }
  int64_t k_cap;
  switch (p.kv_layout) {
    case KvLayout::kVarlen: {
      const RowRange r = ClampedRows(p.cu_seqlens_k[b], p.cu_seqlens_k[b + 1], p.total_k);
      s.k_row0 = r.begin;
      k_cap = r.len;
      break;
    }
    case KvLayout::kPaged:
      s.k_row0 = 0;
      k_cap = int64_t(p.max_pages) * p.page_size;
      break;
    default:
      s.k_row0 = int64_t(b) * p.seqlen_k;
      k_cap = p.seqlen_k;
      break;
  }
  s.k_len = int(p.seqused_k ? ClampI64(p.seqused_k[b], 0, k_cap) : k_cap);
  return s;
}

// Row of k/v holding key j of sequence b, or -1 when a page-table entry is out of range.
JAX_SGL_HD int64_t KeyRow(const AttentionParams& p, int b, const SeqBounds& s, int j) {
  if (p.kv_layout != KvLayout::kPaged) return s.k_row0 + j;
  const int page = p.page_table[int64_t(b) * p.max_pages + j / p.page_size];
  return PagedKeyRow(page, p.num_pages, p.page_size, j);
}

// Keys [*lo, *hi) visible to query row i: causal and windows align the last query with the last
// key (bottom-right), as FlashAttention does, so decode and chunked prefill see their prefix.
JAX_SGL_HD void KeyRange(const AttentionParams& p, const SeqBounds& s, int i, int* lo, int* hi) {
  const KeySpan span = VisibleKeys(i, s.q_len, s.k_len, p.window_left, p.window_right);
  *lo = span.lo;
  *hi = span.hi;
}

// Block scale i (flat) of q's or k's block scales as float32: exact for both storages.
JAX_SGL_HD float BlockScale(const void* scales, BlockScaleType type, int64_t i) {
  return type == BlockScaleType::kE8M0 ? ToFloat(static_cast<const f8e8m0_t*>(scales)[i])
                                       : static_cast<const float*>(scales)[i];
}

// The e8m0 NaN encoding: not a scale (the CPU kernel rejects a call that reads one).
JAX_SGL_HD bool IsBlockScaleNaN(const void* scales, BlockScaleType type, int64_t i) {
  return type == BlockScaleType::kE8M0 && static_cast<const f8e8m0_t*>(scales)[i].bits == 0xffu;
}

}  // namespace jax_sgl
