// Flash attention forward for Metal: same contract as ffi/cpu/attention_fwd.cc (dense / varlen /
// paged KV, bottom-right causal and sliding windows, softcap, GQA/MQA, LSE, attention sinks; fully
// masked rows give 0 and lse = -inf, or the sink; bad index arrays are clamped, out-of-range page
// entries are masked keys).
//
// One threadgroup owns kBlockM query rows of one (sequence, q head) and streams the visible keys
// in blocks of kBlockN through threadgroup memory with an online softmax:
//   1. key rows of the block (page-table lookup once per key)
//   2. K block -> threadgroup (float, zero-padded to a multiple of 8 features)
//   3. S = Q K^T on simdgroup 8x8 matrices
//   4. one thread per row: mask, softcap, running max / sum, P = exp(S - m), correction diag(c)
//      while the other threads load the V block
//   5. O = diag(c) O + P V on simdgroup matrices (the rescale is one more 8x8 multiply, so O never
//      leaves the matrix path)
// and writes O / l and m + log(l) at the end (with a sink, attention_sink.h's factor and lse). O lives in threadgroup memory rather than in
// registers: simpler, and the only form the Linux emulator can check (it never uses
// thread_elements()). head_dim and head_dim_v are runtime values up to kMaxHeadDim; the host
// falls back to the CPU kernels beyond that and for fp8.
#pragma once

#include "ffi/common/attention_geometry.h"
#include "ffi/common/attention_sink.h"
#include "metal/kernels/utils.h"

