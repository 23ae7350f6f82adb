"""The dtypes jax_sgl accepts, named once for the checks, the kernels' wrappers and the docs."""

from __future__ import annotations

import jax.numpy as jnp

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
INDEX_DTYPES = (jnp.dtype(jnp.int32), jnp.dtype(jnp.int64))
# Block scales of q/k (SGLang's qk_blockscaled, the OCP MX format): an e8m0 exponent byte
# (2^(e - 127), 0xff NaN) as MX stores them, or float32.
E8M0 = jnp.dtype(jnp.float8_e8m0fnu)
BLOCK_SCALE_DTYPES = (E8M0, jnp.dtype(jnp.float32))


def names(dtypes) -> str:
  return ", ".join(str(d) for d in dtypes)


def is_fp8(dtype) -> bool:
  return jnp.dtype(dtype) in FP8_DTYPES
