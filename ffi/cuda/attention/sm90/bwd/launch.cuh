// Host launcher of the sm_90a flash attention backward: TMA descriptors for one call (dense
// [batch, seq, heads, head_dim] tensors), then the kernels: zero dq_accum, dK/dV (+ dQ
// reductions) with one CTA per (128 keys, kv head, batch), and the dQ convert; or, for the
// deterministic dQ, dK/dV alone and then the dQ kernel, one CTA per (128 rows, q head, batch).
// Included only by the generated instantiations/sm90_bwd_*.cu files.
#pragma once

#include <algorithm>

#include "ffi/common/numeric.h"
#include "ffi/cuda/attention/common/launch.cuh"
#include "ffi/cuda/attention/sm90/bwd/dq_launch.cuh"
#include "ffi/cuda/attention/sm90/bwd/kernel.cuh"
#include "ffi/cuda/attention/sm90/bwd/launch.h"
#include "ffi/cuda/attention/sm90/bwd/make_params.cuh"
#include "ffi/cuda/attention/sm90/bwd/tail_sum.cuh"
#include "ffi/cuda/attention/sm90/bwd/wide_launch.cuh"
#include "ffi/cuda/attention/sm90/fwd/launch.cuh"  // CutlassType, DenseTensor

namespace jax_sgl::cuda {

namespace sm90 {

// Dense causal calls: (kv head, batch) pairs per section of the key-block-major launch order
// (BwdKernelParams::section_heads): as many as keep a section's Q and dO (16-bit) and its float32
// dQ accumulators within 40 MB of the H100's / H200's 50 MB L2. Other calls: 0, the grid's order
// (their blocks cost the same, or nearly; varlen blocks follow the sequences).
inline int BwdSectionHeads(const AttentionParams& p, int ws_rows) {
  if (!p.causal || p.window_left >= 0 || p.cu_seqlens_q != nullptr) return 0;
  const int64_t bytes = int64_t(p.num_heads / p.num_kv_heads) * ws_rows * p.head_dim * (2 + 2 + 4);
  return int(std::max<int64_t>(1, (int64_t(40) << 20) / bytes));
}

// hd64 / hd96 / hd128: config.h's kernel, the tail split and the deterministic dQ kernel (dense);
// varlen calls (cu_seqlens_q and cu_seqlens_k) run its kVarlen instantiation over the linear key
// blocks of all sequences, and the convert over the padded workspace's row blocks.
template <typename T, int kHeadDim>
cudaError_t LaunchFlashBwdSm90Narrow(const FlashBwdArgs& args, float* dq_accum, bool dq_kernel,
                                     cudaStream_t stream) {
  using Cfg = sm90::BwdConfig<typename sm90::CutlassType<T>::type, kHeadDim>;
  using namespace cute;
  const AttentionBwdParams& bp = args.bp;
  const AttentionParams& p = bp.fwd;
  // Varlen: cu_seqlens_q with cu_seqlens_k (Sm90BwdUnsupported), the workspace padded per
  // sequence to this kernel's row block (Sm90BwdRowBlock), no tail split.
  const bool varlen = p.cu_seqlens_q != nullptr;
  if (varlen != (args.ws_seq_align == Cfg::kBlockM) ||
      varlen != (p.kv_layout == KvLayout::kVarlen) || (dq_accum == nullptr) != dq_kernel ||
      (varlen && args.sm90_tail != nullptr))
    return cudaErrorInvalidValue;
  const int m_blocks = args.ws_rows / Cfg::kBlockM;
  const int n_blocks = (p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const int num_blocks = n_blocks * p.num_kv_heads * p.batch;
  // Tail split (args.sm90_tail: Sm90BwdTailSplitRequested, never with softcap; ChooseTailSplit):
  // each key block of the last, partial wave (one CTA per SM) runs on several CTAs of a second
  // launch over shares of its steps, and FlashBwdSm90TailSum adds their dK and dV.
  TailSplit split{0, 0};
  if (args.sm90_tail != nullptr) {
    int num_sms = 0;
    if (cudaError_t err = CurrentSmCount(&num_sms); err != cudaSuccess) return err;
    split = ChooseTailSplit(num_blocks, num_sms,
                            (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM * args.group);
  }
  const int tail_blocks = split.tail, tail_splits = split.splits;
  // Sm90BwdTailBytes: dK then dV, one 128-key block per SM each.
  static_assert(Cfg::kBlockN == 128, "Sm90BwdTailBytes sizes 128-key blocks");
  const int64_t tail_floats = int64_t(tail_blocks) * tail_splits * Cfg::kBlockN * kHeadDim;
  const auto params = sm90::MakeBwdKernelParams<Cfg, typename Cfg::SmemLayoutKVHalf>(
      args, dq_accum,
      {n_blocks, num_blocks - tail_blocks, tail_splits,
       tail_blocks > 0 ? args.sm90_tail : nullptr,
       tail_blocks > 0 ? args.sm90_tail + tail_floats : nullptr, BwdSectionHeads(p, args.ws_rows)},
      varlen);
  cudaError_t err;
  if (dq_accum != nullptr &&
      (err = cudaMemsetAsync(dq_accum, 0, Sm90BwdDqAccumFloats(p, args.ws_rows) * sizeof(float),
                             stream)) != cudaSuccess)
    return err;
  constexpr int kSmem = sizeof(typename Cfg::SharedStorage);
  if (varlen) {
    // The key blocks of all sequences: at most ceil(total_k / kBlockN) + batch (each sequence
    // adds at most one partial block).
    const int grid_x = int((p.total_k + Cfg::kBlockN - 1) / Cfg::kBlockN) + p.batch;
    auto kernel = p.softcap > 0.f ? sm90::FlashBwdSm90Kernel<Cfg, true, false, true>
                                   : sm90::FlashBwdSm90Kernel<Cfg, false, false, true>;
    if ((err = LaunchWithSmem(kernel, dim3(grid_x, p.num_kv_heads, 1), Cfg::kThreads, kSmem,
                              stream, params)) != cudaSuccess)
      return err;
    if (dq_kernel) return sm90::LaunchFlashBwdSm90Dq<T, kHeadDim>(args, stream);
    sm90::FlashBwdSm90DqConvertKernel<Cfg, true><<<dim3(m_blocks, p.num_heads, 1), 256, 0,
                                                   stream>>>(
        dq_accum, static_cast<typename Cfg::Element*>(bp.dq), int(p.total_q), p.num_heads,
        m_blocks, p.softmax_scale, p.cu_seqlens_q, p.batch);
    return cudaGetLastError();
  }
  auto kernel = p.softcap > 0.f ? sm90::FlashBwdSm90Kernel<Cfg, true>
                                 : sm90::FlashBwdSm90Kernel<Cfg, false>;
  if ((err = LaunchWithSmem(kernel, dim3(n_blocks, p.num_kv_heads, p.batch), Cfg::kThreads, kSmem,
                            stream, params)) != cudaSuccess)
    return err;
  if (tail_blocks > 0) {
    // The shares of the tail blocks, which the main kernel skipped: a full wave after its last.
    if ((err = LaunchWithSmem(sm90::FlashBwdSm90Kernel<Cfg, false, true>,
                              dim3(tail_blocks * tail_splits), Cfg::kThreads, kSmem, stream,
                              params)) != cudaSuccess)
      return err;
    using Element = typename Cfg::Element;
    const sm90::BwdTailSumParams<Element> sum{
        params.tail_dk, params.tail_dv, static_cast<Element*>(bp.dk),
        static_cast<Element*>(bp.dv), num_blocks - tail_blocks, tail_splits, n_blocks,
        p.num_kv_heads, p.seqlen_k};
    sm90::FlashBwdSm90TailSum<Element, kHeadDim, Cfg::kBlockN>
        <<<dim3(tail_blocks, Cfg::kBlockN / sm90::kTailWarps),
           32 * sm90::kTailWarps, 0, stream>>>(sum);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (dq_kernel) return sm90::LaunchFlashBwdSm90Dq<T, kHeadDim>(args, stream);
  sm90::FlashBwdSm90DqConvertKernel<Cfg><<<dim3(m_blocks, p.num_heads, p.batch), 256, 0, stream>>>(
      dq_accum, static_cast<typename Cfg::Element*>(bp.dq), p.seqlen_q, p.num_heads, m_blocks,
      p.softmax_scale);
  return cudaGetLastError();
}

}  // namespace sm90

// Above hd128 the wide kernel; at and below it config.h's kernel (dense and varlen).
template <typename T, int kHeadDim>
cudaError_t LaunchFlashBwdSm90(const FlashBwdArgs& args, float* dq_accum, bool dq_kernel,
                               cudaStream_t stream) {
  if constexpr (kHeadDim > 128)
    return sm90::LaunchFlashBwdSm90Wide<T, kHeadDim>(args, dq_accum, dq_kernel, stream);
  else
    return sm90::LaunchFlashBwdSm90Narrow<T, kHeadDim>(args, dq_accum, dq_kernel, stream);
}

}  // namespace jax_sgl::cuda

// Instantiates one (storage type T, head dim D) of the launchers above (instantiations/).
#define JAX_SGL_INSTANTIATE_SM90_BWD(T, D)              \
  namespace jax_sgl::cuda {                             \
  template cudaError_t LaunchFlashBwdSm90<T, D>(        \
      const FlashBwdArgs&, float*, bool, cudaStream_t); \
  }
