"""The fused K/V buffer of a serving engine's pool: the one layout rule attention and rope_pool share.

sglang-jax's `MHATokenToKVPool` keeps one buffer per layer, `[num_pages, page_size, 2 * Hkv //
packing, packing, head_dim_pad]`: K and V interleaved on the head axis (K0, V0, K1, V1, ...), the
packing axis only a reshape of that head axis, and `head_dim_pad` the head dim rounded up to a
multiple of 128. jax_sgl reads and writes it in place: the kernels take K at heads 0, 2, 4, ... and V
at heads 1, 3, 5, ... of the same rows, through the strides of `KvStrides`, and never copy the pool.
A 3-D `[num_slots, 2 * Hkv, head_dim_pad]` buffer is the token pool (page size 1).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_sgl._dtypes import FLOAT_DTYPES, FP8_DTYPES, names


@dataclasses.dataclass(frozen=True)
class KvBufferShape:
  """What a fused buffer holds, read from its shape alone."""
  num_pages: int      # pages (num_slots for a token pool)
  page_size: int      # 1 for a token pool
  num_kv_heads: int   # Hkv: the head axis holds 2 * Hkv interleaved K and V heads
  head_dim_pad: int   # the row length of one head in the buffer (>= the head dim read)

  @property
  def num_slots(self) -> int:
    """Token rows: slot s is page s // page_size, offset s % page_size."""
    return self.num_pages * self.page_size

  @property
  def row_stride(self) -> int:
    """Elements from one token's row to the next (K and V heads of one token are adjacent)."""
    return 2 * self.num_kv_heads * self.head_dim_pad

  @property
  def head_stride(self) -> int:
    """Elements from K head h to K head h + 1 (and V head h to V head h + 1)."""
    return 2 * self.head_dim_pad

  @property
  def v_offset(self) -> int:
    """Elements from the buffer's start to V head 0 (K head 0 starts at 0)."""
    return self.head_dim_pad


def kv_buffer_shape(fn: str, kv_buffer) -> KvBufferShape:
  """The fused buffer's geometry, or a ValueError / TypeError that names `kv_buffer`'s shape."""
  shape = tuple(kv_buffer.shape)
  if jnp.dtype(kv_buffer.dtype) not in FLOAT_DTYPES + FP8_DTYPES:
    raise TypeError(f"{fn}: kv_buffer must be one of {names(FLOAT_DTYPES + FP8_DTYPES)}, got "
                    f"{kv_buffer.dtype} with shape {shape}")
  if len(shape) == 5:  # [pages, page_size, 2 * Hkv // packing, packing, D_pad]
    pages, page_size, heads_per_pack, packing, d_pad = shape
    heads_x2 = heads_per_pack * packing
  elif len(shape) == 4:  # [pages, page_size, 2 * Hkv, D_pad]
    pages, page_size, heads_x2, d_pad = shape
  elif len(shape) == 3:  # token pool [num_slots, 2 * Hkv, D_pad]
    pages, heads_x2, d_pad = shape
    page_size = 1
  else:
    raise ValueError(f"{fn}: kv_buffer must be [num_pages, page_size, 2 * num_kv_heads, head_dim] "
                     f"(or sglang-jax's 5-D [num_pages, page_size, 2 * num_kv_heads // packing, "
                     f"packing, head_dim], or a 3-D token pool), got shape {shape}")
  if heads_x2 % 2 or heads_x2 == 0:
    raise ValueError(f"{fn}: kv_buffer's head axis holds K and V interleaved (K0, V0, K1, V1, ...) "
                     f"so it must be even and non-zero, got {heads_x2} in shape {shape}")
  if page_size < 1:
    raise ValueError(f"{fn}: kv_buffer's page size must be >= 1, got shape {shape}")
  return KvBufferShape(num_pages=pages, page_size=page_size, num_kv_heads=heads_x2 // 2,
                       head_dim_pad=d_pad)
