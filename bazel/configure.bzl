"""The repository rule that finds what the build takes from outside the tree, offline.

It asks the build's Python (PYTHON_BIN_PATH, else python3 on PATH) for its headers and for
nanobind's and the CuTe headers (nvidia-cutlass, or JAX_SGL_CUTLASS_INCLUDE_DIR); finds nvcc by
CMake's rule (cmake/find_nvcc.cmake: CUDACXX, PATH, CUDA_HOME / CUDA_PATH, /usr/local/cuda; none,
or JAX_SGL_CUDA_ARCHS=OFF: a CPU build); reads ffi/sources.json and
ffi/cuda/attention/instantiations.json, the lists CMake reads too, and trims the instantiations by
the same settings (JAX_SGL_CUDA_ARCHS, JAX_SGL_ATTN_HEAD_DIMS, JAX_SGL_SM90_HEAD_DIMS,
JAX_SGL_SM90_DTYPES, passed as --repo_env). It generates @jax_sgl_config with:
  //:python         the Python headers
  //:nanobind       nanobind's sources, built into the module (NB_STATIC, as CMake does)
  //:cuda_runtime   cuda_runtime.h and the static cudart of nvcc's toolkit (CUDA builds)
  //:cutlass        the CuTe / CUTLASS headers (sm90 builds)
  sources.bzl       SOURCES (ffi/sources.json); CUDA: nvcc, its flags, the archs, the
                    instantiation files of each family and the guards of those left out
"""

_FIND = """
import importlib.util, json, os, sysconfig
import nanobind
cutlass = os.environ.get("JAX_SGL_CUTLASS_INCLUDE_DIR", "")
spec = None if cutlass else importlib.util.find_spec("cutlass_library")
if spec:
    cutlass = os.path.join(spec.submodule_search_locations[0], "source", "include")
print(json.dumps({
    "python_include": sysconfig.get_paths()["include"],
    "nanobind": os.path.dirname(nanobind.include_dir()),
    "suffix": sysconfig.get_config_var("EXT_SUFFIX"),
    "cutlass": cutlass if os.path.exists(os.path.join(cutlass, "cute", "tensor.hpp")) else "",
}))
"""

_NANOBIND_SRCS = [
    "nb_internals.cpp",
    "nb_func.cpp",
    "nb_type.cpp",
    "nb_enum.cpp",
    "nb_ndarray.cpp",
    "nb_static_property.cpp",
    "nb_datetime.cpp",
    "common.cpp",
    "error.cpp",
    "trampoline.cpp",
    "implicit.cpp",
]

def _python(ctx):
    python = ctx.os.environ.get("PYTHON_BIN_PATH") or ctx.which("python3")
    if not python:
        fail("jax_sgl: no python3 on PATH; pass --repo_env=PYTHON_BIN_PATH=/path/to/python")
    return python

def _nvcc(ctx):
    """nvcc by cmake/find_nvcc.cmake's rule, or None."""
    env = ctx.os.environ
    if env.get("CUDACXX"):
        return env["CUDACXX"]
    found = ctx.which("nvcc")
    if found:
        return str(found)
    for root in [env.get("CUDA_HOME"), env.get("CUDA_PATH"), "/usr/local/cuda"]:
        if root and ctx.path(root + "/bin/nvcc").exists:
            return root + "/bin/nvcc"
    return None

def _setting(ctx, name, default):
    return [x for x in ctx.os.environ.get(name, default).split(";") if x]

def _instantiations(inst, family, dims, dtypes):
    """The files of `family` for the wanted (head dim, dtype) pairs and the guards of the pairs
    left out (cmake/cuda.cmake's jax_sgl_instantiations)."""
    fam = inst["families"][family]
    files, built, guards = [], {}, []
    for kind, kind_dims in fam["kinds"].items():
        for d in kind_dims:
            for t in inst.get("kind_dtypes", {}).get(kind, inst["dtypes"]):
                guard = fam["guard"].replace("{d}", str(d)).replace("{DTYPE}", t.upper())
                if guard not in guards:
                    guards.append(guard)
                if str(d) in dims and t in dtypes:
                    files.append("ffi/cuda/attention/instantiations/%s_hdim%d_%s.cu" % (kind, d, t))
                    built[guard] = True
    return files, [g for g in guards if g not in built]

