"""Loads the native extension (jax_sgl._native) and registers its FFI handlers with XLA.

The "cpu" handlers are always built. The "CUDA" handlers exist when the extension was compiled
with nvcc; `cuda_targets()` then names them and they are registered for the CUDA platform.
"""

from __future__ import annotations

import os

import jax

from jax_sgl import _native as _ext  # type: ignore[attr-defined]

CPU_TARGETS: frozenset[str] = frozenset(_ext.cpu_targets())
CUDA_TARGETS: frozenset[str] = frozenset(_ext.cuda_targets())

for _name, _capsule in _ext.cpu_targets().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
for _name, _capsule in _ext.cuda_targets().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def attention_backend_info() -> dict:
  """Which CUDA attention kernels this build holds and would use, so benchmarks can name them.

  sm90_kernels: the sm_90a (Hopper wgmma + TMA) instantiations compiled in, e.g.
  ("hdim128_bf16",). sm90_mode: JAX_SGL_SM90 as the CUDA handler reads it at every call:
  "verified" (unset: the instantiations verified on a GPU, hdim128_bf16, serve the dense calls
  they cover on a compute-capability-9.0 device), "all" (=1: every built instantiation) or "off"
  (=0). Everything else runs on the portable sm80 kernel.
  """
  env = os.environ.get("JAX_SGL_SM90")
  mode = {"0": "off", "1": "all"}.get(env, "verified")
  return {"sm90_kernels": tuple(_ext.sm90_attention_kernels().split()), "sm90_mode": mode}


def native_platforms(target: str) -> tuple[str, ...]:
  """The lowering platforms ("cpu", "cuda") that have a native handler for `target`."""
  platforms = []
  if target in CPU_TARGETS:
    platforms.append("cpu")
  if target in CUDA_TARGETS:
    platforms.append("cuda")
  return tuple(platforms)
