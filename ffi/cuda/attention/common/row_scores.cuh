// The scores of a warp's m16 tile of packed rows in the mma.sync forward kernels (the portable
// prefill, the decode block kernel, the warp-sliced decode kernels): the keys each of a lane's two
// accumulator rows may see, the step from raw Q K^T accumulators to masked log2-domain scores and
// each row half's max, and the running max's update. One copy, so that every kernel masks and
// scales alike.
#pragma once

#include <cmath>

#include "ffi/common/attention_seq.h"
#include "ffi/cuda/attention/common/mma.cuh"

namespace jax_sgl::cuda::flash {

// The keys [lo, hi) of this lane's two accumulator rows (tile rows lane / 4 and lane / 4 + 8),
// and the score transform into the log2 domain (softcap: cap * tanh(s / cap), in log2 units).
struct RowScores {
  int row_lo[2], row_hi[2];
  bool softcap;
  float score_scale, cap_log2;

  // Tile row r is row_base + r of the caller's rows (empty at or past rows_end), packed row
  // m0 + row_base + r of the sequence: callers pass whichever offsets their row count is kept in.
  __device__ __forceinline__ RowScores(const AttentionParams& p, const SeqBounds& s, int group,
                                       int row_base, int rows_end, int m0, int lane) {
    InitRows(p, s, group, row_base, rows_end, m0, lane);
    InitScale(p);
  }

  // The constructor's two halves, for a derived struct that computes more in between (the
  // order of the address arithmetic is kept so that its kernels' code stays as it was).
  __device__ __forceinline__ RowScores() {}
  __device__ __forceinline__ void InitRows(const AttentionParams& p, const SeqBounds& s,
                                           int group, int row_base, int rows_end, int m0,
                                           int lane) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row_base + lane / 4 + 8 * h;
      row_lo[h] = row_hi[h] = 0;
      if (r < rows_end) KeyRange(p, s, (m0 + r) / group, &row_lo[h], &row_hi[h]);
    }
  }
  __device__ __forceinline__ void InitScale(const AttentionParams& p) {
    softcap = p.softcap > 0.f;
    score_scale = softcap ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e;
    cap_log2 = p.softcap * kLog2e;
  }

  // fp8 operands' descales of the CTA's (sequence, kv head) (q_descale * k_descale, or an fp8 KV
  // cache's k_descale): the raw scores are products of the stored values.
  __device__ __forceinline__ void ScaleBy(float descale) { score_scale *= descale; }

  // kNT n8 tiles of raw scores (keys key0 + t * 8 + ...) into the log2 domain, -inf where the
  // row does not see the key or visible(c) (c: the key's column in the tile) is false, and each
  // row half's max into blk_max.
  template <int kNT, typename Visible>
  __device__ __forceinline__ void MaskAndMax(float (&sc)[kNT][4], int key0, int lane,
                                             Visible visible, float (&blk_max)[2]) const {
    blk_max[0] = blk_max[1] = -INFINITY;
#pragma unroll
    for (int t = 0; t < kNT; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e / 2;
        const int c = t * 8 + (lane % 4) * 2 + (e % 2);
        const int j = key0 + c;
        float x = sc[t][e] * score_scale;
        if (softcap) x = cap_log2 * tanhf(x);
        const bool ok = j >= row_lo[h] && j < row_hi[h] && visible(c);
        x = ok ? x : -INFINITY;
        sc[t][e] = x;
        blk_max[h] = fmaxf(blk_max[h], x);
      }
    }
  }
};

// The online-softmax max of this lane's two rows grows by a step's row-half maxima (blk_max,
// reduced over the quad here); m_use: the max to subtract from the step's scores, corr: the
// factor for what was accumulated under the old max.
__device__ __forceinline__ void UpdateRowMax(float (&m_run)[2], const float (&blk_max)[2],
                                             float (&m_use)[2], float (&corr)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m_new = fmaxf(m_run[h], QuadMax(blk_max[h]));
    // A row with no visible key yet keeps m = -inf; subtract 0 then so exp2 gives 0, not NaN.
    m_use[h] = m_new == -INFINITY ? 0.f : m_new;
    corr[h] = exp2f(m_run[h] - m_use[h]);
    m_run[h] = m_new;
  }
}

// The O accumulator (kDT n8 tiles of this lane's two rows) rescaled by the rows' corr factors
// (UpdateRowMax): what was accumulated under the old max.
template <int kDT>
__device__ __forceinline__ void ScaleAccRows(float (&o)[kDT][4], const float (&corr)[2]) {
#pragma unroll
  for (int t = 0; t < kDT; ++t) {
    o[t][0] *= corr[0];
    o[t][1] *= corr[0];
    o[t][2] *= corr[1];
    o[t][3] *= corr[1];
  }
}

}  // namespace jax_sgl::cuda::flash
