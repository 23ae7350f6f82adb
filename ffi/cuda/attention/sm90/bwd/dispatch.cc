// Host side of the sm_90a flash attention backward: whether it may run a call (coverage, opt-in,
// device) and the (dtype, head dim) switch over the instantiations this build compiled.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "ffi/common/numeric.h"
#include "ffi/cuda/attention/common/device.h"
#include "ffi/cuda/attention/common/env.h"
#include "ffi/cuda/attention/sm90/bwd/launch.h"
#include "ffi/cuda/attention/sm90/fwd/launch.h"

namespace jax_sgl::cuda {
namespace {

// cmake/cuda.cmake defines JAX_SGL_SM90_BWD_HAVE_HDIM<D>_<DTYPE> for each backward file it
// builds, and lists the extra performance variants (JAX_SGL_SM90_BWD_VARIANTS) as
// JAX_SGL_SM90_BWD_VARIANT(D, DTYPE, V) lines in the generated sm90_bwd_variants.inc. Calls
// f(T* tag, integral_constant<int, D>, integral_constant<int, V>) for the matching storage type
// and head dim, in variant v when built, else 0; returns false when (dtype, head dim) was left out.
template <typename F>
bool WithInstantiation(DType t, int d, int v, F&& f) {
  const bool bf16 = t == DType::kBF16;
  (void)bf16, (void)d, (void)v, (void)f;  // unused when no instantiation is built
#define JAX_SGL_SM90_BWD_VARIANT(D, DTYPE, V)                                             \
  if (d == D && bf16 == JAX_SGL_SM90_BWD_IS_BF16_##DTYPE && v == V) {                      \
    f(static_cast<JAX_SGL_SM90_BWD_TYPE_##DTYPE*>(nullptr), std::integral_constant<int, D>{}, \
      std::integral_constant<int, V>{});                                                  \
    return true;                                                                          \
  }
#define JAX_SGL_SM90_BWD_IS_BF16_bf16 true
#define JAX_SGL_SM90_BWD_IS_BF16_fp16 false
#define JAX_SGL_SM90_BWD_TYPE_bf16 bf16_t
#define JAX_SGL_SM90_BWD_TYPE_fp16 f16_t
#if __has_include("sm90_bwd_variants.inc")
#include "sm90_bwd_variants.inc"
#endif
#undef JAX_SGL_SM90_BWD_VARIANT
#undef JAX_SGL_SM90_BWD_IS_BF16_bf16
#undef JAX_SGL_SM90_BWD_IS_BF16_fp16
#undef JAX_SGL_SM90_BWD_TYPE_bf16
#undef JAX_SGL_SM90_BWD_TYPE_fp16
#define JAX_SGL_SM90_BWD_CASE(D, TYPE, IS_BF16)                     \
  if (d == D && bf16 == IS_BF16) {                                  \
    f(static_cast<TYPE*>(nullptr), std::integral_constant<int, D>{}, \
      std::integral_constant<int, 0>{});                            \
    return true;                                                    \
  }
#ifdef JAX_SGL_SM90_BWD_HAVE_HDIM64_BF16
  JAX_SGL_SM90_BWD_CASE(64, bf16_t, true)
#endif
#ifdef JAX_SGL_SM90_BWD_HAVE_HDIM64_FP16
  JAX_SGL_SM90_BWD_CASE(64, f16_t, false)
#endif
#ifdef JAX_SGL_SM90_BWD_HAVE_HDIM128_BF16
  JAX_SGL_SM90_BWD_CASE(128, bf16_t, true)
#endif
#ifdef JAX_SGL_SM90_BWD_HAVE_HDIM128_FP16
  JAX_SGL_SM90_BWD_CASE(128, f16_t, false)
#endif
#undef JAX_SGL_SM90_BWD_CASE
  return false;
}

bool Built(DType t, int d) {
  return WithInstantiation(t, d, 0, [](auto, auto, auto) {});
}

}  // namespace

const char* Sm90BwdUnsupported(const AttentionParams& p) {
  if (p.cu_seqlens_q != nullptr || p.kv_layout != KvLayout::kDense)
    return "sm90 backward: dense layout only (varlen runs on the sm80 backward)";
  if (!HalfPrecisionOperands(p))
    return "sm90 backward: float16/bfloat16 q, k, v and out only";
  if (p.head_dim != p.head_dim_v || !Built(p.q_type, p.head_dim))
    return "sm90 backward: head_dim == head_dim_v in the built set (64, 128) only";
  if (p.seqlen_q < 1 || p.seqlen_k < 1) return "sm90 backward: non-empty q and k";
  // TMA byte strides below 2^40; the dQ accumulator's float offsets below 2^38 as well.
  if ((int64_t(p.seqlen_q) + 128) * p.num_heads * p.head_dim * p.batch >= (int64_t(1) << 36) ||
      int64_t(p.seqlen_k) * p.num_kv_heads * p.head_dim * p.batch >= (int64_t(1) << 36))
    return "sm90 backward: tensors below 2^36 elements";
  if (p.num_kv_heads > 65535 || p.batch > 65535 || p.num_heads % p.num_kv_heads != 0)
    return "sm90 backward: batch and kv heads <= 65535, whole GQA groups";
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.out)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return "sm90 backward: 16-byte aligned buffers";
  return nullptr;
}

