"""nanobind extension modules of jax_sgl, from the lists of ffi/sources.json."""

load("@jax_sgl_config//:sources.bzl", "CUDA", "SOURCES")
load("//:cuda.bzl", "cuda_objects")

def _labels(paths):
    return ["@jax_sgl_src//:" + path for path in paths]

def nanobind_module(name, sources, srcs = [], deps = [], local_defines = []):
    """A Python extension module `<name>.so` built from SOURCES[sources] (plus `srcs`) with
    SOURCES[sources + "_copts"], nanobind linked in; every symbol but the module's init function
    hidden, as nanobind's CMake does."""
    native.cc_binary(
        name = name + ".so",
        srcs = _labels(SOURCES[sources]) + srcs,
        copts = SOURCES[sources + "_copts"] + ["-fvisibility=hidden"],
        local_defines = local_defines,
        linkopts = ["-lpthread"],
        linkshared = True,
        deps = deps + [
            "@jax_sgl_config//:nanobind",
            "@jax_sgl_src//:headers",
        ],
    )

def native_module(name):
    """jax_sgl/_native: the CPU handlers, and the CUDA ones when the configure rule found nvcc,
    with the sources, flags, macros and instantiations of cmake/cuda.cmake."""
    if not CUDA:
        nanobind_module(name = name, sources = "native")
        return
    defines = ["JAX_SGL_HAVE_CUDA=1"] + CUDA["guards"]
    cc_srcs = [s for s in SOURCES["cuda"] if s.endswith(".cc")]
    cu_srcs = [s for s in SOURCES["cuda"] if s.endswith(".cu")]
    cuda_objects(
        name = "cuda_kernels",
        srcs = _labels(cu_srcs + CUDA["sm80_instantiations"]),
        archs = CUDA["archs"],
        defines = defines,
        hdrs = ["@jax_sgl_src//:all_headers"],
    )
    deps = [":cuda_kernels", "@jax_sgl_config//:cuda_runtime"]
    if CUDA["sm90"]:
        # Its own objects, for sm_90a alone, as CMake's jax_sgl_sm90 object library.
        cuda_objects(
            name = "sm90_kernels",
            srcs = _labels(CUDA["sm90_instantiations"]),
            archs = ["90a"],
            defines = SOURCES["sm90_defines"],
            hdrs = ["@jax_sgl_src//:all_headers", "@jax_sgl_config//:cutlass"],
        )
        deps.append(":sm90_kernels")
        cc_srcs += SOURCES["sm90"]
        defines.append("JAX_SGL_HAVE_SM90=1")
    elif "90a" in CUDA["archs"]:
        defines.append("JAX_SGL_SM90_NO_CUTE=1")
    nanobind_module(
        name = name,
        sources = "native",
        srcs = _labels(cc_srcs),
        deps = deps,
        # Bazel tokenizes defines as a shell would: the quotes of the string literal are escaped.
        local_defines = defines + ['JAX_SGL_CUDA_ARCHS_BUILT=\\"%s\\"' % ",".join(CUDA["archs"])],
    )
