"""JAX_SGL_DISABLE: the one debug switch that turns native kernel families off.

A comma-separated list of family names, read when an attention call is lowered (so a jit cache
keeps what was lowered before a change: flip it before tracing, or call jax.clear_caches()).
`cuda_bwd` acts here, in Python: CUDA gradients lower to the vjp of the pure-JAX reference. The
others travel to the native handlers as the `disable` attribute, a bit mask whose bits are
AttentionDisable in ffi/common/attention_params.h; a disabled family's calls run on the portable
kernels.
"""

from __future__ import annotations

import os

ENV = "JAX_SGL_DISABLE"

# Name -> bit of the native `disable` attribute (ffi/common/attention_params.h AttentionDisable).
NATIVE_BITS = {
    "sm90": 1 << 0,          # the Hopper forward
    "sm90_varlen": 1 << 1,   # the Hopper forward's varlen / seqused_k / paged path
    "sm90_bwd": 1 << 2,      # the Hopper backward
    "sm100": 1 << 3,         # the Blackwell forward
    "sm100_bwd": 1 << 4,     # the Blackwell backward (1 << 3: "sm100", the Blackwell forward)
}
FAMILIES = (*NATIVE_BITS, "cuda_bwd")   # cuda_bwd: the CUDA backward kernels (Python side)


def disabled() -> frozenset[str]:
  """The family names JAX_SGL_DISABLE lists now; ValueError naming any unknown one."""
  names = {n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()}
  unknown = sorted(names.difference(FAMILIES))
  if unknown:
    raise ValueError(f"{ENV}: unknown kernel family {', '.join(map(repr, unknown))}; "
                     f"valid names: {', '.join(FAMILIES)}")
  return frozenset(names)


def disable_mask() -> int:
  """The native `disable` attribute for the families JAX_SGL_DISABLE lists now."""
  return sum(bit for name, bit in NATIVE_BITS.items() if name in disabled())
