"""CUDA objects for the Bazel build: nvcc run by a genrule per source, as CMake's CUDA language
does, with the flags and archs of ffi/sources.json; the objects join a cc_library."""

load("@jax_sgl_config//:sources.bzl", "CUDA")

def gencode(archs):
    """nvcc's -gencode flags for CMake-style archs: SASS for each, PTX only for plain ones (an
    arch-specific target's PTX runs only where its SASS already does); cmake/cuda.cmake's rule."""
    flags = []
    for arch in archs:
        code = "sm_" + arch if arch.endswith("a") else "[sm_%s,compute_%s]" % (arch, arch)
        flags.append("-gencode=arch=compute_%s,code=%s" % (arch, code))
    return flags

def cuda_objects(name, srcs, archs, copts = [], defines = [], hdrs = []):
    """cc_library `name` of the objects of `srcs` (labels of .cu files), each compiled by nvcc for
    `archs` with `copts` and `defines`; `hdrs` are the headers they may include."""
    objs = []
    for src in srcs:
        stem = src.split(":")[-1].replace("/", "_").replace(".cu", "")
        out = "%s_objs/%s.o" % (name, stem)
        native.genrule(
            name = "%s_%s" % (name, stem),
            srcs = [src] + hdrs,
            outs = [out],
            # -objtemp: nvcc's temporary file names would collide between sandboxed actions.
            cmd = " ".join([CUDA["nvcc"], "-c", "-objtemp", "-Xcompiler=-fPIC"] +
                           CUDA["includes"] + gencode(archs) + CUDA["copts"] + copts +
                           ["-D" + d for d in defines] + ["$(location %s)" % src, "-o", "$@"]),
            message = "nvcc %s" % src.split(":")[-1],
        )
        objs.append(out)
    native.cc_library(name = name, srcs = objs, alwayslink = True, linkstatic = True)
