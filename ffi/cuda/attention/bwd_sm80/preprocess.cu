// Preprocess step of the CUDA attention backward:
//   softmax_d = rowsum(dO * O) - dlse      (dS = P (dP - D) then covers a loss on lse too)
//   lse_log2  = lse * log2(e), +inf where lse = -inf (a fully masked row: P = exp2(x - inf) = 0)
// or, with args.negated (the sm100 backward's convention), -softmax_d and -lse_log2.
// Both in lse's layout (dense: rows padded to args.ws_rows), or with args.ws_seq_align (varlen q
// on the sm90 backward) in its per-sequence padded one (PaddedWsRow: kSeqPadded, an
// instantiation of its own so the others keep their code). Varlen rows that no sequence covers
// get values nothing reads (kSeqPadded: none).
//
// One CTA per (kRows consecutive rows, head, batch; varlen: one "batch" of total_q rows), so that
// lse, dlse and both outputs are read and written contiguously. Each half-warp takes kRows / 16
// rows and issues all their 16-byte loads of O and dO before reducing any: a warp per row with one
// load pair in flight (the first form) ran at 1.9 TB/s on the H200 (ncu, 2026-12-03).

#include <cstdint>

#include "ffi/common/numeric.h"
#include "ffi/cuda/attention/flash_bwd_launch.h"
#include "ffi/cuda/attention/common/unpack.cuh"

namespace jax_sgl::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRows = 64;                            // rows per CTA
constexpr int kRowsPerHalfWarp = kRows / (kThreads / 16);
constexpr int kMaxChunks = 2;                        // 16 lanes x 8 elements x 2: head_dim_v <= 256

template <typename T>
__device__ __forceinline__ float Dot8(const uint4& a, const uint4& b) {
  float x[8], y[8];
  Unpack8<T>(a, x);
  Unpack8<T>(b, y);
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) s = fmaf(x[e], y[e], s);
  return s;
}

template <typename T, bool kSeqPadded>
__global__ void __launch_bounds__(kThreads) FlashBwdPreprocessKernel(const FlashBwdArgs args) {
  const AttentionBwdParams& bp = args.bp;
  const AttentionParams& p = bp.fwd;
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int64_t rows = varlen ? p.total_q : p.seqlen_q;  // of this (batch, head)
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t i0 = int64_t(blockIdx.x) * kRows;
  const int dv = p.head_dim_v;
  const int half = threadIdx.x / 16, sub = threadIdx.x % 16;

  const T* out = static_cast<const T*>(p.out);
  const T* dout = static_cast<const T*>(bp.dout);
  uint4 o[kRowsPerHalfWarp][kMaxChunks], g[kRowsPerHalfWarp][kMaxChunks];
#pragma unroll
  for (int r = 0; r < kRowsPerHalfWarp; ++r) {
    const int64_t i = i0 + half + 16 * r;  // 16 half-warps read 16 consecutive rows per step
    const int64_t at = ((int64_t(b) * rows + i) * p.num_heads + h) * dv;
#pragma unroll
    for (int k = 0; k < kMaxChunks; ++k) {
      const int c = (sub + 16 * k) * 8;
      const bool live = i < rows && c < dv;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      o[r][k] = live ? __ldg(reinterpret_cast<const uint4*>(out + at + c)) : zero;
      g[r][k] = live ? __ldg(reinterpret_cast<const uint4*>(dout + at + c)) : zero;
    }
  }
  __shared__ float dot[kRows];
#pragma unroll
  for (int r = 0; r < kRowsPerHalfWarp; ++r) {
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < kMaxChunks; ++k) acc += Dot8<T>(o[r][k], g[r][k]);
#pragma unroll
    for (int off = 8; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (sub == 0) dot[half + 16 * r] = acc;
  }
  __syncthreads();
  const int64_t i = i0 + threadIdx.x;
  if (threadIdx.x >= kRows || i >= rows) return;
  // lse: varlen [H, total_q]; dense [B, H, Sq]. The workspace is the same but for dense rows
  // padded to ws_rows per (b, h).
  const int64_t bh = int64_t(b) * p.num_heads + h;
  const int64_t idx = bh * rows + i;
  int64_t ws = bh * (varlen ? rows : args.ws_rows) + i;
  if constexpr (kSeqPadded) {
    const int64_t w = PaddedWsRow(p.cu_seqlens_q, p.batch, p.total_q, i, args.ws_seq_align);
    if (w < 0) return;
    ws = int64_t(h) * args.ws_rows + w;
  }
  const float d = dot[threadIdx.x] - bp.dlse[idx];
  const float lse = p.lse[idx];
  const float lse_log2 = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
  bp.softmax_d[ws] = args.negated ? -d : d;
  args.lse_log2[ws] = args.negated ? -lse_log2 : lse_log2;
}

}  // namespace

cudaError_t LaunchFlashBwdPreprocess(const FlashBwdArgs& args, cudaStream_t stream) {
  const AttentionParams& p = args.bp.fwd;
  if (p.head_dim_v > 16 * 8 * kMaxChunks) return cudaErrorInvalidValue;
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int64_t rows = varlen ? p.total_q : p.seqlen_q;
  const int batch = varlen ? 1 : p.batch;
  if (rows == 0 || batch == 0 || p.num_heads == 0) return cudaSuccess;
  const dim3 grid(unsigned((rows + kRows - 1) / kRows), unsigned(p.num_heads), unsigned(batch));
  if (grid.y > 65535 || grid.z > 65535) return cudaErrorInvalidConfiguration;
  const bool padded = varlen && args.ws_seq_align > 0;
  if (p.q_type == DType::kBF16)
    (padded ? FlashBwdPreprocessKernel<bf16_t, true> : FlashBwdPreprocessKernel<bf16_t, false>)
        <<<grid, kThreads, 0, stream>>>(args);
  else
    (padded ? FlashBwdPreprocessKernel<f16_t, true> : FlashBwdPreprocessKernel<f16_t, false>)
        <<<grid, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace jax_sgl::cuda
