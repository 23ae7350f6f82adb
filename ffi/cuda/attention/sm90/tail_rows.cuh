// The thread layout of the tail split's merge kernels (forward: tail_combine.cuh, backward:
// bwd_tail_sum.cuh): one tile row per warp, kTailWarps warps per CTA, grid (tail tiles,
// rows / kTailWarps); lane l holds columns l, l + 32, ... (consecutive lanes, consecutive floats).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace jax_sgl::cuda::sm90 {

inline constexpr int kTailWarps = 4;

// This thread's row of tail unit `first + blockIdx.x`, where units number the row blocks of a
// dense [batch, seqlen, heads, head_dim] tensor in grid order (blocks fastest, then heads, then
// batch), as the main kernels number their forward tiles and backward key blocks.
struct TailRow {
  int lane;
  int r;    // row within the unit (its block)
  int row;  // row within the sequence
  int head, batch;

  // Element `lane` of this row in the dense tensor.
  __device__ __forceinline__ int64_t Dense(int seqlen, int heads, int head_dim) const {
    return ((int64_t(batch) * seqlen + row) * heads + head) * head_dim + lane;
  }
};

template <int kBlockRows>
__device__ __forceinline__ TailRow ThisTailRow(int first, int blocks, int heads) {
  const int r = int(blockIdx.y * kTailWarps + threadIdx.x / 32);
  const int unit = first + int(blockIdx.x), rest = unit / blocks;
  return {int(threadIdx.x % 32), r, unit % blocks * kBlockRows + r, rest % heads, rest / heads};
}

}  // namespace jax_sgl::cuda::sm90
