// jax_sgl._native: hands the FFI handlers to Python as capsules. jax_sgl/_registration.py registers the
// "cpu" ones always and the "cuda" ones when the extension was built with CUDA.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

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

namespace jax_sgl::cuda {
#ifdef JAX_SGL_HAVE_CUDA
const char* PortableBuiltHeadDims();  // ffi/cuda/attention/fwd_dispatch.cc
#endif
#ifdef JAX_SGL_HAVE_SM90
const char* Sm90BuiltKernels();     // ffi/cuda/attention/sm90/fwd/dispatch.cc
const char* Sm90BwdBuiltKernels();  // ffi/cuda/attention/sm90/bwd/dispatch.cc
#endif
#ifdef JAX_SGL_HAVE_SM100
const char* Sm100BwdBuiltKernels();  // ffi/cuda/attention/sm100/bwd/dispatch.cc
#endif
}  // namespace jax_sgl::cuda

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

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
  // space-separated text: "portable" its head-dim capacities (" 64 128"), "sm90_fwd" and
  // "sm90_bwd", "sm100_bwd" their (head dim, dtype) instantiations (" hdim128_bf16"); empty when
  // absent.
  m.def("attention_kernels", []() {
    nb::dict d;
    d["portable"] = std::string();
    d["sm90_fwd"] = std::string();
    d["sm90_bwd"] = std::string();
    d["sm100_bwd"] = std::string();
#ifdef JAX_SGL_HAVE_CUDA
    d["portable"] = std::string(jax_sgl::cuda::PortableBuiltHeadDims());
#endif
#ifdef JAX_SGL_HAVE_SM90
    d["sm90_fwd"] = std::string(jax_sgl::cuda::Sm90BuiltKernels());
    d["sm90_bwd"] = std::string(jax_sgl::cuda::Sm90BwdBuiltKernels());
#endif
#ifdef JAX_SGL_HAVE_SM100
    d["sm100_bwd"] = std::string(jax_sgl::cuda::Sm100BwdBuiltKernels());
#endif
    return d;
  });
}
