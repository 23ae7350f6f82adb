"""nanobind extension modules of jax_sgl, from a list of ffi/sources.json."""

load("@jax_sgl_config//:sources.bzl", "SOURCES")

def nanobind_module(name, sources, deps = [], **kwargs):
    """A Python extension module `<name>.so` built from SOURCES[sources] with SOURCES[sources +
    "_copts"], nanobind linked in; every symbol but the module's init function hidden, as
    nanobind's CMake does."""
    native.cc_binary(
        name = name + ".so",
        srcs = ["@jax_sgl_src//:" + path for path in SOURCES[sources]],
        copts = SOURCES[sources + "_copts"] + ["-fvisibility=hidden"],
        linkopts = ["-lpthread"],
        linkshared = True,
        deps = deps + [
            "@jax_sgl_config//:nanobind",
            "@jax_sgl_src//:headers",
        ],
        **kwargs
    )
