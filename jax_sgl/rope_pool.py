"""rope_pool_fused: rotary embedding of q and k fused with the write of k and v into a KV pool.

One primitive, `_rope_pool_p`, lowered to the FFI target `jax_sgl_rope_pool_fwd` (CPU, CUDA) with
the pools aliased to outputs 2 and 3, so that under `jax.jit(..., donate_argnums=...)` the write
is in place. Checks live in `_checks.check_rope_pool`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import batching

from jax_sgl import reference
from jax_sgl._checks import RopePoolSpec, check_rope_pool
from jax_sgl._primitive import at_front, batch_size, ffi_rule, register_lowerings
from jax_sgl._sharding import partition_rope_pool

TARGET = "jax_sgl_rope_pool_fwd"

_rope_pool_p = Primitive("jax_sgl_rope_pool")
_rope_pool_p.multiple_results = True


@functools.lru_cache(maxsize=None)
def _jitted_bind(spec: RopePoolSpec):
  return jax.jit(functools.partial(_rope_pool_p.bind, spec=spec))


def _rope_pool_impl(*args, spec):
  return _jitted_bind(spec)(*args)


def _rope_pool_abstract_eval(q, k, v, positions, slots, k_pool, v_pool, *, spec):
  return (ShapedArray(q.shape, q.dtype), ShapedArray(k.shape, k.dtype),
          ShapedArray(k_pool.shape, k_pool.dtype), ShapedArray(v_pool.shape, v_pool.dtype))


_native_rule = ffi_rule(TARGET, operand_output_aliases={5: 2, 6: 3})


def _rope_pool_lowering(ctx, *args, spec):
  return _native_rule(ctx, *args, rope_base=np.float32(spec.rope_base),
                      rotary_dim=np.int64(spec.rotary_dim), is_neox=np.bool_(spec.is_neox))


def _rope_pool_reference(q, k, v, positions, slots, k_pool, v_pool, *, spec):
  return reference.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool,
                                   rope_base=spec.rope_base, rotary_dim=spec.rotary_dim,
                                   is_neox=spec.is_neox)


def _rope_pool_batch(args, dims, *, spec):
  """vmap folds the mapped axis into the token axis: instance b's tokens write slot s of its own
  pool as slot s + b * num_slots of the pools stacked along the slot axis. No copy, one call."""
  size = batch_size(args, dims)
  args = [at_front(a, d, size) for a, d in zip(args, dims)]
  q, k, v, positions, slots, k_pool, v_pool = args
  n = spec.num_slots
  in_range = (slots >= 0) & (slots < n)
  offset = (jnp.arange(size, dtype=slots.dtype) * n)[:, None]
  flat_slots = jnp.where(in_range, slots + offset, -1)
  flat = lambda x: x.reshape((-1,) + x.shape[2:])
  folded = RopePoolSpec(**{**spec.__dict__, "num_tokens": size * spec.num_tokens,
                           "num_slots": size * n})
  outs = _rope_pool_p.bind(flat(q), flat(k), flat(v), flat(positions), flat(flat_slots),
                           flat(k_pool), flat(v_pool), spec=folded)
  shapes = (q.shape, k.shape, k_pool.shape, v_pool.shape)
  return [o.reshape(s) for o, s in zip(outs, shapes)], [0, 0, 0, 0]


_rope_pool_p.def_impl(_rope_pool_impl)
_rope_pool_p.def_abstract_eval(_rope_pool_abstract_eval)
batching.primitive_batchers[_rope_pool_p] = _rope_pool_batch
# Under sharded jit the primitive runs per device as this twin (_sharding.py has the rules).
_rope_pool_local_p = partition_rope_pool(_rope_pool_p, _rope_pool_abstract_eval)
register_lowerings(_rope_pool_local_p, TARGET, _rope_pool_lowering, _rope_pool_reference)


def _raise_bad_slots(bad_count, first_bad, num_slots):
  if int(bad_count) > 0:
    raise ValueError(f"jax_sgl.rope_pool_fused: {int(bad_count)} slot(s) are >= num_slots "
                     f"({num_slots}), first at token {int(first_bad)}; they were not written")


def rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, head_dim=None, num_qo_heads=None,
                    num_kv_heads=None, rope_base=10000.0, *, rotary_dim=None, is_neox=True,
                    check_slots=False):
  """Applies RoPE to q and k and writes rotated k and v into the KV pools at `slots`.

  Args:
    q: [num_tokens, num_qo_heads, head_dim], float32/float16/bfloat16.
    k, v: [num_tokens, num_kv_heads, head_dim], q's dtype.
    positions: [num_tokens] int32/int64, the rotary position of each token.
    slots: [num_tokens] int32/int64, the pool row of each token. Negative: padding, nothing is
      written. >= num_slots: never written (no out-of-bounds write); see `check_slots`.
    k_pool, v_pool: [num_slots, num_kv_heads, head_dim], q's dtype. Donate them
      (`jax.jit(..., donate_argnums=...)`) for an in-place write; otherwise XLA copies them.
    head_dim, num_qo_heads, num_kv_heads: optional; checked against the shapes (SGLang's API).
    rope_base: the RoPE base (theta), a Python float.
    rotary_dim: features rotated (even, <= head_dim; default head_dim); the rest are copied.
    is_neox: True rotates halves (x[i], x[i + rotary_dim/2]) as SGLang does; False rotates
      interleaved pairs (x[2i], x[2i+1]) (GPT-J style).
    check_slots: also report slots >= num_slots as an error at run time (a host callback; a
      debugging aid that costs a device-to-host sync). Those slots are skipped either way.

  Returns:
    (q_rot, k_rot, k_pool, v_pool): rotated q and k in q's dtype, and the updated pools.
  """
  spec = check_rope_pool(q, k, v, positions, slots, k_pool, v_pool, head_dim=head_dim,
                         num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                         rope_base=rope_base, rotary_dim=rotary_dim, is_neox=is_neox)
  # The kernels take one index type for both arrays; widening never changes a value.
  index_dtype = jnp.promote_types(positions.dtype, slots.dtype)
  positions = jnp.asarray(positions).astype(index_dtype)
  slots = jnp.asarray(slots).astype(index_dtype)
  if check_slots:
    bad = slots >= spec.num_slots
    jax.debug.callback(functools.partial(_raise_bad_slots, num_slots=spec.num_slots),
                       jnp.sum(bad), jnp.argmax(bad))
  return tuple(_rope_pool_p.bind(q, k, v, positions, slots, k_pool, v_pool, spec=spec))
