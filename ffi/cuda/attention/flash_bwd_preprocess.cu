// Preprocess step of the CUDA attention backward, one warp per (q row, head):
//   softmax_d = rowsum(dO * O) - dlse      (dS = P (dP - D) then covers a loss on lse too)
//   lse_log2  = lse * log2(e), +inf where lse = -inf (a fully masked row: P = exp2(x - inf) = 0)
// Both in lse's layout (dense: rows padded to args.ws_rows). Varlen rows that no sequence covers
// get values nothing reads.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "ffi/common/numeric.h"
#include "ffi/cuda/attention/flash_bwd_launch.h"

namespace jax_sgl::cuda {
namespace {

constexpr int kThreads = 256;  // 8 (row, head) pairs per block

template <typename T>
__device__ __forceinline__ float Dot8(const uint4& a, const uint4& b) {
  const T* x = reinterpret_cast<const T*>(&a);
  const T* y = reinterpret_cast<const T*>(&b);
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) s += ToFloat(x[e]) * ToFloat(y[e]);
  return s;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) FlashBwdPreprocessKernel(const FlashBwdArgs args) {
  const AttentionBwdParams& bp = args.bp;
  const AttentionParams& p = bp.fwd;
  const int64_t pair = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (pair >= p.total_q * p.num_heads) return;
  const int64_t row = pair / p.num_heads;
  const int h = int(pair % p.num_heads);
  const int dv = p.head_dim_v;
  const T* o = static_cast<const T*>(p.out) + pair * dv;
  const T* g = static_cast<const T*>(bp.dout) + pair * dv;
  float acc = 0.f;
  for (int c = lane * 8; c < dv; c += 32 * 8)
    acc += Dot8<T>(*reinterpret_cast<const uint4*>(o + c), *reinterpret_cast<const uint4*>(g + c));
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane != 0) return;
  // lse index: varlen [H, total_q]; dense [B, H, Sq] with row = b * Sq + i. The workspace is
  // the same but for dense rows padded to ws_rows per (b, h).
  int64_t idx, ws;
  if (p.cu_seqlens_q) {
    idx = ws = int64_t(h) * p.total_q + row;
  } else {
    const int64_t b = row / p.seqlen_q, i = row % p.seqlen_q;
    idx = (b * p.num_heads + h) * p.seqlen_q + i;
    ws = (b * p.num_heads + h) * args.ws_rows + i;
  }
  bp.softmax_d[ws] = acc - bp.dlse[idx];
  const float lse = p.lse[idx];
  args.lse_log2[ws] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
}

}  // namespace

cudaError_t LaunchFlashBwdPreprocess(const FlashBwdArgs& args, cudaStream_t stream) {
  const AttentionParams& p = args.bp.fwd;
  const int64_t pairs = p.total_q * p.num_heads;
  if (pairs == 0) return cudaSuccess;
  const int64_t blocks = (pairs * 32 + kThreads - 1) / kThreads;
  if (p.q_type == DType::kBF16)
    FlashBwdPreprocessKernel<bf16_t><<<unsigned(blocks), kThreads, 0, stream>>>(args);
  else
    FlashBwdPreprocessKernel<f16_t><<<unsigned(blocks), kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace jax_sgl::cuda
