// Host side of the sm_90a flash forward: whether it may run a call (switch, device, coverage)
// and the (dtype, head dim, variant) switch over the instantiations this build compiled.
//
// JAX_SGL_SM90_VARIANT=<0..3> (read at each call) picks the kernel variant (sm90/variants.h) for
// A/B runs; unset, unparsable or not built (CMake JAX_SGL_SM90_VARIANTS) means variant 0.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "ffi/common/numeric.h"
#include "ffi/cuda/attention/sm90/launch.h"
#include "ffi/cuda/attention/sm90/variants.h"

namespace jax_sgl::cuda {
namespace {

// The instantiations this build compiled: cmake/cuda.cmake defines JAX_SGL_SM90_HAVE_HDIM<D>_<DTYPE>
// for each file it builds. Calls f(T* tag, integral_constant<int, D>) for the matching storage
// type T and head dim D, or returns false when (dtype, head dim) was left out.
template <typename F>
bool WithInstantiation(DType t, int d, F&& f) {
  const bool bf16 = t == DType::kBF16;
  (void)bf16, (void)d, (void)f;  // unused when no instantiation is built
#define JAX_SGL_SM90_CASE(D, TYPE, IS_BF16)                         \
  if (d == D && bf16 == IS_BF16) {                                  \
    f(static_cast<TYPE*>(nullptr), std::integral_constant<int, D>{}); \
    return true;                                                    \
  }
#ifdef JAX_SGL_SM90_HAVE_HDIM64_BF16
  JAX_SGL_SM90_CASE(64, bf16_t, true)
#endif
#ifdef JAX_SGL_SM90_HAVE_HDIM64_FP16
  JAX_SGL_SM90_CASE(64, f16_t, false)
#endif
#ifdef JAX_SGL_SM90_HAVE_HDIM128_BF16
  JAX_SGL_SM90_CASE(128, bf16_t, true)
#endif
#ifdef JAX_SGL_SM90_HAVE_HDIM128_FP16
  JAX_SGL_SM90_CASE(128, f16_t, false)
#endif
#ifdef JAX_SGL_SM90_HAVE_HDIM256_BF16
  JAX_SGL_SM90_CASE(256, bf16_t, true)
#endif
#ifdef JAX_SGL_SM90_HAVE_HDIM256_FP16
  JAX_SGL_SM90_CASE(256, f16_t, false)
#endif
#undef JAX_SGL_SM90_CASE
  return false;
}

bool Built(DType t, int d) {
  return WithInstantiation(t, d, [](auto, auto) {});
}

// Whether this build compiled variant v (for every built (dtype, head dim)): cmake/cuda.cmake
// defines JAX_SGL_SM90_HAVE_VARIANT<v> for each variant beyond 0 in JAX_SGL_SM90_VARIANTS.
constexpr bool VariantBuilt(int v) {
  switch (v) {
    case 0: return true;
#ifdef JAX_SGL_SM90_HAVE_VARIANT1
    case 1: return true;
#endif
#ifdef JAX_SGL_SM90_HAVE_VARIANT2
    case 2: return true;
#endif
#ifdef JAX_SGL_SM90_HAVE_VARIANT3
    case 3: return true;
#endif
    default: return false;
  }
}
static_assert(sm90::kNumVariants == 4, "VariantBuilt, Sm90BuiltKernels and RunFlashFwdSm90 list 4");

// Launches variant v of the (T, D) instantiation; v must be built.
template <typename T, int D>
cudaError_t LaunchVariant(int v, const AttentionParams& p, void* scratch, cudaStream_t stream) {
  switch (v) {
#ifdef JAX_SGL_SM90_HAVE_VARIANT1
    case 1: return LaunchFlashFwdSm90<T, D, 1>(p, scratch, stream);
#endif
#ifdef JAX_SGL_SM90_HAVE_VARIANT2
    case 2: return LaunchFlashFwdSm90<T, D, 2>(p, scratch, stream);
#endif
#ifdef JAX_SGL_SM90_HAVE_VARIANT3
    case 3: return LaunchFlashFwdSm90<T, D, 3>(p, scratch, stream);
#endif
    default: return LaunchFlashFwdSm90<T, D, 0>(p, scratch, stream);
  }
}

}  // namespace

const char* Sm90Unsupported(const AttentionParams& p) {
  if (p.cu_seqlens_q != nullptr || p.kv_layout != KvLayout::kDense || p.seqused_k != nullptr)
    return "sm90 kernel: dense layout only (varlen and paged run on the sm80 kernel)";
  const bool half = p.q_type == DType::kBF16 || p.q_type == DType::kF16;
  if (!half || p.k_type != p.q_type || p.v_type != p.q_type || p.out_type != p.q_type)
    return "sm90 kernel: float16/bfloat16 q, k, v and out only";
  if (p.head_dim != p.head_dim_v || !Built(p.q_type, p.head_dim))
    return "sm90 kernel: head_dim == head_dim_v in the built set (JAX_SGL_SM90_HEAD_DIMS) only";
  if (p.softcap != 0.f) return "sm90 kernel: no softcap";
  if (p.window_left != -1 || (p.window_right != -1 && !(p.causal && p.window_right == 0)))
    return "sm90 kernel: no sliding window";
  // TMA descriptors need every dimension >= 1 (an empty KV runs on the sm80 kernel) and byte
  // strides below 2^40; the grid's y/z take heads and batch.
  if (p.seqlen_q < 1 || p.seqlen_k < 1) return "sm90 kernel: non-empty q and k";
  if ((int64_t(p.seqlen_q) * p.num_heads + int64_t(p.seqlen_k) * p.num_kv_heads) * p.head_dim *
          p.batch >= (int64_t(1) << 38))
    return "sm90 kernel: tensors below 2^38 elements";
  if (p.num_heads > 65535 || p.batch > 65535) return "sm90 kernel: batch and heads <= 65535";
  // TMA wants 16-byte aligned bases (XLA's buffers are).
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.out)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return "sm90 kernel: 16-byte aligned buffers";
  return nullptr;
}

