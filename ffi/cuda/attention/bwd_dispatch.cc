// Host side of the CUDA attention backward: which calls it serves, how much workspace they need,
// and the launch sequence (clear unowned gradient rows, preprocess, dK/dV, dQ), on the sm_100a
// kernels (sm100/bwd/launch.h) or the sm_90a ones (sm90/bwd/launch.h) where they serve the call
// and the sm80 kernels otherwise. Host
// code only: the kernels live in bwd_sm80/preprocess.cu and the generated instantiations/ files.
#include <algorithm>

#include "ffi/common/attention_seq.h"
#include "ffi/cuda/attention/flash_bwd_launch.h"
#include "ffi/cuda/attention/flash_fwd_launch.h"  // HeadDimBuilt, WithHeadDimCap
#ifdef JAX_SGL_HAVE_SM90
#include "ffi/cuda/attention/sm90/bwd/launch.h"
#endif
#ifdef JAX_SGL_HAVE_SM100
#include "ffi/cuda/attention/sm100/bwd/launch.h"
#endif

namespace jax_sgl::cuda {
namespace {

// The capacity a call runs on, or 0 when none is compiled for it.
int BwdHeadDimCap(const AttentionParams& p) { return SmallestCapacity(p, kBwdHeadDimCapacities); }

template <typename T>
cudaError_t LaunchForType(int cap, const FlashBwdArgs& args, cudaStream_t stream) {
  return WithHeadDimCap(cap, cudaErrorInvalidValue, [&](auto d) {
    constexpr int D = decltype(d)::value;  // the portable backward stops at 128
    if constexpr (D <= 128) return LaunchFlashBwd<T, D>(args, stream);
    return cudaErrorInvalidValue;
  });
}

// The choices whose dK / dV come from the sm90 kernel (its dQ by reductions or by the dQ kernel).
bool RunsSm90DkDv(BwdKernel k) { return k == BwdKernel::kSm90 || k == BwdKernel::kSm90DqKernel; }

// Floats of softmax_d (and of lse_log2): lse's layout, dense rows padded to ws_rows; varlen q on
// the sm90 backward the padded [num_heads, ws_rows] (PaddedSeqRow0).
size_t WsFloats(const AttentionParams& p, const FlashBwdPlan& plan) {
  const size_t rows = !p.cu_seqlens_q            ? size_t(p.batch) * plan.ws_rows
                      : plan.ws_seq_align > 0 ? size_t(plan.ws_rows)
                                              : size_t(p.total_q);
  return rows * size_t(p.num_heads);
}

size_t Bytes(int64_t rows, int64_t heads, int dim, DType t) {
  return size_t(rows) * size_t(heads) * size_t(dim) * (t == DType::kF32 ? 4 : 2);
}

// Head dims above the sm80 kernels' 128 (192, 256): the sm90 backward's wide kernel only, on a
// Hopper device, for what it covers (dense or varlen, head_dim == head_dim_v; deterministic=True
// with its dQ by the atomic-free dQ kernel: Sm90BwdUnsupported); everything else has no CUDA
// backward (the Python layer lowers it to the reference: attention.py, cuda_bwd_unsupported).
BwdChoice ChooseWideBwdKernel(const AttentionParams& p, const DeviceInfo& dev) {
  (void)dev;
  BwdChoice c;
#ifdef JAX_SGL_HAVE_SM90
  const char* why = Sm90BwdUnsupported(p);
  if (why == nullptr && Sm90BwdEnabled(p, dev)) {
    c.kernel = p.deterministic ? BwdKernel::kSm90DqKernel : BwdKernel::kSm90;
    return c;
  }
  if (why != nullptr) {
    c.why = why;
    return c;
  }
#endif
  c.why = "jax_sgl.attention: head dims above 128 have a CUDA backward on Hopper (sm_90a) only "
          "(the sm90 backward, built with 90a)";
  return c;
}

}  // namespace

BwdChoice ChooseBwdKernel(const AttentionParams& p, const DeviceInfo& dev) {
  BwdChoice c;
  if (!HalfPrecisionOperands(p))
    c.why = "jax_sgl.attention: the CUDA backward supports float16 and bfloat16 q/k/v only";
  else if (p.kv_layout == KvLayout::kPaged)
    c.why = "jax_sgl.attention: gradients through paged KV are not supported";
  else if (p.head_dim % 8 || p.head_dim_v % 8)
    c.why = "jax_sgl.attention: the CUDA backward supports head dims that are multiples of 8 "
            "(head_dim and head_dim_v)";
  else if (BwdHeadDimCap(p) == 0)
    return ChooseWideBwdKernel(p, dev);
  else if (!HeadDimBuilt(BwdHeadDimCap(p)))
    c.why = "jax_sgl.attention: this build left out the CUDA backward for the head dim "
            "(JAX_SGL_ATTN_DISABLE_HDIM*)";
  else if (p.batch > 65535 || p.num_kv_heads > 65535)
    c.why = "jax_sgl.attention: the CUDA backward supports batch and num_kv_heads <= 65535";
  if (c.why != nullptr) return c;
  c.kernel = BwdKernel::kPortable;
#ifdef JAX_SGL_HAVE_SM100
  // A 10.0 device: CUTLASS's Blackwell backward collective for what it covers (dense, no window,
  // softcap, seqused_k or deterministic dQ: Sm100BwdUnsupported); the rest on the sm80 kernels.
  if (Sm100BwdUnsupported(p) == nullptr && Sm100BwdEnabled(p, dev)) {
    c.kernel = BwdKernel::kSm100;
    return c;
  }
#endif
#ifdef JAX_SGL_HAVE_SM90
  // Anything the sm90 kernels do not cover (other head dims, d != d_v, varlen q without varlen
  // k, ...) runs on the sm80 kernels: Sm90BwdUnsupported names it. Varlen runs on
  // the kernels' varlen instantiations. deterministic=True: dQ from the atomic-free sm90 dQ kernel
  // instead of float32 reductions.
  if (Sm90BwdUnsupported(p) == nullptr && Sm90BwdEnabled(p, dev))
    c.kernel = p.deterministic ? BwdKernel::kSm90DqKernel : BwdKernel::kSm90;
#endif
  return c;
}

const char* BwdKernelName(const BwdChoice& choice) {
  switch (choice.kernel) {
    case BwdKernel::kSm90: return "sm90_bwd";
    case BwdKernel::kSm90DqKernel: return "sm90_bwd_dq_kernel";
    case BwdKernel::kSm100: return "sm100_bwd";
    case BwdKernel::kPortable: return "portable_bwd";
    case BwdKernel::kNone: break;
  }
  return "none";
}

const char* PlanFlashBwd(const AttentionParams& p, const DeviceInfo& dev, FlashBwdPlan* plan) {
  plan->choice = ChooseBwdKernel(p, dev);
  if (plan->choice.kernel == BwdKernel::kNone) return plan->choice.why;
  const bool sm90 = RunsSm90DkDv(plan->choice.kernel);
  plan->ws_rows = p.seqlen_q;
  plan->ws_seq_align = 0;
#ifdef JAX_SGL_HAVE_SM90
  if (sm90) {
    const int block = Sm90BwdRowBlock(p);
    plan->ws_rows = (p.seqlen_q + block - 1) / block * block;
    if (p.cu_seqlens_q) {
      plan->ws_rows = Sm90BwdVarlenWsRows(p);
      plan->ws_seq_align = block;
    }
  }
#endif
  plan->scratch_bytes = 2 * WsFloats(p, *plan) * sizeof(float);
  plan->sm90_tail_bytes = 0;
#ifdef JAX_SGL_HAVE_SM100
  // Then the dQ accumulator, at the next 16 bytes (a TMA destination).
  if (plan->choice.kernel == BwdKernel::kSm100)
    plan->scratch_bytes += (4 + Sm100BwdDqAccumFloats(p)) * sizeof(float);
#endif
#ifdef JAX_SGL_HAVE_SM90
  if (plan->choice.kernel == BwdKernel::kSm90)
    plan->scratch_bytes += Sm90BwdDqAccumFloats(p, plan->ws_rows) * sizeof(float);
  if (sm90 && Sm90BwdTailSplitRequested(p)) plan->sm90_tail_bytes = Sm90BwdTailBytes(p, dev.num_sms);
  plan->scratch_bytes += plan->sm90_tail_bytes;
#endif
  return nullptr;
}

const char* RunFlashBwd(const AttentionBwdParams& bp, const FlashBwdPlan& plan, void* scratch,
                        cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  // Gradient rows no sequence owns (varlen padding, keys past seqused_k) are zeros; every owned
  // row is written by exactly one CTA below. Zero bits are 0.0 in float16 and bfloat16.
  if (p.cu_seqlens_q) {
    if (cudaError_t err = cudaMemsetAsync(bp.dq, 0, Bytes(p.total_q, p.num_heads, p.head_dim,
                                                          p.q_type), stream);
        err != cudaSuccess)
      return cudaGetErrorString(err);
  }
  if (p.kv_layout == KvLayout::kVarlen || p.seqused_k) {
    cudaError_t err = cudaMemsetAsync(
        bp.dk, 0, Bytes(p.total_k, p.num_kv_heads, p.head_dim, p.k_type), stream);
    if (err == cudaSuccess)
      err = cudaMemsetAsync(bp.dv, 0, Bytes(p.total_k, p.num_kv_heads, p.head_dim_v, p.v_type),
                            stream);
    if (err != cudaSuccess) return cudaGetErrorString(err);
  }
  if (p.batch == 0 || p.total_q == 0) return nullptr;

  FlashBwdArgs args;
  args.bp = bp;
  args.ws_rows = plan.ws_rows;
  args.ws_seq_align = plan.ws_seq_align;
  const size_t ws_floats = WsFloats(p, plan);
  args.bp.softmax_d = static_cast<float*>(scratch);
  args.lse_log2 = args.bp.softmax_d + ws_floats;
  args.group = p.num_heads / p.num_kv_heads;
  const bool sm90 = RunsSm90DkDv(plan.choice.kernel);
  args.skip_dkdv = sm90;
  args.negated = plan.choice.kernel == BwdKernel::kSm100;
  // Padding rows of the workspace (sm90: rows up to the row block, or between varlen sequences)
  // are read but masked: any finite value does, zeros are cheapest.
  if (plan.ws_rows != p.seqlen_q || plan.ws_seq_align > 0) {
    if (cudaError_t err = cudaMemsetAsync(scratch, 0, 2 * ws_floats * sizeof(float), stream);
        err != cudaSuccess)
      return cudaGetErrorString(err);
  }
  if (cudaError_t err = LaunchFlashBwdPreprocess(args, stream); err != cudaSuccess)
    return cudaGetErrorString(err);
#ifdef JAX_SGL_HAVE_SM100
  if (plan.choice.kernel == BwdKernel::kSm100) {
    float* dq_accum = args.bp.softmax_d + (2 * ws_floats + 3) / 4 * 4;
    const cudaError_t err = RunFlashBwdSm100(args, dq_accum, stream);
    return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
  }
#endif
#ifdef JAX_SGL_HAVE_SM90
  if (sm90) {
    const bool dq_reduced = plan.choice.kernel == BwdKernel::kSm90;
    float* dq_accum = dq_reduced ? args.lse_log2 + ws_floats : nullptr;
    // The tail split's dK / dV shares follow the workspace and dq_accum.
    if (plan.sm90_tail_bytes > 0)
      args.sm90_tail = args.lse_log2 + ws_floats +
                       (dq_reduced ? Sm90BwdDqAccumFloats(p, plan.ws_rows) : 0);
    const cudaError_t err = RunFlashBwdSm90(args, dq_accum, !dq_reduced, stream);
    return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
  }
#endif
  const int cap = BwdHeadDimCap(p);
  const cudaError_t err = p.q_type == DType::kBF16 ? LaunchForType<bf16_t>(cap, args, stream)
                                                   : LaunchForType<f16_t>(cap, args, stream);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace jax_sgl::cuda
