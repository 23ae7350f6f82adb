// Host side of the sm_100a flash forward: whether it may run a call (switch, device, coverage)
// and the (dtype, head dim) switch over the instantiations this build compiled.
//
// What it covers is what the collectives' forward computes exactly as jax_sgl defines it: dense
// or varlen (cu_seqlens_q with cu_seqlens_k) q/k/v, bottom-right causal, GQA, LSE, float16 /
// bfloat16, head dims 64 and 128, and attention sinks (a pass over the finished rows, sinks.cuh).
// The collectives construct their mask as Mask{} and hand it only the per-sequence problem shape
// (no batch index, no params), so per-call values (a sliding window's bounds, the softcap,
// seqused_k) cannot reach it. The one carrier left, a custom leaf of that shape, does not survive
// the load collective's copy into its int problem shape (cute's tuple has no converting
// assignment, and the head-dim leaf also feeds std::sqrt): tried 2026-12-04, it does not compile.
// Those calls, fp8 and paged K/V run on the other kernels (the portable forward; paged decode on
// the decode kernels), as Sm100FwdUnsupported says.
#include <cstdint>
#include <initializer_list>

#include "ffi/common/numeric.h"
#include "ffi/cuda/attention/sm100/fwd/launch.h"
#include "ffi/cuda/attention/sm90/kernel_list.h"

namespace jax_sgl::cuda {
namespace {

// The (head dim, dtype) pairs this build compiled (instantiations/sm100_kernels.inc; the dtype
// tokens map as sm90/kernel_list.h names them).
bool Built(DType t, int d) {
  (void)t, (void)d;
#define JAX_SGL_SM100_FWD(D, T) \
  if (t == sm90::kDType_##T && d == D) return true;
#include "ffi/cuda/attention/instantiations/sm100_kernels.inc"
  return false;
}

cudaError_t Launch(DType t, int d, const AttentionParams& p, cudaStream_t stream) {
  (void)t, (void)d, (void)p, (void)stream;
#define JAX_SGL_SM100_FWD(D, T)        \
  if (t == sm90::kDType_##T && d == D) \
    return LaunchFlashFwdSm100<sm90::Type_##T, D>(p, stream);
#include "ffi/cuda/attention/instantiations/sm100_kernels.inc"
  return cudaErrorInvalidValue;
}

}  // namespace

const char* Sm100FwdUnsupported(const AttentionParams& p) {
  if (!HalfPrecisionOperands(p))
    return "sm100 forward: float16/bfloat16 q, k, v and out only (fp8 runs on the CPU backend)";
  if (p.head_dim != p.head_dim_v || !Built(p.q_type, p.head_dim))
    return "sm100 forward: head_dim == head_dim_v in the built set (JAX_SGL_SM100_HEAD_DIMS) only";
  if (p.kv_layout == KvLayout::kPaged) return "sm100 forward: dense or varlen k/v (paged runs elsewhere)";
  // The collectives take varlen q and k together (their load builds both views from the two
  // cumulative arrays).
  const bool varlen = p.cu_seqlens_q != nullptr;
  if (varlen != (p.kv_layout == KvLayout::kVarlen))
    return "sm100 forward: cu_seqlens_q and cu_seqlens_k together";
  // The collectives read a zero scale as "1 / sqrt(head_dim)".
  if (p.softmax_scale == 0.0f) return "sm100 forward: a non-zero softmax_scale";
  if (p.seqused_k != nullptr)
    return "sm100 forward: seqused_k (the collectives' mask has no batch index)";
  if (HasSlidingWindow(p)) return "sm100 forward: sliding window (the collectives' mask has no run-time state)";
  if (p.softcap != 0.0f) return "sm100 forward: softcap (the collectives' mask has no run-time state)";
  // The collectives divide by the row sum: a causal row with no key would be NaN where jax_sgl
  // gives 0 and -inf. Dense calls with seqlen_q <= seqlen_k have none; varlen lengths live on the
  // device, so varlen causal calls stay on the portable kernel.
  if (p.causal && (varlen || p.seqlen_q > p.seqlen_k))
    return "sm100 forward: causal with every q row seeing a key (dense seqlen_q <= seqlen_k)";
  // TMA descriptors need every dimension >= 1.
  if (p.total_q < 1 || p.total_k < 1 || (!varlen && (p.seqlen_q < 1 || p.seqlen_k < 1)))
    return "sm100 forward: non-empty q and k";
  // The collectives' strides and coordinates are int.
  const int64_t kIntMax = (int64_t(1) << 31) - 1;
  if (p.total_q * p.num_heads * p.head_dim > kIntMax || p.total_k * p.k_row_stride > kIntMax ||
      p.total_k * p.v_row_stride > kIntMax)
    return "sm100 forward: tensors below 2^31 elements";
  // The varlen O store views the rows as (1 + batch) blocks of total_q rows (int; the epilogue
  // collective offsets each sequence into them).
  if (varlen && int64_t(p.total_q) * (int64_t(p.batch) + 1) > kIntMax)
    return "sm100 forward: varlen total_q * (batch + 1) below 2^31";
  if (p.num_heads > 65535 || p.batch > 65535) return "sm100 forward: batch and heads <= 65535";
  // TMA wants 16-byte aligned bases and strides (XLA's buffers are; head_dim is 64 or 128).
  for (int64_t stride : {p.k_row_stride, p.k_head_stride, p.v_row_stride, p.v_head_stride})
    if (stride % 8 != 0) return "sm100 forward: k/v strides of whole 16-byte units";
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.out)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return "sm100 forward: 16-byte aligned buffers";
  return nullptr;
}

bool Sm100FwdEnabled(const AttentionParams& p, const DeviceInfo& dev) {
  // Not yet run on a Blackwell GPU (benchmarks/notes/NOTES_sm100.md): compiled from NVIDIA's
  // tested collectives, it runs by default on a 10.0 device, and JAX_SGL_DISABLE=sm100 routes
  // everything to the portable kernels if it misbehaves there.
  if (p.disable & kDisableSm100) return false;
  return IsSm100(dev);
}

const char* Sm100FwdBuiltKernels() {
  return ""
#define JAX_SGL_SM100_FWD(D, T) " hdim" #D "_" #T
#include "ffi/cuda/attention/instantiations/sm100_kernels.inc"
      ;
}

cudaError_t RunFlashFwdSm100(const AttentionParams& p, cudaStream_t stream) {
  return Launch(p.q_type, p.head_dim, p, stream);
}

}  // namespace jax_sgl::cuda
