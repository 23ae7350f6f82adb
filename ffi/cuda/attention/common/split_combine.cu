// The two small kernels around the flash forward:
//  - SplitCombineKernel merges the split-KV partials (float32 out normalized per split + natural-log
//    lse per split) into out and lse: out = sum_s exp(lse_s - lse) * o_s, lse = log sum_s exp(lse_s);
//    with attention sinks, lse also takes the sink's logit (attention_sink.h), once per row.
//    One warp per (packed row); each lane holds one split's lse, so kMaxSplits <= 32, and 8 of
//    d_v's features (d_v <= 256).
//  - ClearUncoveredRowsKernel defines the rows of a varlen q that no sequence covers (padding past
//    cu_seqlens_q[batch]) as out 0 / lse -inf, as the CPU kernel does, instead of leaving them unset.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "ffi/common/attention_seq.h"
#include "ffi/common/attention_sink.h"
#include "ffi/cuda/attention/flash_fwd_launch.h"

namespace jax_sgl::cuda {
namespace {

constexpr int kCombineWarps = 4;

template <typename T>
__device__ __forceinline__ T StoreOf(float x);
template <>
__device__ __forceinline__ bf16_t StoreOf<bf16_t>(float x) {
  __nv_bfloat16 h = __float2bfloat16_rn(x);
  return *reinterpret_cast<bf16_t*>(&h);
}
template <>
__device__ __forceinline__ f16_t StoreOf<f16_t>(float x) {
  __half h = __float2half_rn(x);
  return *reinterpret_cast<f16_t*>(&h);
}

// grid: x = packed-row blocks of kCombineWarps rows, y = batch * num_kv_heads.
template <typename T>
__global__ void __launch_bounds__(32 * kCombineWarps) SplitCombineKernel(const SplitCombineArgs a) {
  const AttentionParams& p = a.p;
  const int b = blockIdx.y / p.num_kv_heads, kv_head = blockIdx.y % p.num_kv_heads;
  const SeqBounds s = GetSeqBounds(p, b);
  const int r = blockIdx.x * kCombineWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (r >= s.q_len * a.group) return;
  const int i = r / a.group, head = kv_head * a.group + r % a.group;
  const int64_t row_head = (s.q_row0 + i) * p.num_heads + head;
  const int64_t split_stride = p.total_q * p.num_heads;

  const float mine = lane < a.num_splits ? a.lse_partial[lane * split_stride + row_head] : -INFINITY;
  float m = mine;
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float sum = m == -INFINITY ? 0.f : __expf(mine - m);
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  // The merged row's lse, its sink included; the split weights exp(lse_s - lse) then scale the
  // output by exp(lse_without_sink - lse) as well.
  const float lse = ApplySinkOf(p.sinks, head, sum > 0.f ? m + logf(sum) : -INFINITY).lse;
  const float w = sum > 0.f ? __expf(mine - lse) : 0.f;  // this lane's split weight

  // The partials of kBatch splits are loaded before any is used, so their latencies overlap (a
  // plain loop over splits waits for each load in turn: ~1 us per split on an H200). Each lane
  // owns features [4 lane, +4) and [4 lane + 128, +4) (d_v <= 256); the shuffles of the split
  // weights run on all 32 lanes, outside the per-feature branches.
  constexpr int kBatch = 8;
  constexpr int kPerLane = 2;
  const int dv = p.head_dim_v;
  float4 acc[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = 0; s0 < a.num_splits; s0 += kBatch) {
    float ws[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) ws[u] = __shfl_sync(0xffffffffu, w, (s0 + u) % 32);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int c = lane * 4 + 128 * k;
      if (c >= dv) continue;
      float4 x[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int sp = s0 + u;
        // Splits past num_splits have weight 0 (their lane's lse is -inf); an empty split's
        // partial may be all zeros: skip the read of both.
        x[u] = sp < a.num_splits && ws[u] != 0.f
                   ? *reinterpret_cast<const float4*>(a.o_partial +
                                                      (sp * split_stride + row_head) * dv + c)
                   : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        acc[k].x += ws[u] * x[u].x;
        acc[k].y += ws[u] * x[u].y;
        acc[k].z += ws[u] * x[u].z;
        acc[k].w += ws[u] * x[u].w;
      }
    }
  }
  T* out = static_cast<T*>(p.out) + row_head * dv;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int c = lane * 4 + 128 * k;
    if (c >= dv) continue;
    out[c] = StoreOf<T>(acc[k].x);
    out[c + 1] = StoreOf<T>(acc[k].y);
    out[c + 2] = StoreOf<T>(acc[k].z);
    out[c + 3] = StoreOf<T>(acc[k].w);
  }
  if (lane == 0) {
    const int64_t idx = p.cu_seqlens_q ? int64_t(head) * p.total_q + s.lse_row0 + i
                                       : (int64_t(b) * p.num_heads + head) * p.seqlen_q + i;
    p.lse[idx] = lse;
  }
}

// One warp per row of q: covered when some sequence's clamped [begin, end) holds it.
template <typename T>
__global__ void ClearUncoveredRowsKernel(const AttentionParams p) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.total_q) return;
  bool covered = false;
  for (int b = lane; b < p.batch && !covered; b += 32) {
    const SeqBounds s = GetSeqBounds(p, b);
    covered = row >= s.q_row0 && row < s.q_row0 + s.q_len;
  }
  if (__any_sync(0xffffffffu, covered)) return;
  T* out = static_cast<T*>(p.out) + row * p.num_heads * p.head_dim_v;
  for (int e = lane; e < p.num_heads * p.head_dim_v; e += 32) out[e] = StoreOf<T>(0.f);
  for (int h = lane; h < p.num_heads; h += 32) p.lse[int64_t(h) * p.total_q + row] = -INFINITY;
}

}  // namespace

const char* LaunchSplitCombine(const SplitCombineArgs& a, cudaStream_t stream) {
  // SGLang's combine invariants, kept as internal checks.
  if (a.lse_partial_type != DType::kF32) return "LSE partial tensor must be Float32";
  if (a.o_type != a.p.out_type) return "O tensor must match dtype";
  if (a.num_splits < 1 || a.num_splits > kMaxSplits) return "jax_sgl.attention: bad split count";
  if (a.p.head_dim_v > 256) return "jax_sgl.attention: split combine supports head_dim_v <= 256";
  const int rows = a.p.seqlen_q * a.group;  // packed rows per sequence, an upper bound
  const dim3 grid((rows + kCombineWarps - 1) / kCombineWarps, a.p.batch * a.p.num_kv_heads);
  if (grid.x == 0 || grid.y == 0) return nullptr;
  if (a.o_type == DType::kBF16)
    SplitCombineKernel<bf16_t><<<grid, 32 * kCombineWarps, 0, stream>>>(a);
  else if (a.o_type == DType::kF16)
    SplitCombineKernel<f16_t><<<grid, 32 * kCombineWarps, 0, stream>>>(a);
  else
    return "O tensor must match dtype";
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

cudaError_t LaunchClearUncoveredRows(const AttentionParams& p, cudaStream_t stream) {
  constexpr int kWarps = 8;
  if (p.total_q == 0) return cudaSuccess;
  const unsigned blocks = unsigned((p.total_q + kWarps - 1) / kWarps);
  if (p.out_type == DType::kBF16)
    ClearUncoveredRowsKernel<bf16_t><<<blocks, 32 * kWarps, 0, stream>>>(p);
  else
    ClearUncoveredRowsKernel<f16_t><<<blocks, 32 * kWarps, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_sgl::cuda
