"""PEP 517 build backend of jax_sgl: scikit-build-core, plus the build requirements of CUDA builds.

Which requirements a build needs depends on the machine, which a static `build-system.requires`
cannot say: an isolated `pip install .` on a machine with nvcc must still see the CuTe headers
(nvidia-cutlass), or the Hopper kernels would be silently left out, and the toolkit-free build
(`JAX_SGL_CUDA=pip`) needs nvcc, CCCL and the static cudart from PyPI. Everything else is
scikit-build-core's, unchanged. CMakeLists.txt looks for nvcc by the same rule as `_system_nvcc`.
"""

from __future__ import annotations

import os
import shutil

from scikit_build_core import build as _skbuild
from scikit_build_core.build import (  # noqa: F401  (the rest of the PEP 517 interface)
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

# The CuTe / CUTLASS release the sm90 and sm100 kernels are built with (headers only; the
# package's Python deps come along, the build never imports it).
CUTLASS = "nvidia-cutlass==4.2.0.0"
# The toolkit of the development and GPU machines (nvcc 13.0), as wheels: every piece pinned
# through cuda-toolkit's extras, so nvcc, cicc, the CRT headers and cudart cannot drift apart.
PIP_TOOLKIT = "cuda-toolkit[nvcc,nvvm,crt,cudart,cccl]==13.0.2"


def _setting(name: str, config_settings, default: str) -> str:
  """A build setting: `-Ccmake.define.NAME=...` first, then the environment."""
  value = (config_settings or {}).get(f"cmake.define.{name}")
  if isinstance(value, list):
    value = value[-1] if value else None
  return str(value) if value is not None else os.environ.get(name, default)


def _system_nvcc() -> str | None:
  """nvcc as CMakeLists.txt finds it: CUDACXX, PATH, CUDA_HOME / CUDA_PATH, /usr/local/cuda."""
  if os.environ.get("CUDACXX"):
    return os.environ["CUDACXX"]
  found = shutil.which("nvcc")
  if found:
    return found
  for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
    if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
      return os.path.join(root, "bin", "nvcc")
  return None


def cuda_requires(config_settings=None) -> list[str]:
  """What a build with these settings needs beyond scikit-build-core and nanobind."""
  archs = _setting("JAX_SGL_CUDA_ARCHS", config_settings, "80;90a;100a")
  mode = _setting("JAX_SGL_CUDA", config_settings, "auto").lower()
  if archs.upper() == "OFF" or mode == "off":
    return []
  if mode == "pip":
    requires = [PIP_TOOLKIT]
  elif mode == "auto":
    if _system_nvcc() is None:
      return []
    requires = []
  else:
    raise ValueError(f"JAX_SGL_CUDA must be auto, pip or off, got {mode!r}")
  # The Hopper kernels use CuTe; the Blackwell ones CUTLASS's FMHA collectives, which ship in the
  # same wheel (cutlass_library/source/examples/77_blackwell_fmha).
  cute_archs = {"90a", "100a"} & set(archs.split(";"))
  if cute_archs and not _setting("JAX_SGL_CUTLASS_INCLUDE_DIR", config_settings, ""):
    requires.append(CUTLASS)
  return requires


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
  return _skbuild.get_requires_for_build_wheel(config_settings) + cuda_requires(config_settings)


def get_requires_for_build_editable(config_settings=None) -> list[str]:
  return _skbuild.get_requires_for_build_editable(config_settings) + cuda_requires(
      config_settings)
