// Picks the CUDA attention kernel for a call and launches it: head-dim capacity, warp layout
// (prefill or decode), and the number of KV splits, from the shapes alone (no device reads), so
// the same plan holds when XLA replays the call. Host code only: the kernels live in the
// generated instantiations/ files.
#include <algorithm>

#include "ffi/common/attention_seq.h"
#include "ffi/cuda/attention/flash_fwd_launch.h"
#include "ffi/cuda/attention/sm90/launch.h"

namespace jax_sgl::cuda {
namespace {

// Keys per tile of each layout (FlashConfig::kBlockN), for the split heuristic.
int BlockN(int head_dim_cap, bool decode) { return decode || head_dim_cap <= 128 ? 64 : 32; }

template <typename T, int kD>
cudaError_t LaunchForHeadDim(const FlashPlan& plan, const FlashFwdArgs& args, cudaStream_t stream) {
  return plan.decode ? LaunchFlashFwd<T, kD, true>(args, plan.m_blocks, stream)
                     : LaunchFlashFwd<T, kD, false>(args, plan.m_blocks, stream);
}

template <typename T>
cudaError_t LaunchForType(const FlashPlan& plan, const FlashFwdArgs& args, cudaStream_t stream) {
  switch (plan.head_dim_cap) {
#ifndef JAX_SGL_ATTN_DISABLE_HDIM64
    case 64: return LaunchForHeadDim<T, 64>(plan, args, stream);
#endif
#ifndef JAX_SGL_ATTN_DISABLE_HDIM96
    case 96: return LaunchForHeadDim<T, 96>(plan, args, stream);
#endif
#ifndef JAX_SGL_ATTN_DISABLE_HDIM128
    case 128: return LaunchForHeadDim<T, 128>(plan, args, stream);
#endif
#ifndef JAX_SGL_ATTN_DISABLE_HDIM192
    case 192: return LaunchForHeadDim<T, 192>(plan, args, stream);
#endif
#ifndef JAX_SGL_ATTN_DISABLE_HDIM256
    case 256: return LaunchForHeadDim<T, 256>(plan, args, stream);
#endif
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

const char* PlanFlashFwd(const AttentionParams& p, int num_sms, FlashPlan* plan) {
  // The Hopper kernel on a 9.0 device, for what it covers and JAX_SGL_SM90 allows (by default
  // the GPU-verified instantiations); everything else falls through to the portable sm80 kernel.
  plan->sm90 = false;
#ifdef JAX_SGL_HAVE_SM90
  if (Sm90Unsupported(p) == nullptr && Sm90Enabled(p)) {
    plan->sm90 = true;
    plan->scratch_bytes = kSm90ScratchBytes;
    return nullptr;
  }
#endif
  const bool half = p.q_type == DType::kBF16 || p.q_type == DType::kF16;
  if (!half || p.k_type != p.q_type || p.v_type != p.q_type || p.out_type != p.q_type)
    return "jax_sgl.attention: the CUDA kernel supports float16 and bfloat16 q/k/v only "
           "(float32 and fp8 inputs run on the CPU backend)";
  const int need = std::max(p.head_dim, p.head_dim_v);
  int cap = 0;
  for (int d : kHeadDimCapacities) {
    if (d >= need) {
      cap = d;
      break;
    }
  }
  if (cap == 0 || p.head_dim % 8 || p.head_dim_v % 8)
    return "jax_sgl.attention: the CUDA kernel supports head dims that are multiples of 8 up to 256";
  if (!HeadDimBuilt(cap))
    return "jax_sgl.attention: this build left out the CUDA kernel for the head dim "
           "(JAX_SGL_ATTN_DISABLE_HDIM*)";
  if (int64_t(p.batch) * p.num_kv_heads > 65535)
    return "jax_sgl.attention: the CUDA kernel supports batch * num_kv_heads <= 65535";
  const int group = p.num_heads / p.num_kv_heads;
  const int64_t rows = int64_t(p.seqlen_q) * group;  // packed rows per sequence (a bound)
  plan->head_dim_cap = cap;
  plan->decode = rows <= 16;
  plan->block_m = plan->decode ? 16 : 64;
  plan->m_blocks = int(std::max<int64_t>(1, (rows + plan->block_m - 1) / plan->block_m));

  // Split the keys when the grid would leave SMs idle: decode (few rows, long KV) wants several
  // CTAs per SM to keep enough loads in flight; prefill splits only when it lacks one full wave.
  int64_t k_bound;
  switch (p.kv_layout) {
    case KvLayout::kDense: k_bound = p.seqlen_k; break;
    case KvLayout::kVarlen: k_bound = p.total_k; break;
    default: k_bound = int64_t(p.max_pages) * p.page_size; break;
  }
  const int64_t ctas = int64_t(plan->m_blocks) * p.batch * p.num_kv_heads;
  const int64_t blocks_n = (k_bound + BlockN(cap, plan->decode) - 1) / BlockN(cap, plan->decode);
  const int64_t target = plan->decode ? 8LL * num_sms : (ctas < num_sms ? 2LL * num_sms : ctas);
  int64_t splits = ctas > 0 ? (target + ctas - 1) / ctas : 1;
  splits = std::min<int64_t>({splits, kMaxSplits, std::max<int64_t>(1, blocks_n / 4)});
  plan->num_splits = int(std::max<int64_t>(1, splits));
  plan->scratch_bytes = 0;
  if (plan->num_splits > 1) {
    const size_t per_split = size_t(p.total_q) * p.num_heads;
    plan->scratch_bytes = size_t(plan->num_splits) * per_split * (size_t(p.head_dim_v) + 1) * 4;
  }
  return nullptr;
}

const char* RunFlashFwd(const AttentionParams& p, const FlashPlan& plan, void* scratch,
                        cudaStream_t stream) {
  if (p.batch == 0 || p.total_q == 0) return nullptr;
#ifdef JAX_SGL_HAVE_SM90
  if (plan.sm90) {
    const cudaError_t err = RunFlashFwdSm90(p, scratch, stream);
    return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
  }
#endif
  if (p.cu_seqlens_q) {
    if (cudaError_t err = LaunchClearUncoveredRows(p, stream); err != cudaSuccess)
      return cudaGetErrorString(err);
  }
  FlashFwdArgs args;
  args.p = p;
  args.group = p.num_heads / p.num_kv_heads;
  args.num_splits = plan.num_splits;
  args.o_partial = nullptr;
  args.lse_partial = nullptr;
  if (plan.num_splits > 1) {
    args.o_partial = static_cast<float*>(scratch);
    args.lse_partial =
        args.o_partial + size_t(plan.num_splits) * p.total_q * p.num_heads * p.head_dim_v;
  }
  const cudaError_t err = p.q_type == DType::kBF16 ? LaunchForType<bf16_t>(plan, args, stream)
                                                   : LaunchForType<f16_t>(plan, args, stream);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  if (plan.num_splits == 1) return nullptr;
  SplitCombineArgs c;
  c.p = p;
  c.group = args.group;
  c.num_splits = plan.num_splits;
  c.o_partial = args.o_partial;
  c.lse_partial = args.lse_partial;
  c.lse_partial_type = DType::kF32;
  c.o_type = p.q_type;
  return LaunchSplitCombine(c, stream);
}

}  // namespace jax_sgl::cuda
