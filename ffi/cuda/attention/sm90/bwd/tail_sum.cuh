// The second half of the sm90 backward's tail split (bwd_kernel.cuh, bwd_launch.cuh): each key
// block of the last, partial wave ran on `splits` CTAs, each over a share of the block's steps
// (q head x row block), leaving float32 dK (already scaled) and dV for the block's keys. The
// gradients are sums over the steps, so this adds the shares and stores dK and dV.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "ffi/cuda/attention/sm90/tail_rows.cuh"

namespace jax_sgl::cuda::sm90 {

template <typename Element>
struct BwdTailSumParams {
  const float* tail_dk;  // [tail block, split, block_n, head_dim]
  const float* tail_dv;
  Element* dk;           // dense [batch, seqlen_k, num_kv_heads, head_dim]
  Element* dv;
  int first_block;       // CTA block index of tail block 0 (key blocks fastest)
  int splits;
  int n_blocks;          // key blocks per (kv head, batch)
  int num_kv_heads;
  int seqlen_k;
};

// Threads as tail_rows.cuh lays them out (a key row per warp).
template <typename Element, int kHeadDim, int kBlockN>
__global__ void __launch_bounds__(32 * kTailWarps)
    FlashBwdSm90TailSum(const BwdTailSumParams<Element> p) {
  static_assert(kHeadDim % 32 == 0 && kBlockN % kTailWarps == 0);
  constexpr int kPerLane = kHeadDim / 32;
  const TailRow t = ThisTailRow<kBlockN>(p.first_block, p.n_blocks, p.num_kv_heads);
  if (t.row >= p.seqlen_k) return;  // t.row: the key

  float dk[kPerLane] = {}, dv[kPerLane] = {};
  for (int s = 0; s < p.splits; ++s) {
    // Lane-interleaved columns: consecutive lanes read consecutive floats.
    const int64_t row = ((int64_t(blockIdx.x) * p.splits + s) * kBlockN + t.r) * kHeadDim + t.lane;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      dk[e] += p.tail_dk[row + 32 * e];
      dv[e] += p.tail_dv[row + 32 * e];
    }
  }
  const int64_t out = t.Dense(p.seqlen_k, p.num_kv_heads, kHeadDim);
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    p.dk[out + 32 * e] = Element(dk[e]);
    p.dv[out + 32 * e] = Element(dv[e]);
  }
}

}  // namespace jax_sgl::cuda::sm90