def _cuda(ctx, sources, cutlass):
    """The CUDA part of sources.bzl, and its BUILD targets; None, "" for a CPU build."""
    archs = _setting(ctx, "JAX_SGL_CUDA_ARCHS", "80;90a;100a")
    nvcc = None if archs == ["OFF"] else _nvcc(ctx)
    if not nvcc:
        return None, ""
    # The toolkit nvcc really runs from (nvcc may be a wrapper script): its profile's TOP.
    dry = ctx.execute([nvcc, "--dryrun", "-E", "-x", "cu", "/dev/null"])
    tops = [l.split("=", 1)[1] for l in (dry.stdout + dry.stderr).splitlines()
            if l.startswith("#$ TOP=")]
    if not tops:
        fail("jax_sgl: cannot tell where %s's toolkit is:\n%s" % (nvcc, dry.stderr))
    root = ctx.path(tops[0])
    ctx.symlink(root.get_child("include"), "cuda/include")
    lib = [d for d in ["lib64", "lib"] if root.get_child(d).get_child("libcudart_static.a").exists]
    if not lib:
        fail("jax_sgl: no libcudart_static.a next to " + nvcc)
    ctx.symlink(root.get_child(lib[0]).get_child("libcudart_static.a"), "cuda/libcudart_static.a")
    inst = json.decode(ctx.read(ctx.path(Label(
        "@jax_sgl_src//:ffi/cuda/attention/instantiations.json"))))
    sm80, sm80_guards = _instantiations(
        inst, "sm80", _setting(ctx, "JAX_SGL_ATTN_HEAD_DIMS", "64;96;128;192;256"), ["bf16", "fp16"])
    sm90_dims = _setting(ctx, "JAX_SGL_SM90_HEAD_DIMS", "64;96;128;192;256")
    sm90, sm90_guards = [], []
    if "90a" in archs and cutlass and sm90_dims:
        sm90, sm90_guards = _instantiations(inst, "sm90", sm90_dims,
                                            _setting(ctx, "JAX_SGL_SM90_DTYPES", "bf16;fp16;e4m3"))
    # The sm100 family of instantiations.json (Blackwell, on the nvidia-cutlass wheel's
    # 77_blackwell_fmha collectives, which //:cutlass does not carry) is not built by Bazel: without
    # JAX_SGL_HAVE_SM100 the dispatch compiles it out and compute capability 10.0 devices run the
    # portable kernels. The pip / CMake build (cmake/cuda.cmake) builds it.
    cuda = {
        "nvcc": nvcc,
        "archs": archs,
        # CMake's Release CUDA flags, then the project's (ffi/sources.json).
        "copts": ["-O3", "-DNDEBUG", "-std=c++17"] + sources["cuda_copts"],
        "includes": ["-Iexternal/jax_sgl_src", "-Iexternal/jax_sgl_src/third_party/xla_ffi/include",
                     "-Iexternal/jax_sgl_config/cutlass"],
        "sm80_instantiations": sm80,
        "sm90_instantiations": sm90,
        "guards": sm80_guards + sm90_guards,
        "sm90": len(sm90) > 0,
    }
    build = """
cc_library(
    name = "cuda_runtime",
    srcs = ["cuda/libcudart_static.a"],
    hdrs = glob(["cuda/include/**/*.h", "cuda/include/**/*.hpp"]),
    includes = ["cuda/include"],
    linkopts = ["-ldl", "-lrt", "-lpthread"],
)

filegroup(
    name = "cutlass",
    srcs = glob(["cutlass/**/*.h", "cutlass/**/*.hpp", "cutlass/**/*.inl"]),
)
"""
    return cuda, build

def _impl(ctx):
    result = ctx.execute([_python(ctx), "-c", _FIND], environment = {
        "JAX_SGL_CUTLASS_INCLUDE_DIR": ctx.os.environ.get("JAX_SGL_CUTLASS_INCLUDE_DIR", ""),
    })
    if result.return_code != 0:
        fail("jax_sgl: the build's Python must have nanobind (pip install nanobind):\n" +
             result.stderr)
    found = json.decode(result.stdout)
    ctx.symlink(found["python_include"], "python_include")
    ctx.symlink(found["nanobind"], "nanobind")

    if found["cutlass"]:
        ctx.symlink(found["cutlass"], "cutlass")
    sources = json.decode(ctx.read(ctx.path(Label("@jax_sgl_src//:ffi/sources.json"))))
    cuda, cuda_build = _cuda(ctx, sources, found["cutlass"])
    ctx.file("sources.bzl", "\n".join([
        '"""Generated by jax_sgl_configure (bazel/configure.bzl) from ffi/sources.json."""',
        "SOURCES = " + repr(sources),
        "CUDA = " + repr(cuda),
        "EXTENSION_SUFFIX = %r" % found["suffix"],
        "",
    ]))

    ctx.file("BUILD", """package(default_visibility = ["//visibility:public"])

exports_files(["sources.bzl"])

cc_library(
    name = "python",
    hdrs = glob(["python_include/**/*.h"]),
    includes = ["python_include"],
)

# nanobind's runtime, linked into each module as CMake's NB_STATIC does.
cc_library(
    name = "nanobind",
    srcs = [{srcs}],
    hdrs = glob(["nanobind/include/**/*.h", "nanobind/src/*.h",
                 "nanobind/ext/robin_map/include/**/*.h"]),
    includes = ["nanobind/include", "nanobind/ext/robin_map/include"],
    copts = ["-fvisibility=hidden", "-fno-strict-aliasing", "-O3"],
    local_defines = ["NB_BUILD", "NB_COMPACT_ASSERTIONS"],
    deps = [":python"],
    alwayslink = True,
)
""".format(srcs = ", ".join(['"nanobind/src/%s"' % s for s in _NANOBIND_SRCS])) + cuda_build)

jax_sgl_configure = repository_rule(
    implementation = _impl,
    environ = [
        "PYTHON_BIN_PATH",
        "PATH",
        "CUDACXX",
        "CUDA_HOME",
        "CUDA_PATH",
        "JAX_SGL_CUDA_ARCHS",
        "JAX_SGL_ATTN_HEAD_DIMS",
        "JAX_SGL_SM90_HEAD_DIMS",
        "JAX_SGL_SM90_DTYPES",
        "JAX_SGL_CUTLASS_INCLUDE_DIR",
    ],
    local = True,
)