namespace jax_sgl {
namespace metal_kernels {

// Tile sizes are in params.h (the host dispatches with them).
JAX_SGL_METAL_CONST int kFrag = 8;  // simdgroup_matrix side

// Threadgroup memory of one attention threadgroup.
struct AttentionTiles {
  threadgroup float* q;       // [kBlockM, kMaxHeadDim] softmax-scaled queries
  threadgroup float* kv;      // [kBlockN, kMaxHeadDim] the K block, then the V block
  threadgroup float* o;       // [kBlockM, kMaxHeadDim] unnormalized output
  threadgroup float* s;       // [kBlockM, kBlockN] scores, then probabilities
  threadgroup float* diag;    // [kBlockM / 8][8, 8] diag(correction) fragments
  threadgroup float* m;       // [kBlockM] running max
  threadgroup float* l;       // [kBlockM] running sum
  threadgroup long* key_row;  // [kBlockN] k/v row of each key of the block, -1 masked
};

struct SeqGeometry {
  long q_row0;
  int q_len;
  long k_row0;  // dense / varlen
  int k_len;
};

inline SeqGeometry GetSeqGeometry(constant MetalAttentionParams& p, const device int* cu_seqlens_q,
                                  const device int* cu_seqlens_k, const device int* seqused_k,
                                  int b) {
  SeqGeometry g;
  if (p.varlen_q) {
    const RowRange r = ClampedRows(cu_seqlens_q[b], cu_seqlens_q[b + 1], p.total_q);
    g.q_row0 = r.begin;
    g.q_len = int(r.len);
  } else {
    g.q_row0 = long(b) * p.seqlen_q;
    g.q_len = p.seqlen_q;
  }
  long k_cap;
  if (p.kv_layout == 1) {
    const RowRange r = ClampedRows(cu_seqlens_k[b], cu_seqlens_k[b + 1], p.total_k);
    g.k_row0 = r.begin;
    k_cap = r.len;
  } else if (p.kv_layout == 2) {
    g.k_row0 = 0;
    k_cap = long(p.max_pages) * p.page_size;
  } else {
    g.k_row0 = long(b) * p.seqlen_k;
    k_cap = p.seqlen_k;
  }
  g.k_len = int(p.has_seqused_k ? ClampIndex(seqused_k[b], 0, k_cap) : k_cap);
  return g;
}

inline long KeyRowOf(constant MetalAttentionParams& p, const device int* page_table, int b,
                     SeqGeometry g, int j) {
  if (p.kv_layout != 2) return g.k_row0 + j;
  return PagedKeyRow(page_table[long(b) * p.max_pages + j / p.page_size], p.num_pages,
                     p.page_size, j);
}

// rows x width of x (row stride `stride`, column offset col0) into a zero-padded float tile;
// row r comes from row_of[r] (-1: zeros).
template <typename T>
inline void LoadKeyTile(threadgroup float* tile, const device T* x, threadgroup long* row_of,
                        long stride, long col0, int width, uint tid) {
  for (int idx = int(tid); idx < kAttnBlockN * kAttnMaxHeadDim; idx += kAttnThreads) {
    const int r = idx / kAttnMaxHeadDim, c = idx % kAttnMaxHeadDim;
    const long row = row_of[r];
    tile[idx] = row >= 0 && c < width ? LoadF(x[row * stride + col0 + c]) : 0.f;
  }
}

// Step 4 for row r: masks, softcaps and exponentiates the row of S in place, updates m and l,
// and writes the row's correction into its diag fragment.
inline void OnlineSoftmaxRow(AttentionTiles t, constant MetalAttentionParams& p, int r, bool live,
                             KeySpan span, int n0, int cols) {
  threadgroup float* s = t.s + r * kAttnBlockN;
  uint valid = 0;  // bit c: key n0 + c is visible and present
  float block_max = 0.f;
  if (live) {
    for (int c = 0; c < cols; ++c) {
      const int j = n0 + c;
      if (t.key_row[c] < 0 || j < span.lo || j >= span.hi) continue;
      float x = s[c];
      if (p.softcap > 0.f) x = p.softcap * metal::tanh(x / p.softcap);
      s[c] = x;
      block_max = valid ? metal::max(block_max, x) : x;
      valid |= 1u << c;
    }
  }
  float corr = 1.f;
  if (valid) {
    // l > 0 exactly when the row has seen a visible key, so m is defined: no arithmetic on -inf.
    const float m_old = t.m[r], l_old = t.l[r];
    const float m_new = l_old > 0.f ? metal::max(m_old, block_max) : block_max;
    corr = l_old > 0.f ? metal::exp(m_old - m_new) : 0.f;
    float sum = 0.f;
    for (int c = 0; c < kAttnBlockN; ++c) {
      const float e = (valid >> c) & 1u ? metal::exp(s[c] - m_new) : 0.f;
      s[c] = e;
      sum += e;
    }
    t.m[r] = m_new;
    t.l[r] = l_old * corr + sum;
  } else {
    for (int c = 0; c < kAttnBlockN; ++c) s[c] = 0.f;
  }
  threadgroup float* d = t.diag + (r / kFrag) * kFrag * kFrag + (r % kFrag) * kFrag;
  for (int c = 0; c < kFrag; ++c) d[c] = c == r % kFrag ? corr : 0.f;
}

template <typename T>
void attention_fwd_impl(const device T* q, const device T* k, const device T* v, device T* out,
                        device float* lse, const device int* cu_seqlens_q,
                        const device int* cu_seqlens_k, const device int* seqused_k,
                        const device int* page_table, const device float* sinks,
                        constant MetalAttentionParams& p, AttentionTiles t, uint3 group,
                        uint3 groups, uint tid, uint simdgroup) {
  const int h = int(group.x), b = int(group.z);
  const int kh = h / (p.num_heads / p.num_kv_heads);
  const int d = p.head_dim, dv = p.head_dim_v;
  const int d_pad = (d + kFrag - 1) / kFrag * kFrag, dv_pad = (dv + kFrag - 1) / kFrag * kFrag;
  const long q_stride = long(p.num_heads) * d, o_stride = long(p.num_heads) * dv;
  const SeqGeometry g = GetSeqGeometry(p, cu_seqlens_q, cu_seqlens_k, seqused_k, b);

  // Query blocks are grid-strided: a varlen sequence longer than the dispatch assumed is still
  // covered. The loop bounds are uniform over the threadgroup, so every barrier is reached by all.
  for (int m0 = int(group.y) * kAttnBlockM; m0 < g.q_len; m0 += int(groups.y) * kAttnBlockM) {
    const int rows = metal::min(kAttnBlockM, g.q_len - m0);
    for (int idx = int(tid); idx < kAttnBlockM * kAttnMaxHeadDim; idx += kAttnThreads) {
      const int r = idx / kAttnMaxHeadDim, c = idx % kAttnMaxHeadDim;
      t.q[idx] = r < rows && c < d
                     ? LoadF(q[(g.q_row0 + m0 + r) * q_stride + long(h) * d + c]) * p.softmax_scale
                     : 0.f;
      t.o[idx] = 0.f;
    }
    if (tid < uint(kAttnBlockM)) {
      t.m[tid] = 0.f;
      t.l[tid] = 0.f;
    }
    const int key_begin = VisibleKeys(m0, g.q_len, g.k_len, p.window_left, p.window_right).lo;
    const int key_end =
        VisibleKeys(m0 + rows - 1, g.q_len, g.k_len, p.window_left, p.window_right).hi;
    threadgroup_barrier(metal::mem_flags::mem_threadgroup);

    for (int n0 = key_begin; n0 < key_end; n0 += kAttnBlockN) {
      const int cols = metal::min(kAttnBlockN, key_end - n0);
      if (tid < uint(kAttnBlockN))
        t.key_row[tid] = int(tid) < cols ? KeyRowOf(p, page_table, b, g, n0 + int(tid)) : -1;
      threadgroup_barrier(metal::mem_flags::mem_threadgroup);
      LoadKeyTile(t.kv, k, t.key_row, p.k_row_stride, kh * p.k_head_stride, d, tid);
      threadgroup_barrier(metal::mem_flags::mem_threadgroup);

      // S = Q K^T: fragment (fm, fn) of S sums d_pad / 8 products.
      constexpr int s_frags_n = kAttnBlockN / kFrag;
      for (int f = int(simdgroup); f < (kAttnBlockM / kFrag) * s_frags_n; f += kAttnSimdgroups) {
        const int fm = f / s_frags_n, fn = f % s_frags_n;
        metal::simdgroup_float8x8 acc = metal::make_filled_simdgroup_matrix<float, 8, 8>(0.f);
        metal::simdgroup_float8x8 qa, kb;
        for (int kk = 0; kk < d_pad; kk += kFrag) {
          metal::simdgroup_load(qa, t.q + fm * kFrag * kAttnMaxHeadDim + kk, kAttnMaxHeadDim);
          metal::simdgroup_load(kb, t.kv + fn * kFrag * kAttnMaxHeadDim + kk, kAttnMaxHeadDim,
                                ulong2(0, 0), true);
          metal::simdgroup_multiply_accumulate(acc, qa, kb, acc);
        }
        metal::simdgroup_store(acc, t.s + fm * kFrag * kAttnBlockN + fn * kFrag, kAttnBlockN);
      }
      threadgroup_barrier(metal::mem_flags::mem_threadgroup);

      if (tid < uint(kAttnBlockM)) {
        const int r = int(tid);
        const KeySpan span =
            VisibleKeys(m0 + r, g.q_len, g.k_len, p.window_left, p.window_right);
        OnlineSoftmaxRow(t, p, r, r < rows, span, n0, cols);
      }
      LoadKeyTile(t.kv, v, t.key_row, p.v_row_stride, p.v_offset + kh * p.v_head_stride, dv,
                  tid);
      threadgroup_barrier(metal::mem_flags::mem_threadgroup);

      // O = diag(corr) O + P V, fragment (fm, fe) of O.
      const int o_frags_n = dv_pad / kFrag;
      for (int f = int(simdgroup); f < (kAttnBlockM / kFrag) * o_frags_n; f += kAttnSimdgroups) {
        const int fm = f / o_frags_n, fe = f % o_frags_n;
        threadgroup float* o_frag = t.o + fm * kFrag * kAttnMaxHeadDim + fe * kFrag;
        metal::simdgroup_float8x8 o, corr, pa, vb;
        metal::simdgroup_load(o, o_frag, kAttnMaxHeadDim);
        metal::simdgroup_load(corr, t.diag + fm * kFrag * kFrag, kFrag);
        metal::simdgroup_multiply(o, corr, o);
        for (int kk = 0; kk < kAttnBlockN; kk += kFrag) {
          metal::simdgroup_load(pa, t.s + fm * kFrag * kAttnBlockN + kk, kAttnBlockN);
          metal::simdgroup_load(vb, t.kv + kk * kAttnMaxHeadDim + fe * kFrag, kAttnMaxHeadDim);
          metal::simdgroup_multiply_accumulate(o, pa, vb, o);
        }
        metal::simdgroup_store(o, o_frag, kAttnMaxHeadDim);
      }
      threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    }

    // One thread per row: the lse (the sink included), and in place of l the row's output factor.
    if (tid < uint(rows)) {
      const int r = int(tid);
      const long col = p.varlen_q ? long(h) * p.total_q + g.q_row0 + m0 + r
                                  : (long(b) * p.num_heads + h) * p.seqlen_q + m0 + r;
      const float l = t.l[r];
      SinkedRow fin;
      fin.scale = 1.f;
      fin.lse = l > 0.f ? t.m[r] + metal::log(l) : -INFINITY;
      if (p.has_sinks) fin = ApplySink(fin.lse, sinks[h]);
      lse[col] = fin.lse;
      t.l[r] = l > 0.f ? fin.scale / l : 0.f;
    }
    threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    for (int idx = int(tid); idx < rows * dv; idx += kAttnThreads) {
      const int r = idx / dv, e = idx % dv;
      out[(g.q_row0 + m0 + r) * o_stride + long(h) * dv + e] =
          StoreF<T>(t.o[r * kAttnMaxHeadDim + e] * t.l[r]);
    }
    threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  }
}

// Varlen q: rows that no sequence covers (padding past cu_seqlens_q[batch]) get out = 0 and
// lse = -inf rather than stale memory, as on the CPU backend. One thread per row of q.
template <typename T>
void attention_clear_impl(device T* out, device float* lse, const device int* cu_seqlens_q,
                          constant MetalAttentionParams& p, long row) {
  if (!p.varlen_q || row >= p.total_q) return;
  for (int b = 0; b < p.batch; ++b) {
    const RowRange r = ClampedRows(cu_seqlens_q[b], cu_seqlens_q[b + 1], p.total_q);
    if (row >= r.begin && row < r.begin + r.len) return;
  }
  const long width = long(p.num_heads) * p.head_dim_v;
  for (long e = 0; e < width; ++e) out[row * width + e] = StoreF<T>(0.f);
  for (int h = 0; h < p.num_heads; ++h) lse[long(h) * p.total_q + row] = -INFINITY;
}

}  // namespace metal_kernels
}  // namespace jax_sgl
