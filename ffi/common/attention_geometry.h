// The index math of attention geometry as pointer-free scalar functions: how a cu_seqlens pair
// becomes a clamped row range, how a seqused_k entry is clamped, which keys query row i may see
// (bottom-right causal / window), and where key j of a paged sequence lives.
//
// Why a separate header: attention_seq.h works on AttentionParams, which holds host pointers and
// includes <cstdint>; Metal Shading Language has neither unqualified pointers nor the C++ standard
// headers. This header is plain C++14 with no includes under Metal, so the CPU, CUDA and Metal
// kernels (and the Metal emulator) all run exactly this code.
#pragma once

#if defined(__METAL_VERSION__)
#define JAX_SGL_GEOM inline
namespace jax_sgl {
typedef long geom_i64;  // MSL's long is 64-bit
}
#else
#include <cstdint>

#include "ffi/common/host_device.h"
#define JAX_SGL_GEOM JAX_SGL_HD
namespace jax_sgl {
typedef int64_t geom_i64;
}
#endif

namespace jax_sgl {

JAX_SGL_GEOM geom_i64 ClampIndex(geom_i64 x, geom_i64 lo, geom_i64 hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// Rows [begin, begin + len) of a packed tensor of `total` rows named by cu_seqlens[b], [b + 1]:
// clamped so that a bad cu_seqlens never leaves the buffer (a reversed pair is empty).
struct RowRange {
  geom_i64 begin;
  geom_i64 len;
};
JAX_SGL_GEOM RowRange ClampedRows(geom_i64 begin, geom_i64 end, geom_i64 total) {
  RowRange r;
  r.begin = ClampIndex(begin, 0, total);
  r.len = ClampIndex(end, r.begin, total) - r.begin;
  return r;
}

// Keys [lo, hi) visible to query row i of a sequence with q_len queries and k_len keys. Causal
// and windows align the last query with the last key (bottom-right), as FlashAttention does, so
// decode and chunked prefill see their prefix; window < 0 is unbounded (causal = window_right 0).
// Both ends are non-decreasing in i, so a block of rows sees keys [lo(first), hi(last)).
struct KeySpan {
  int lo;
  int hi;
};
JAX_SGL_GEOM KeySpan VisibleKeys(int i, int q_len, int k_len, int window_left, int window_right) {
  const geom_i64 diag = geom_i64(i) + k_len - q_len;
  geom_i64 l = 0, h = k_len;
  if (window_left >= 0) l = diag - window_left;
  if (window_right >= 0) h = diag + window_right + 1;
  l = ClampIndex(l, 0, k_len);
  h = ClampIndex(h, l, k_len);
  KeySpan s;
  s.lo = int(l);
  s.hi = int(h);
  return s;
}

// Row of a [num_pages * page_size] pool holding key j when the page table names `page` for it;
// -1 (a masked key) when the entry is outside [0, num_pages).
JAX_SGL_GEOM geom_i64 PagedKeyRow(int page, int num_pages, int page_size, int j) {
  if (page < 0 || page >= num_pages) return -1;
  return geom_i64(page) * page_size + j % page_size;
}

}  // namespace jax_sgl
