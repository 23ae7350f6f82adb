// Attention sinks for the sm100 forward (ffi/common/attention_sink.h): the collectives finish each
// row's LSE and output inside their correction warpgroup, which has no hook, so a second pass folds
// the sink into the finished rows: lse' = logaddexp(lse, sink), O *= exp(lse - lse'). One warp per
// (q row, q head): the lanes read the old LSE, scale the row's features, then lane 0 writes lse'.
// Packed rows past the last sequence (cleared to 0 / -inf before the forward) are left alone.
#pragma once

#include <cuda_runtime.h>

#include "ffi/common/attention_params.h"
#include "ffi/common/attention_sink.h"

namespace jax_sgl::cuda::sm100 {

inline constexpr int kSinkWarpsPerBlock = 8;

template <typename E>
__global__ void __launch_bounds__(kSinkWarpsPerBlock * 32)
ApplySinksKernel(AttentionParams p) {
  const int64_t pair = int64_t(blockIdx.x) * kSinkWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (pair >= p.total_q * p.num_heads) return;
  const int64_t row = pair / p.num_heads;
  const int head = int(pair % p.num_heads);
  int64_t lse_at;
  if (p.cu_seqlens_q != nullptr) {
    if (row >= p.cu_seqlens_q[p.batch]) return;
    lse_at = int64_t(head) * p.total_q + row;
  } else {
    const int64_t b = row / p.seqlen_q;
    lse_at = (b * p.num_heads + head) * p.seqlen_q + row % p.seqlen_q;
  }
  const SinkedRow r = ApplySink(p.lse[lse_at], p.sinks[head]);
  E* o = static_cast<E*>(p.out) + (row * p.num_heads + head) * p.head_dim_v;
  for (int e = lane; e < p.head_dim_v; e += 32) o[e] = E(float(o[e]) * r.scale);
  __syncwarp();
  if (lane == 0) p.lse[lse_at] = r.lse;
}

template <typename E>
cudaError_t LaunchApplySinks(const AttentionParams& p, cudaStream_t stream) {
  const int64_t pairs = p.total_q * p.num_heads;
  const int64_t blocks = (pairs + kSinkWarpsPerBlock - 1) / kSinkWarpsPerBlock;
  ApplySinksKernel<E><<<unsigned(blocks), kSinkWarpsPerBlock * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_sgl::cuda::sm100
