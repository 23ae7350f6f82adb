"""Loads the native extension (jax_sgl._native) and registers its FFI handlers with XLA.

The "cpu" handlers are always built. The "CUDA" handlers exist when the extension was compiled
with nvcc; `cuda_targets()` then names them and they are registered for the CUDA platform.
"""

from __future__ import annotations

import jax

from jax_sgl import _native as _ext  # type: ignore[attr-defined]

CPU_TARGETS: frozenset[str] = frozenset(_ext.cpu_targets())
CUDA_TARGETS: frozenset[str] = frozenset(_ext.cuda_targets())

for _name, _capsule in _ext.cpu_targets().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
for _name, _capsule in _ext.cuda_targets().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def native_platforms(target: str) -> tuple[str, ...]:
  """The lowering platforms ("cpu", "cuda") that have a native handler for `target`."""
  platforms = []
  if target in CPU_TARGETS:
    platforms.append("cpu")
  if target in CUDA_TARGETS:
    platforms.append("cuda")
  return tuple(platforms)
