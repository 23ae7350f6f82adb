// Host side of the sm_100a flash attention backward: which calls it covers (Sm100BwdUnsupported),
// the device check, the dQ accumulator's size, and the (dtype, head dim) switch over the
// instantiations this build compiled (instantiations/sm100_kernels.inc).
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "ffi/cuda/attention/sm100/bwd/launch.h"
#include "ffi/cuda/attention/sm90/kernel_list.h"  // the dtype tokens' types (Type_bf16, ...)

namespace jax_sgl::cuda {
namespace {

// Calls f(T* tag, integral_constant<int, D>) for the matching built storage type and head dim;
// returns false when (dtype, head dim) was left out.
template <typename F>
bool WithInstantiation(DType t, int d, F&& f) {
  (void)t, (void)d, (void)f;  // unused when no instantiation is built
#define JAX_SGL_SM100_BWD(D, T)                                                    \
  if (t == sm90::kDType_##T && d == D) {                                           \
    f(static_cast<sm90::Type_##T*>(nullptr), std::integral_constant<int, D>{});    \
    return true;                                                                   \
  }
#include "ffi/cuda/attention/instantiations/sm100_kernels.inc"
  return false;
}

bool Built(DType t, int d) {
  return WithInstantiation(t, d, [](auto, auto) {});
}

}  // namespace

const char* Sm100BwdUnsupported(const AttentionParams& p) {
  if (p.cu_seqlens_q != nullptr || p.kv_layout != KvLayout::kDense || p.seqused_k != nullptr)
    return "sm100 backward: dense layout without seqused_k only (the collective's varlen trusts "
           "cu_seqlens unclamped; varlen runs on the portable backward)";
  if (!HalfPrecisionOperands(p)) return "sm100 backward: float16/bfloat16 q, k, v and out only";
  if (p.head_dim != p.head_dim_v || !Built(p.q_type, p.head_dim))
    return "sm100 backward: head_dim == head_dim_v in the built set (64, 128) only";
  if (p.softcap != 0.f)
    return "sm100 backward: no softcap (the collective's dS has no hook for its derivative)";
  if (HasSlidingWindow(p))
    return "sm100 backward: no sliding window (the collective's masks have no local mask)";
  if (p.deterministic)
    return "sm100 backward: deterministic=True needs an atomic-free dQ (the collective's dQ is a "
           "float32 TMA reduce-add)";
  if (p.seqlen_q < 1 || p.seqlen_k < 1) return "sm100 backward: non-empty q and k";
  // The collective's strides and the cp.async row offsets are 32-bit ints: every tensor, the
  // dQ accumulator (rows padded to 8) included, stays below 2^31 elements.
  const int64_t q_elems = (int64_t(p.seqlen_q) + 8) * p.num_heads * p.head_dim * p.batch;
  const int64_t k_elems = int64_t(p.seqlen_k) * p.num_kv_heads * p.head_dim * p.batch;
  if (q_elems >= (int64_t(1) << 31) || k_elems >= (int64_t(1) << 31))
    return "sm100 backward: tensors below 2^31 elements";
  if (p.num_kv_heads > 65535 || p.batch > 65535 || p.num_heads % p.num_kv_heads != 0)
    return "sm100 backward: batch and kv heads <= 65535, whole GQA groups";
  if (p.k_row_stride != int64_t(p.num_kv_heads) * p.head_dim || p.k_head_stride != p.head_dim ||
      p.v_row_stride != p.k_row_stride || p.v_head_stride != p.head_dim)
    return "sm100 backward: contiguous k and v";
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.out)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
      return "sm100 backward: 16-byte aligned buffers";
  return nullptr;
}

// Not run on a Blackwell GPU yet (compiled and SASS-checked: benchmarks/notes/NOTES_sm100.md),
// so JAX_SGL_DISABLE=sm100_bwd keeps the portable backward within reach on the first B200.
bool Sm100BwdEnabled(const AttentionParams& p, const DeviceInfo& dev) {
  if (p.disable & kDisableSm100Bwd) return false;
  return IsSm100(dev);
}

size_t Sm100BwdDqAccumFloats(const AttentionParams& p) {
  return size_t(p.batch) * p.num_heads * size_t(Sm100BwdDqAccumRows(p)) * p.head_dim;
}

const char* Sm100BwdBuiltKernels() {
  return ""
#define JAX_SGL_SM100_BWD(D, T) " hdim" #D "_" #T
#include "ffi/cuda/attention/instantiations/sm100_kernels.inc"
      ;
}

cudaError_t RunFlashBwdSm100(const FlashBwdArgs& args, float* dq_accum, cudaStream_t stream) {
  const AttentionParams& p = args.bp.fwd;
  cudaError_t err = cudaErrorInvalidValue;
  WithInstantiation(p.q_type, p.head_dim, [&](auto* tag, auto d) {
    using T = std::remove_pointer_t<decltype(tag)>;
    err = LaunchFlashBwdSm100<T, decltype(d)::value>(args, dq_accum, stream);
  });
  return err;
}

}  // namespace jax_sgl::cuda
