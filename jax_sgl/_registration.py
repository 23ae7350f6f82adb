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
          "bwd_deterministic": os.environ.get("JAX_SGL_BWD_DETERMINISTIC") in ("1", "sm80")}


def native_platforms(target: str) -> tuple[str, ...]:
  """The lowering platforms ("cpu", "cuda") that have a native handler for `target`."""
  platforms = []
  if target in CPU_TARGETS:
    platforms.append("cpu")
  if target in CUDA_TARGETS:
    platforms.append("cuda")
  return tuple(platforms)
