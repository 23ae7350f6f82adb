// Online softmax over the wgmma accumulator of one warpgroup (64 rows x N columns).
//
// A thread of the warpgroup holds, of a 64 x N fp32 accumulator, 2 rows (r = 0, 1) and N/4
// columns, at flat index i = c + 2 r + 4 g (c, r in {0, 1}; g < N/8):
//   row = 16 * warp + lane / 4 + 8 r,  column = 8 g + 2 (lane % 4) + c.
// The four threads of a quad (lanes 4q .. 4q+3) share the rows, so row reductions need two
// shuffles. Scores are kept unscaled; the softmax scale is folded into the exp2 argument.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

namespace jax_sgl::cuda::sm90 {

// Where the accumulator element i of this thread sits in the warpgroup's 64 x N tile.
struct AccCoord {
  int row0;  // row of r = 0 (r = 1 adds 8)
  int col0;  // column of g = 0, c = 0
  __device__ explicit AccCoord(int thread_in_warpgroup)
      : row0(16 * (thread_in_warpgroup / 32) + (thread_in_warpgroup % 32) / 4),
        col0(2 * (thread_in_warpgroup % 4)) {}
  __device__ static constexpr int Row(int i) { return 8 * ((i / 2) % 2); }
  __device__ static constexpr int Col(int i) { return 8 * (i / 4) + i % 2; }
};

__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// 2^x in one MUFU.EX2, subnormal results flushed to zero. exp2f() compiles to ex2.approx.f32,
// which ptxas wraps in a range check and two predicated multiplies per element.
__device__ __forceinline__ float Exp2Ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

struct OnlineSoftmax {
  float row_max[2];
  float row_sum[2];  // partial: this thread's columns only until Finish()
  float scale_log2;  // softmax_scale * log2(e)

  __device__ explicit OnlineSoftmax(float softmax_scale)
      : row_max{-INFINITY, -INFINITY}, row_sum{0.f, 0.f},
        scale_log2(softmax_scale * float(M_LOG2E)) {}

  // Turns scores S into probabilities P in place (unnormalized: exp2 relative to the running max)
  // and returns in correction[r] the factor the output rows accumulated so far must take.
  // No branch anywhere (the correction of a row without keys yet is 0 instead of 1: its sum and
  // output are 0 either way) and Exp2Ftz. A branch in the softmax makes ptxas wait for the
  // in-flight P V wgmma before it (SASS: WARPGROUP.DEPBAR.LE gsb0, 0x0 ahead of the whole
  // softmax), which undoes the overlap of the softmax with this warpgroup's P V.
  // kChains: independent max chains per row (tile_size.h FwdTileSize::max_chains).
  template <int kChains, typename Tensor>
  __device__ void Step(Tensor& s, float (&correction)[2]) {
    constexpr int kSize = decltype(cute::size(s))::value;
    float tile_max[2];
    RowMax<kChains>(s, tile_max);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float new_max = fmaxf(row_max[r], QuadMax(tile_max[r]));
      // A row with no unmasked key yet keeps max -inf: use 0 as its offset so exp2 gives 0, not
      // NaN, and leave its (zero) sums alone.
      correction[r] = Exp2Ftz((row_max[r] - (new_max == -INFINITY ? 0.f : new_max)) * scale_log2);
      row_max[r] = new_max;
      row_sum[r] *= correction[r];
    }
    const float offset[2] = {row_max[0] == -INFINITY ? 0.f : row_max[0] * scale_log2,
                             row_max[1] == -INFINITY ? 0.f : row_max[1] * scale_log2};
#pragma unroll
    for (int i = 0; i < kSize; ++i) {
      const int r = (i / 2) % 2;
      s(i) = Exp2Ftz(fmaf(s(i), scale_log2, -offset[r]));
      row_sum[r] += s(i);
    }
  }

  // This thread's maximum of each row's scores. Four chains split a row by column parity c and
  // group parity g % 2, each starting from its first score (no extra instruction against one).
  template <int kChains, typename Tensor>
  __device__ static void RowMax(Tensor const& s, float (&tile_max)[2]) {
    constexpr int kSize = decltype(cute::size(s))::value;
    static_assert(kChains == 1 || (kChains == 4 && kSize % 8 == 0), "one or four chains");
    if constexpr (kChains == 1) {
      tile_max[0] = tile_max[1] = -INFINITY;
#pragma unroll
      for (int i = 0; i < kSize; ++i) {
        const int r = (i / 2) % 2;
        tile_max[r] = fmaxf(tile_max[r], s(i));
      }
    } else {
      float chain[2][4];
#pragma unroll
      for (int i = 0; i < 8; ++i) chain[(i / 2) % 2][i % 2 + 2 * (i / 4)] = s(i);
#pragma unroll
      for (int i = 8; i < kSize; ++i) {
        const int r = (i / 2) % 2, k = i % 2 + 2 * ((i / 4) % 2);
        chain[r][k] = fmaxf(chain[r][k], s(i));
      }
#pragma unroll
      for (int r = 0; r < 2; ++r)
        tile_max[r] = fmaxf(fmaxf(chain[r][0], chain[r][1]), fmaxf(chain[r][2], chain[r][3]));
    }
  }

  // Completes the row sums; returns per row the factor that normalizes the output (0 for a row
  // that saw no key) and writes its natural-log LSE (-inf for such rows).
  __device__ void Finish(float softmax_scale, float (&inv_sum)[2], float (&lse)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = QuadSum(row_sum[r]);
      const bool empty = sum == 0.f || sum != sum;
      inv_sum[r] = empty ? 0.f : 1.f / sum;
      lse[r] = empty ? -INFINITY : row_max[r] * softmax_scale + logf(sum);
    }
  }
};

// Multiplies the rows of an accumulator (same thread layout as above) by per-row factors.
template <typename Tensor>
__device__ __forceinline__ void ScaleRows(Tensor& acc, const float (&factor)[2]) {
  constexpr int kSize = decltype(cute::size(acc))::value;
#pragma unroll
  for (int i = 0; i < kSize; ++i) acc(i) *= factor[(i / 2) % 2];
}

}  // namespace jax_sgl::cuda::sm90
