// The thread layout of the tail split's merge kernels (forward: tail_combine.cuh, backward:
// bwd_tail_sum.cuh): one tile row per warp, kTailWarps warps per CTA, grid (tail tiles,
// rows / kTailWarps); lane l holds columns l, l + 32, ... (consecutive lanes, consecutive floats).
#pragma once

#include <cuda_runtime.h>

namespace jax_sgl::cuda::sm90 {

inline constexpr int kTailWarps = 4;

struct TailThread {
  int lane;
  int row;  // within the tile
};

__device__ __forceinline__ TailThread ThisTailThread() {
  return {int(threadIdx.x % 32), int(blockIdx.y * kTailWarps + threadIdx.x / 32)};
}

}  // namespace jax_sgl::cuda::sm90
