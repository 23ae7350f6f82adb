// jax_sgl._native: hands the FFI handlers to Python as capsules. jax_sgl/_registration.py registers the
// "cpu" ones always and the "cuda" ones when the extension was built with CUDA.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" {
XLA_FFI_Error* JaxSglRopePoolFwdCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxSglAttentionFwdCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxSglAttentionBwdCpu(XLA_FFI_CallFrame*);
#ifdef JAX_SGL_HAVE_CUDA
XLA_FFI_Error* JaxSglRopePoolFwdCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxSglAttentionFwdCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxSglAttentionBwdCuda(XLA_FFI_CallFrame*);
#endif
#ifdef JAX_SGL_HAVE_METAL
// macOS: "cpu" handlers that dispatch to Metal and fall back to the ones above (metal/host).
XLA_FFI_Error* JaxSglRopePoolFwdApple(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxSglAttentionFwdApple(XLA_FFI_CallFrame*);
#endif
}

#ifdef JAX_SGL_HAVE_CUDA
#include "ffi/cuda/attention/plan_probe.h"
#endif

namespace jax_sgl::cuda {
#ifdef JAX_SGL_HAVE_CUDA
const char* PortableBuiltHeadDims();  // ffi/cuda/attention/fwd_dispatch.cc
#endif
#ifdef JAX_SGL_HAVE_SM90
const char* Sm90BuiltKernels();     // ffi/cuda/attention/sm90/fwd/dispatch.cc
const char* Sm90BwdBuiltKernels();  // ffi/cuda/attention/sm90/bwd/dispatch.cc
#endif
#ifdef JAX_SGL_HAVE_SM100
const char* Sm100FwdBuiltKernels();  // ffi/cuda/attention/sm100/fwd/dispatch.cc
const char* Sm100BwdBuiltKernels();  // ffi/cuda/attention/sm100/bwd/dispatch.cc
#endif
}  // namespace jax_sgl::cuda

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

#ifdef JAX_SGL_HAVE_CUDA
// The lowered call's attribute dictionary (jax_sgl/attention.py _ffi_attrs) as XLA decodes it
// into AttentionAttrs (attention_ffi.h's JAX_SGL_ATTENTION_ATTRS list).
jax_sgl::AttentionAttrs ToAttentionAttrs(const nb::dict& d) {
#define JAX_SGL_ATTR_COUNT(T, NAME) +1
  constexpr size_t kCount = 0 JAX_SGL_ATTENTION_ATTRS(JAX_SGL_ATTR_COUNT);
#undef JAX_SGL_ATTR_COUNT
  if (nb::len(d) != kCount)
    throw nb::value_error(("attention_plan: expected the " + std::to_string(kCount) +
                           " attention attributes").c_str());
  jax_sgl::AttentionAttrs a;
#define JAX_SGL_ATTR_CAST(T, NAME) a.NAME = nb::cast<T>(d[#NAME]);
  JAX_SGL_ATTENTION_ATTRS(JAX_SGL_ATTR_CAST)
#undef JAX_SGL_ATTR_CAST
  return a;
}
#endif

}  // namespace

NB_MODULE(_native, m) {
  m.def("cpu_targets", []() {
    nb::dict d;
#ifdef JAX_SGL_HAVE_METAL
    d["jax_sgl_rope_pool_fwd"] = Capsule(JaxSglRopePoolFwdApple);
    d["jax_sgl_attention_fwd"] = Capsule(JaxSglAttentionFwdApple);
#else
    d["jax_sgl_rope_pool_fwd"] = Capsule(JaxSglRopePoolFwdCpu);
    d["jax_sgl_attention_fwd"] = Capsule(JaxSglAttentionFwdCpu);
#endif
    d["jax_sgl_attention_bwd"] = Capsule(JaxSglAttentionBwdCpu);
    return d;
  });
  m.def("cuda_targets", []() {
    nb::dict d;
#ifdef JAX_SGL_HAVE_CUDA
    d["jax_sgl_rope_pool_fwd"] = Capsule(JaxSglRopePoolFwdCuda);
    d["jax_sgl_attention_fwd"] = Capsule(JaxSglAttentionFwdCuda);
    d["jax_sgl_attention_bwd"] = Capsule(JaxSglAttentionBwdCuda);
#endif
    return d;
  });
  // How the CUDA part was built (jax_sgl.attention_backend_info()): its archs, and whether the
  // sm_90a kernels were left out for want of the CuTe headers.
  m.def("build_info", []() {
    nb::dict d;
#ifdef JAX_SGL_CUDA_ARCHS_BUILT
    d["cuda_archs"] = std::string(JAX_SGL_CUDA_ARCHS_BUILT);
#else
    d["cuda_archs"] = std::string();
#endif
#ifdef JAX_SGL_SM90_NO_CUTE
    d["sm90_no_cute"] = true;
#else
    d["sm90_no_cute"] = false;
#endif
    return d;
  });
  // The CUDA attention kernels in this build (jax_sgl.attention_backend_info()), as
  // space-separated text: "portable" its head-dim capacities (" 64 128"), "sm90_fwd",
  // "sm90_bwd", "sm100_fwd" and "sm100_bwd" their (head dim, dtype) instantiations
  // (" hdim128_bf16"); empty when absent.
  m.def("attention_kernels", []() {
    nb::dict d;
    d["portable"] = std::string();
    d["sm90_fwd"] = std::string();
    d["sm90_bwd"] = std::string();
    d["sm100_fwd"] = std::string();
    d["sm100_bwd"] = std::string();
#ifdef JAX_SGL_HAVE_CUDA
    d["portable"] = std::string(jax_sgl::cuda::PortableBuiltHeadDims());
#endif
#ifdef JAX_SGL_HAVE_SM90
    d["sm90_fwd"] = std::string(jax_sgl::cuda::Sm90BuiltKernels());
    d["sm90_bwd"] = std::string(jax_sgl::cuda::Sm90BwdBuiltKernels());
#endif
#ifdef JAX_SGL_HAVE_SM100
    d["sm100_fwd"] = std::string(jax_sgl::cuda::Sm100FwdBuiltKernels());
    d["sm100_bwd"] = std::string(jax_sgl::cuda::Sm100BwdBuiltKernels());
#endif
    return d;
  });
#ifdef JAX_SGL_HAVE_CUDA
  // Which CUDA kernel an attention call would run on a device of the given compute capability
  // (jax_sgl/_plan.py): operands are (dims, dtype name) of the forward's eleven operands, out and
  // lse, as the lowered call carries them.
  m.def("attention_plan",
        [](bool backward, const std::vector<std::pair<std::vector<int64_t>, std::string>>& operands,
           const nb::dict& attrs, int cc_major, int cc_minor, int num_sms) {
          std::vector<jax_sgl::cuda::ProbeOperand> ops;
          for (const auto& [dims, dtype] : operands) ops.push_back({dims, dtype});
          return jax_sgl::cuda::ProbeAttentionKernel(backward, ops, ToAttentionAttrs(attrs),
                                                     {cc_major, cc_minor, num_sms});
        });
#endif
}
