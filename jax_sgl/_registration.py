"""Loads the native extension (jax_sgl._native) and registers its FFI handlers with XLA.

The "cpu" handlers are always built. The "CUDA" handlers exist when the extension was compiled
with nvcc; `cuda_targets()` then names them and they are registered for the CUDA platform.
"""

from __future__ import annotations

import os
import re
import warnings

import jax

# The oldest jax whose XLA FFI accepts the handlers: they are built against jaxlib 0.10's headers
# (third_party/xla_ffi), which every later jaxlib accepts. Older ones would refuse to register
# them and break every JAX program of the process, so importing jax_sgl stops first.
_MIN_JAX = (0, 10)
if tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:2]) < _MIN_JAX:
  raise ImportError(f"jax_sgl supports jax >= {'.'.join(map(str, _MIN_JAX))} (tested 0.10-0.12); "
                    f"this environment has jax {jax.__version__}: pip install 'jax>=0.10'")

from jax_sgl import _native as _ext  # type: ignore[attr-defined]  # noqa: E402

CPU_TARGETS: frozenset[str] = frozenset(_ext.cpu_targets())
CUDA_TARGETS: frozenset[str] = frozenset(_ext.cuda_targets())

for _name, _capsule in _ext.cpu_targets().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
for _name, _capsule in _ext.cuda_targets().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def attention_backend_info() -> dict:
  """Which CUDA attention kernels this build holds and would use, so benchmarks can name them.

  sm90_kernels: the sm_90a (Hopper wgmma + TMA) instantiations compiled in, each (head dim,
  dtype), e.g. ("hdim128_bf16",). sm90_mode: JAX_SGL_SM90 as the CUDA handler reads it at every
  call: "on"
  (unset or anything but "0": the built instantiations serve the dense calls they cover on a
  compute-capability-9.0 device) or "off" (=0). Everything else runs on the portable sm80 kernel.
  cuda_bwd_kernel: the CUDA backward kernel is compiled in. cuda_bwd_mode: "on" unless
  JAX_SGL_CUDA_BWD=0, which lowers gradients traced from then on to the vjp of the pure-JAX
  reference instead of the kernel (float16/bfloat16, head dims up to 128).
  sm90_bwd_kernels: the sm_90a backward instantiations compiled in ("hdim128_bf16", ...).
  sm90_bwd_mode: JAX_SGL_SM90_BWD
  as the backward handler reads it at every call: "on" (unset or anything but "0": every built
  instantiation) or "off" (=0); the sm90 backward serves dense calls
  (seqused_k, causal, windows and softcap included) at head dims 64 / 128 on a 9.0 device, the
  sm80 backward everything else.
  bwd_deterministic: JAX_SGL_BWD_DETERMINISTIC is set (=1: the sm90 backward computes dQ with
  its atomic-free dQ kernel, =sm80: with the sm80 one; either way bitwise reproducible).
  """
  mode = "off" if os.environ.get("JAX_SGL_SM90") == "0" else "on"
  return {"sm90_kernels": tuple(_ext.sm90_attention_kernels().split()), "sm90_mode": mode,
          "cuda_bwd_kernel": "jax_sgl_attention_bwd" in CUDA_TARGETS,
          "cuda_bwd_mode": "off" if os.environ.get("JAX_SGL_CUDA_BWD") == "0" else "on",
          "sm90_bwd_kernels": tuple(_ext.sm90_attention_bwd_kernels().split()),
          "sm90_bwd_mode": "off" if os.environ.get("JAX_SGL_SM90_BWD") == "0" else "on",
          "bwd_deterministic": os.environ.get("JAX_SGL_BWD_DETERMINISTIC") in ("1", "sm80"),
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
  if not CUDA_TARGETS or _ext.sm90_attention_kernels():
    return None
  build = _ext.build_info()
  if build["sm90_no_cute"]:
    return ("built without the CuTe headers: reinstall with nvcc on PATH (the build then pulls "
            "nvidia-cutlass itself) or with JAX_SGL_CUTLASS_INCLUDE_DIR pointing at them")
  if "90a" not in build["cuda_archs"].split(","):
    return (f"built for CUDA archs {build['cuda_archs']!r} without 90a: reinstall with "
            "JAX_SGL_CUDA_ARCHS including 90a")
  return "trimmed out of this build (JAX_SGL_SM90_HEAD_DIMS is empty)"


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