bool Sm90Enabled() {
  // Every instantiation passed the sm90 GPU tests on an H200 (benchmarks/NOTES_sm90.md,
  // 2026-12-02), so all built ones run by default; JAX_SGL_SM90=0 routes everything to the
  // portable kernel. Read at every call (a getenv is far cheaper than a launch), so a process, or
  // a test, can switch kernels between calls without recompiling anything.
  const char* env = std::getenv("JAX_SGL_SM90");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    return false;
  // sm_90a code runs on exactly compute capability 9.0.
  return major == 9 && minor == 0;
}

const char* Sm90BuiltKernels() {
  return ""
#ifdef JAX_SGL_SM90_HAVE_HDIM64_BF16
         " hdim64_bf16"
#endif
#ifdef JAX_SGL_SM90_HAVE_HDIM64_FP16
         " hdim64_fp16"
#endif
#ifdef JAX_SGL_SM90_HAVE_HDIM128_BF16
         " hdim128_bf16"
#endif
#ifdef JAX_SGL_SM90_HAVE_HDIM128_FP16
         " hdim128_fp16"
#endif
#ifdef JAX_SGL_SM90_HAVE_HDIM256_BF16
         " hdim256_bf16"
#endif
#ifdef JAX_SGL_SM90_HAVE_HDIM256_FP16
         " hdim256_fp16"
#endif
#ifdef JAX_SGL_SM90_HAVE_VARIANT1
         " variant1"
#endif
#ifdef JAX_SGL_SM90_HAVE_VARIANT2
         " variant2"
#endif
#ifdef JAX_SGL_SM90_HAVE_VARIANT3
         " variant3"
#endif
      ;
}

int Sm90Variant() {
  const char* env = std::getenv("JAX_SGL_SM90_VARIANT");
  if (env == nullptr || env[0] < '0' || env[0] > '9' || env[1] != '\0') return 0;
  const int v = env[0] - '0';
  return VariantBuilt(v) ? v : 0;
}

cudaError_t RunFlashFwdSm90(const AttentionParams& p, void* scratch, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  const int variant = Sm90Variant();
  WithInstantiation(p.q_type, p.head_dim, [&](auto* tag, auto head_dim) {
    using T = std::remove_pointer_t<decltype(tag)>;
    err = LaunchVariant<T, decltype(head_dim)::value>(variant, p, scratch, stream);
  });
  return err;
}

}  // namespace jax_sgl::cuda
