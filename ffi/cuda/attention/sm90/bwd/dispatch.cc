// Host side of the sm_90a flash attention backward: whether it may run a call (coverage, opt-in,
// device) and the (dtype, head dim) switch over the instantiations this build compiled.
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "ffi/common/numeric.h"
#include "ffi/cuda/attention/sm90/kernel_list.h"
#include "ffi/cuda/attention/common/device.h"
#include "ffi/cuda/attention/sm90/bwd/launch.h"
#include "ffi/cuda/attention/sm90/fwd/launch.h"

namespace jax_sgl::cuda {
namespace {

// Calls f(T* tag, integral_constant<int, D>) for the matching built storage type and head dim
// (sm90/kernel_list.h); returns false when (dtype, head dim) was left out.

template <typename F>
bool WithInstantiation(DType t, int d, F&& f) {
  (void)t, (void)d, (void)f;  // unused when no instantiation is built
#define JAX_SGL_SM90_BWD(D, T)                                                       \
  if (t == sm90::kDType_##T && d == D) {                                            \
    f(static_cast<sm90::Type_##T*>(nullptr), std::integral_constant<int, D>{});     \
    return true;                                                                     \
  }
#include "ffi/cuda/attention/instantiations/sm90_kernels.inc"
  return false;
}

bool Built(DType t, int d) {
  return WithInstantiation(t, d, [](auto, auto) {});
}

}  // namespace

const char* Sm90BwdUnsupported(const AttentionParams& p) {
  const bool varlen = p.cu_seqlens_q != nullptr || p.kv_layout != KvLayout::kDense;
  if (p.kv_layout == KvLayout::kPaged) return "sm90 backward: no paged K/V";
  // Varlen runs on the kVarlen instantiations (kernel.cuh at 64 / 96 / 128, wide_kernel.cuh
  // above), which take cu_seqlens_q and cu_seqlens_k together.
  if (varlen && (p.cu_seqlens_q == nullptr || p.kv_layout != KvLayout::kVarlen))
    return "sm90 backward: varlen q and k together (cu_seqlens_q and cu_seqlens_k)";
  if (!HalfPrecisionOperands(p))
    return "sm90 backward: float16/bfloat16 q, k, v and out only";
  if (p.head_dim != p.head_dim_v || !Built(p.q_type, p.head_dim))
    return "sm90 backward: head_dim == head_dim_v in the built set (64, 96, 128, 192, 256) only";
  if (varlen ? p.total_q < 1 || p.total_k < 1 : p.seqlen_q < 1 || p.seqlen_k < 1)
    return "sm90 backward: non-empty q and k";
  // TMA byte strides below 2^40; the dQ accumulator's float offsets below 2^38 as well (varlen:
  // the padded workspace's rows, Sm90BwdVarlenWsRows).
  const int64_t q_rows = varlen ? p.total_q + int64_t(128) * (p.batch + 1)
                                : (int64_t(p.seqlen_q) + 128) * p.batch;
  const int64_t k_rows = varlen ? p.total_k : int64_t(p.seqlen_k) * p.batch;
  if (q_rows * p.num_heads * p.head_dim >= (int64_t(1) << 36) ||
      k_rows * p.num_kv_heads * p.head_dim >= (int64_t(1) << 36))
    return "sm90 backward: tensors below 2^36 elements";
  if (p.num_kv_heads > 65535 || p.batch > 65535 || p.num_heads % p.num_kv_heads != 0)
    return "sm90 backward: batch and kv heads <= 65535, whole GQA groups";
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.out)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return "sm90 backward: 16-byte aligned buffers";
  return nullptr;
}

// hd64 / hd128 passed the GPU gradient tests (bf16 / fp16, both dQ modes; H100 and H200,
// 2026-12-02), hd96, hd192 / hd256 and varlen as well (tests/test_attention_grad_wide_gpu.py,
// H100, 2026-12-05; varlen at 64 / 96 / 128 since on config.h's kernel). All run by default;
// JAX_SGL_DISABLE=sm90_bwd (a bit of p.disable) turns them off.
bool Sm90BwdEnabled(const AttentionParams& p, const DeviceInfo& dev) {
  if (p.disable & kDisableSm90Bwd) return false;
  return IsSm90(dev);
}

// hd64: config.h's 128-row steps; hd96 / hd128: 64 rows; hd192 / hd256: wide_config.h's 64.
// Dense and varlen alike (varlen pads each sequence's workspace rows to it).
int Sm90BwdRowBlock(const AttentionParams& p) { return p.head_dim == 64 ? 128 : 64; }

int Sm90BwdVarlenWsRows(const AttentionParams& p) {
  const int64_t block = Sm90BwdRowBlock(p);
  return int((p.total_q + block * p.batch + block - 1) / block * block);
}

size_t Sm90BwdDqAccumFloats(const AttentionParams& p, int ws_rows) {
  return size_t(p.cu_seqlens_q != nullptr ? 1 : p.batch) * p.num_heads * ws_rows * p.head_dim;
}

const char* Sm90BwdBuiltKernels() {
  return ""
#define JAX_SGL_SM90_BWD(D, T) " hdim" #D "_" #T
#include "ffi/cuda/attention/instantiations/sm90_kernels.inc"
      ;
}

bool Sm90BwdTailSplitRequested(const AttentionParams& p) {
  // The wide kernel (wide_launch.cuh: head dims above 128, varlen) has no tail split.
  return p.head_dim <= 128 && p.cu_seqlens_q == nullptr && !p.causal && p.window_left < 0 && p.window_right < 0 && p.seqused_k == nullptr &&
         p.softcap <= 0.f;
}

size_t Sm90BwdTailBytes(const AttentionParams& p, int num_sms) {
  return size_t(num_sms) * 128 * size_t(p.head_dim) * 2 * sizeof(float);
}

cudaError_t RunFlashBwdSm90(const FlashBwdArgs& args, float* dq_accum, bool dq_kernel,
                            cudaStream_t stream) {
  const AttentionParams& p = args.bp.fwd;
  cudaError_t err = cudaErrorInvalidValue;
  WithInstantiation(p.q_type, p.head_dim, [&](auto* tag, auto head_dim) {
    using T = std::remove_pointer_t<decltype(tag)>;
    err = LaunchFlashBwdSm90<T, decltype(head_dim)::value>(args, dq_accum, dq_kernel, stream);
  });
  return err;
}

}  // namespace jax_sgl::cuda
