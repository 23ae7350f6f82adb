"""What every jax_sgl primitive needs besides its own rules: per-platform lowering to the native
FFI target where one was built, and to the pure-JAX reference elsewhere with a one-time warning
naming the platform (the library works everywhere and says where it is slow).
"""

from __future__ import annotations

import warnings
from typing import Callable

import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_sgl._registration import native_platforms

_warned: set[tuple[str, str]] = set()


def warn_reference_once(target: str, platform: str, why: str | None = None) -> None:
  """The one-time warning that `target` lowers to the pure-JAX reference on `platform`."""
  if (target, platform) in _warned:
    return
  _warned.add((target, platform))
  reason = why or f"no native {target} kernel for platform {platform!r}"
  warnings.warn(f"jax_sgl: {reason}; using the pure-JAX reference lowering of {target}, which "
                "is correct but slow", RuntimeWarning, stacklevel=3)


def register_lowerings(prim: Primitive, target: str, native_rule: Callable,
                       reference_impl: Callable) -> None:
  """native_rule(ctx, *args, **params) lowers to the FFI target; reference_impl(*args, **params)
  is traced with lower_fun on every other platform."""
  reference_rule = mlir.lower_fun(reference_impl, multiple_results=prim.multiple_results)

  def fallback(ctx, *args, **params):
    platform = ctx.module_context.platforms[0] if ctx.module_context.platforms else "unknown"
    warn_reference_once(target, platform)
    return reference_rule(ctx, *args, **params)

  mlir.register_lowering(prim, fallback)
  for platform in native_platforms(target):
    mlir.register_lowering(prim, native_rule, platform=platform)


def ffi_rule(target: str, **lowering_args) -> Callable:
  return jax.ffi.ffi_lowering(target, **lowering_args)


def batch_size(args, dims) -> int:
  """The mapped size of a batching rule's arguments (unmapped dims are None)."""
  return next(a.shape[d] for a, d in zip(args, dims) if d is not None)


def at_front(x, dim, size: int):
  """Moves a batching rule's mapped axis to the front, broadcasting an unmapped operand."""
  if dim is None:
    return jax.numpy.broadcast_to(x, (size,) + x.shape)
  return jax.numpy.moveaxis(x, dim, 0)
