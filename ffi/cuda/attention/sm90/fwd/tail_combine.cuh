// The second half of the sm90 forward's tail split (kernel.cuh, launch.cuh): each tile of the
// last, partial wave ran as `splits` items over shares of its key tiles, each leaving O (float32,
// normalized by its own sum) and its LSE. This merges them into the tile's output rows:
//   lse = log sum_s e^{lse_s},   O = sum_s e^{lse_s - lse} O_s,
// where a share without keys has lse_s = -inf and adds nothing (a row with none at all gets
// O = 0 and LSE -inf, as the main kernel writes it). Attention sinks join the merged row here,
// once (attention_sink.h); the shares carry none.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "ffi/common/attention_sink.h"
#include "ffi/cuda/attention/sm90/tail_rows.cuh"

namespace jax_sgl::cuda::sm90 {

template <typename Element>
struct TailCombineParams {
  const float* tail_o;    // [tail tile, split, block_m, head_dim]
  const float* tail_lse;  // [tail tile, split, block_m]
  Element* out;           // dense O [batch, seqlen_q, num_heads, head_dim]
  float* lse;             // [batch, num_heads, seqlen_q] or nullptr
  int first_tile;         // tile index of tail tile 0 (kernel.cuh DecodeTile order, non-causal)
  int splits;
  int num_m_blocks;
  int num_heads;
  int seqlen_q;
  const float* sinks;     // [num_heads] or nullptr
};

// Threads as tail_rows.cuh lays them out (a query row per warp).
template <typename Element, int kHeadDim, int kBlockM>
__global__ void __launch_bounds__(32 * kTailWarps)
    FlashFwdSm90TailCombine(const TailCombineParams<Element> p) {
  static_assert(kHeadDim % 32 == 0 && kBlockM % kTailWarps == 0);
  constexpr int kPerLane = kHeadDim / 32;
  const TailRow t = ThisTailRow<kBlockM>(p.first_tile, p.num_m_blocks, p.num_heads);
  const int r = t.r, lane = t.lane;
  if (t.row >= p.seqlen_q) return;

  const int64_t slot0 = int64_t(blockIdx.x) * p.splits;  // split 0 of this tile
  float lse_max = -INFINITY;
  for (int s = 0; s < p.splits; ++s)
    lse_max = fmaxf(lse_max, p.tail_lse[(slot0 + s) * kBlockM + r]);
  float acc[kPerLane] = {};
  float sum = 0.f;
  if (lse_max > -INFINITY) {
    for (int s = 0; s < p.splits; ++s) {
      const float l = p.tail_lse[(slot0 + s) * kBlockM + r];
      const float w = l > -INFINITY ? __expf(l - lse_max) : 0.f;
      sum += w;
      // Lane-interleaved columns: consecutive lanes read consecutive floats.
      const float* o = p.tail_o + ((slot0 + s) * kBlockM + r) * kHeadDim + lane;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) acc[e] = fmaf(w, o[32 * e], acc[e]);
    }
  }
  const SinkedRow fin =
      ApplySinkOf(p.sinks, t.head, sum > 0.f ? lse_max + logf(sum) : -INFINITY);
  const float inv = sum > 0.f ? fin.scale / sum : 0.f;
  Element* dst = p.out + t.Dense(p.seqlen_q, p.num_heads, kHeadDim);
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) dst[32 * e] = Element(acc[e] * inv);
  if (p.lse != nullptr && lane == 0)
    p.lse[(int64_t(t.batch) * p.num_heads + t.head) * p.seqlen_q + t.row] = fin.lse;
}

}  // namespace jax_sgl::cuda::sm90
