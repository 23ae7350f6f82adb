"""Loads the native extension (jax_sgl._native) and registers its FFI handlers with XLA.

The "cpu" handlers are always built. The "CUDA" handlers exist when the extension was compiled
with nvcc; `cuda_targets()` then names them and they are registered for the CUDA platform.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp

# The oldest jax whose XLA FFI accepts the handlers: they are built against jaxlib 0.10's headers
# (third_party/xla_ffi), which every later jaxlib accepts. Older ones would refuse to register
# them and break every JAX program of the process, so importing jax_sgl stops first.
_MIN_JAX = (0, 10)
if tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:2]) < _MIN_JAX:
  raise ImportError(f"jax_sgl supports jax >= {'.'.join(map(str, _MIN_JAX))} (tested 0.10-0.12); "
                    f"this environment has jax {jax.__version__}: pip install 'jax>=0.10'")

from jax_sgl import _disable  # noqa: E402
from jax_sgl._checks import CUDA_FP8_HEAD_DIM_CAPACITIES  # noqa: E402
from jax_sgl import _native as _ext  # type: ignore[attr-defined]  # noqa: E402

CPU_TARGETS: frozenset[str] = frozenset(_ext.cpu_targets())
CUDA_TARGETS: frozenset[str] = frozenset(_ext.cuda_targets())

for _name, _capsule in _ext.cpu_targets().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
for _name, _capsule in _ext.cuda_targets().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


# Native dtype names of the sm90 kernel list (ffi/cuda/attention/sm90/kernel_list.h).
_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "e4m3": "float8_e4m3fn"}


def _instantiations(text: str) -> dict:
  """" hdim128_bf16 hdim64_fp16" -> {"head_dims": [64, 128], "dtypes": ["bfloat16", "float16"]}."""
  pairs = [name.removeprefix("hdim").split("_") for name in text.split()]
  return {"head_dims": sorted({int(d) for d, _ in pairs}),
          "dtypes": sorted({_DTYPE_NAMES.get(t, t) for _, t in pairs})}


def attention_backend_info() -> dict:
  """What this build's CUDA attention holds and what is turned off, for a user to read.

  cuda: the CUDA handlers are built. kernels: per family, the head dims and dtypes compiled in:
  "portable" (mma.sync, any GPU from sm80; a call runs on the smallest head-dim capacity >= its
  head dim), "portable_fp8" (the same kernel over float8_e4m3fn operands, computing in the dtypes
  listed; head-dim capacities 64, 128, 256), "sm90_fwd" and "sm90_bwd" (Hopper wgmma + TMA,
  compute capability 9.0; other calls fall back to the portable kernels), "sm100_fwd" and
  "sm100_bwd" (Blackwell tcgen05 + TMEM + TMA on CUTLASS's FMHA collectives, compute capability
  10.0; compiled, not yet run on Blackwell); empty without CUDA. disabled: the families
  JAX_SGL_DISABLE names now (they apply to calls lowered from then on). sm90_absent: why a CUDA
  build has no sm90 kernels, or None.
  """
  kernels = {}
  if CUDA_TARGETS:
    built = _ext.attention_kernels()
    portable = [int(d) for d in built["portable"].split()]
    kernels = {"portable": {"head_dims": portable, "dtypes": ["bfloat16", "float16"]},
               "portable_fp8": {"head_dims": [d for d in portable
                                              if d in CUDA_FP8_HEAD_DIM_CAPACITIES],
                                "dtypes": ["bfloat16", "float16"]},
               "sm90_fwd": _instantiations(built["sm90_fwd"]),
               "sm90_bwd": _instantiations(built["sm90_bwd"]),
               "sm100_fwd": _instantiations(built.get("sm100_fwd", "")),
               "sm100_bwd": _instantiations(built.get("sm100_bwd", ""))}
  return {"cuda": bool(CUDA_TARGETS), "kernels": kernels, "disabled": sorted(_disable.disabled()),
          "sm90_absent": sm90_absent_reason()}


def native_platforms(target: str) -> tuple[str, ...]:
  """The lowering platforms ("cpu", "cuda") that have a native handler for `target`."""
  platforms = []
  if target in CPU_TARGETS:
    platforms.append("cpu")
  if target in CUDA_TARGETS:
    platforms.append("cuda")
  return tuple(platforms)


def sm90_absent_reason() -> str | None:
  """Why this CUDA build holds no Hopper (sm_90a) attention kernels, or None when it does (or
  when it has no CUDA at all, which CUDA_TARGETS says)."""
  if not CUDA_TARGETS or _ext.attention_kernels()["sm90_fwd"]:
    return None
  build = _ext.build_info()
  if build["sm90_no_cute"]:
    return ("built without the CuTe headers: reinstall with nvcc on PATH (the build then pulls "
            "nvidia-cutlass itself) or with JAX_SGL_CUTLASS_INCLUDE_DIR pointing at them")
  if "90a" not in build["cuda_archs"].split(","):
    return (f"built for CUDA archs {build['cuda_archs']!r} without 90a: reinstall with "
            "JAX_SGL_CUDA_ARCHS including 90a")
  return "trimmed out of this build (JAX_SGL_SM90_HEAD_DIMS is empty)"


def _sm90_built(family: str, head_dim: int, dtype) -> bool:
  """Whether this build holds the sm90 `family` ("sm90_fwd", "sm90_bwd") kernel for exactly
  (head_dim, dtype)."""
  if not CUDA_TARGETS:
    return False
  pairs = [name.removeprefix("hdim").split("_") for name in
           _ext.attention_kernels()[family].split()]
  return any(int(d) == head_dim and _DTYPE_NAMES.get(t, t) == jnp.dtype(dtype).name
             for d, t in pairs)


def sm90_fwd_built(head_dim: int, dtype) -> bool:
  """Whether this build holds the sm90 forward for exactly (head_dim, dtype)."""
  return _sm90_built("sm90_fwd", head_dim, dtype)


def sm90_bwd_built(head_dim: int, dtype) -> bool:
  """Whether this build holds the sm90 backward for exactly (head_dim, dtype)."""
  return _sm90_built("sm90_bwd", head_dim, dtype)


def local_cuda_devices_are_hopper() -> bool:
  """Whether this process has CUDA devices and all of them are compute capability 9.0."""
  try:
    devices = jax.devices("cuda")
  except RuntimeError:  # no CUDA backend in this process (e.g. exporting for CUDA from a CPU)
    return False
  return bool(devices) and all(getattr(d, "compute_capability", None) == "9.0" for d in devices)


_sm90_warned = False


def warn_if_sm90_absent() -> None:
  """Once per process: the call is lowered for a Hopper GPU that this build has no sm_90a kernels
  for, so it runs on the portable kernels at a fraction of the speed."""
  global _sm90_warned
  if _sm90_warned:
    return
  _sm90_warned = True
  reason = sm90_absent_reason()
  if reason is None:
    return
  try:
    hopper = any(getattr(d, "compute_capability", None) == "9.0" for d in jax.devices("cuda"))
  except RuntimeError:  # no CUDA backend in this process (e.g. exporting for CUDA from a CPU)
    hopper = False
  if hopper:
    warnings.warn(f"jax_sgl: the Hopper attention kernels are not in this build ({reason}); "
                  "attention runs on the portable CUDA kernels, about 3x slower on this GPU",
                  RuntimeWarning, stacklevel=3)