// Every built instantiation passed the GPU gradient tests (hd64 / hd128 x bf16 / fp16, both dQ
// modes; H100 and H200, 2026-12-02), so all run by default; JAX_SGL_SM90_BWD=0 turns them off.
bool Sm90BwdEnabled(const AttentionParams&) {
  const char* env = std::getenv("JAX_SGL_SM90_BWD");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  return IsComputeCapability90();
}

int Sm90BwdVariant() {
  const int v = EnvInt("JAX_SGL_SM90_BWD_VARIANT", 0);
  return v >= 0 && v <= 15 ? v : 0;
}

int Sm90BwdRowBlock(const AttentionParams& p) { return p.head_dim == 128 ? 64 : 128; }

size_t Sm90BwdDqAccumFloats(const AttentionParams& p, int ws_rows) {
  return size_t(p.batch) * p.num_heads * ws_rows * p.head_dim;
}

const char* Sm90BwdBuiltKernels() {
  return ""
#ifdef JAX_SGL_SM90_BWD_HAVE_HDIM64_BF16
         " hdim64_bf16"
#endif
#ifdef JAX_SGL_SM90_BWD_HAVE_HDIM64_FP16
         " hdim64_fp16"
#endif
#ifdef JAX_SGL_SM90_BWD_HAVE_HDIM128_BF16
         " hdim128_bf16"
#endif
#ifdef JAX_SGL_SM90_BWD_HAVE_HDIM128_FP16
         " hdim128_fp16"
#endif
#define JAX_SGL_SM90_BWD_VARIANT(D, DTYPE, V) " hdim" #D "_" #DTYPE "_v" #V
#if __has_include("sm90_bwd_variants.inc")
#include "sm90_bwd_variants.inc"
#endif
#undef JAX_SGL_SM90_BWD_VARIANT
      ;
}

bool Sm90BwdTailSplitRequested(const AttentionParams& p) {
  return !p.causal && p.window_left < 0 && p.window_right < 0 && p.seqused_k == nullptr &&
         p.softcap <= 0.f && EnvInt("JAX_SGL_SM90_BWD_TAIL_SPLIT", 1) != 0;
}

size_t Sm90BwdTailBytes(const AttentionParams& p) {
  int num_sms = 0;
  if (CurrentSmCount(&num_sms) != cudaSuccess) return 0;
  return size_t(num_sms) * 128 * size_t(p.head_dim) * 2 * sizeof(float);
}

cudaError_t RunFlashBwdSm90(const FlashBwdArgs& args, float* dq_accum, bool dq_kernel,
                            cudaStream_t stream) {
  const AttentionParams& p = args.bp.fwd;
  cudaError_t err = cudaErrorInvalidValue;
  WithInstantiation(p.q_type, p.head_dim, Sm90BwdVariant(),
                    [&](auto* tag, auto head_dim, auto variant) {
    using T = std::remove_pointer_t<decltype(tag)>;
    err = LaunchFlashBwdSm90<T, decltype(head_dim)::value, decltype(variant)::value>(
        args, dq_accum, dq_kernel, stream);
  });
  return err;
}

}  // namespace jax_sgl::cuda
