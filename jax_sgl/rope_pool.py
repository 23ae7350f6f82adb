"""rope_pool_fused: rotary embedding of q and k fused with the write of k and v into a KV pool.

One primitive, `_rope_pool_p`, lowered to the FFI target `jax_sgl_rope_pool_fwd` (CPU, CUDA).
Operands: q, k, v, positions, slots, inv_freq, kv_scales (float32 [2, Hkv]: k's then v's scales
of an fp8 pool, else [0]), then the pools: k_pool and v_pool (aliased to outputs 2 and 3), or one
fused kv_buffer (sglang-jax's layout, `_kv_buffer.py`; aliased to output 2). Under `jax.jit(..., donate_argnums=...)` the write is in place. The frequencies always travel as
the float32 table inv_freq, built here from rope_base unless the caller gives one, so every backend
reads the same bits. Checks live in `_checks.check_rope_pool`.
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
from jax_sgl._checks import ROPE_FN, RopePoolSpec, check_rope_pool
from jax_sgl._primitive import at_front, batch_size, ffi_rule, register_lowerings
from jax_sgl._sharding import partition_rope_pool

TARGET = "jax_sgl_rope_pool_fwd"
INV_FREQ = 5   # operand index of inv_freq; kv_scales and then the pools follow it
KV_SCALES = 6

_rope_pool_p = Primitive("jax_sgl_rope_pool")
_rope_pool_p.multiple_results = True


@functools.lru_cache(maxsize=None)
def _jitted_bind(spec: RopePoolSpec):
  return jax.jit(functools.partial(_rope_pool_p.bind, spec=spec))


def _rope_pool_impl(*args, spec):
  return _jitted_bind(spec)(*args)


def _rope_pool_abstract_eval(q, k, v, positions, slots, inv_freq, kv_scales, *pools, spec):
  return (ShapedArray(q.shape, q.dtype), ShapedArray(k.shape, k.dtype),
          *(ShapedArray(p.shape, p.dtype) for p in pools))


_separate_pools_rule = ffi_rule(TARGET, operand_output_aliases={7: 2, 8: 3})
_kv_buffer_rule = ffi_rule(TARGET, operand_output_aliases={7: 2})


def _rope_pool_lowering(ctx, *args, spec):
  rule = _kv_buffer_rule if spec.kv_buffer_ndim else _separate_pools_rule
  return rule(ctx, *args, rotary_dim=np.int64(spec.rotary_dim), is_neox=np.bool_(spec.is_neox))


def _rope_pool_reference(q, k, v, positions, slots, inv_freq, kv_scales, *pools, spec):
  pools = dict(kv_buffer=pools[0]) if spec.kv_buffer_ndim else dict(k_pool=pools[0],
                                                                    v_pool=pools[1])
  if spec.kv_scaled:
    pools.update(k_scale=kv_scales[0], v_scale=kv_scales[1])
  return reference.rope_pool_fused(q, k, v, positions, slots, inv_freq=inv_freq,
                                   rotary_dim=spec.rotary_dim, is_neox=spec.is_neox, **pools)


def _rope_pool_batch(args, dims, *, spec):
  """vmap folds the mapped axis into the token axis: instance b's tokens write slot s of its own
  pool as slot s + b * num_slots of the pools stacked along the slot (or page) axis. No copy, one
  call. The frequencies are shared: a mapped inv_freq has no such fold."""
  if dims[INV_FREQ] is not None:
    raise NotImplementedError(f"{ROPE_FN}: vmap over inv_freq is not supported; give every "
                              "instance the same inv_freq")
  if dims[KV_SCALES] is not None:
    raise NotImplementedError(f"{ROPE_FN}: vmap over k_scale/v_scale is not supported (the "
                              "folded pools share one scale per KV head); give every instance "
                              "the same scales")
  size = batch_size(args, dims)
  inv_freq, kv_scales = args[INV_FREQ], args[KV_SCALES]
  args = [at_front(a, d, size) for a, d in zip(args, dims)]
  q, k, v, positions, slots = args[:INV_FREQ]
  pools = args[KV_SCALES + 1:]
  n = spec.num_slots
  in_range = (slots >= 0) & (slots < n)
  offset = (jnp.arange(size, dtype=slots.dtype) * n)[:, None]
  flat_slots = jnp.where(in_range, slots + offset, -1)
  flat = lambda x: x.reshape((-1,) + x.shape[2:])
  folded = RopePoolSpec(**{**spec.__dict__, "num_tokens": size * spec.num_tokens,
                           "num_slots": size * n})
  outs = _rope_pool_p.bind(flat(q), flat(k), flat(v), flat(positions), flat(flat_slots),
                           inv_freq, kv_scales, *map(flat, pools), spec=folded)
  shapes = (q.shape, k.shape) + tuple(p.shape for p in pools)
  return [o.reshape(s) for o, s in zip(outs, shapes)], [0] * len(shapes)


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


def rope_pool_fused(q, k, v, positions, slots, k_pool=None, v_pool=None, head_dim=None,
                    num_qo_heads=None, num_kv_heads=None, rope_base=None, *, rotary_dim=None,
                    is_neox=True, inv_freq=None, kv_buffer=None, check_slots=False, k_scale=None,
                    v_scale=None):
  """Applies RoPE to q and k and writes rotated k and v into the KV pool at `slots`.

  Args:
    q: [num_tokens, num_qo_heads, head_dim], float32/float16/bfloat16.
    k, v: [num_tokens, num_kv_heads, head_dim], q's dtype.
    positions: [num_tokens] int32/int64, the rotary position of each token.
    slots: [num_tokens] int32/int64, the pool row of each token (with a paged kv_buffer, slot
      s = page * page_size + offset). Negative: padding, nothing is written. >= num_slots: never
      written (no out-of-bounds write); see `check_slots`.
    k_pool, v_pool: [num_slots, num_kv_heads, head_dim], q's dtype. Donate them
      (`jax.jit(..., donate_argnums=...)`) for an in-place write; otherwise XLA copies them.
    head_dim, num_qo_heads, num_kv_heads: optional; checked against the shapes (SGLang's API).
    rope_base: the RoPE base (theta), a Python float; 10000.0 when neither it nor inv_freq is given.
    rotary_dim: features rotated (even, <= head_dim; default head_dim); the rest are copied.
    is_neox: True rotates halves (x[i], x[i + rotary_dim/2]) as SGLang does; False rotates
      interleaved pairs (x[2i], x[2i+1]) (GPT-J style).
    inv_freq: float32 [rotary_dim // 2], instead of rope_base: the inverse frequencies as the
      model computes them (llama3, yarn, proportional scaling); angle_i = position * inv_freq[i].
    kv_buffer: instead of k_pool/v_pool, one fused buffer as sglang-jax keeps it:
      [num_pages, page_size, 2 * num_kv_heads // packing, packing, head_dim_pad], or 4-D
      [num_pages, page_size, 2 * num_kv_heads, head_dim_pad], or a 3-D token pool
      [num_slots, 2 * num_kv_heads, head_dim_pad]; q's dtype; K head h at head index 2h, V head h
      at 2h + 1; head_dim_pad >= head_dim, and features [head_dim, head_dim_pad) are never
      written. Donate it for an in-place write.
    check_slots: also report slots >= num_slots as an error at run time (a host callback; a
      debugging aid that costs a device-to-host sync). Those slots are skipped either way.
    k_scale, v_scale: an fp8 KV cache (a jax_sgl extension): float32, one scale per tensor ([] or
      [1]) or per KV head [num_kv_heads]; both or neither. With them the pools (or kv_buffer) are
      float8_e4m3fn and hold e4m3(x / scale) of the rotated k (k_rot as returned, in q's dtype)
      and of v: the quotient in float32, rounded to nearest even, saturating at +-448 (infinities
      too), NaN stays NaN. The value read back is stored * scale, so the same arrays serve as
      jax_sgl.attention's k_descale / v_descale. Without them the pools have q's dtype (SGLang's
      rule, `pool dtypes must match q/k/v dtype`). e5m2 pools are not served.

  Returns:
    (q_rot, k_rot, k_pool, v_pool): rotated q and k in q's dtype (also with an fp8 pool), and the
    updated pools; with
    kv_buffer, (q_rot, k_rot, kv_buffer): the updated buffer, same shape.
  """
  if inv_freq is not None and not hasattr(inv_freq, "dtype"):
    inv_freq = np.asarray(inv_freq, np.float32)
  k_scale, v_scale = (np.asarray(x, np.float32) if x is not None and not hasattr(x, "dtype")
                      else x for x in (k_scale, v_scale))
  spec = check_rope_pool(q, k, v, positions, slots, k_pool, v_pool, head_dim=head_dim,
                         num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                         rope_base=rope_base, rotary_dim=rotary_dim, is_neox=is_neox,
                         inv_freq=inv_freq, kv_buffer=kv_buffer, k_scale=k_scale,
                         v_scale=v_scale)
  if inv_freq is None:
    inv_freq = reference.rope_inv_freq(spec.rotary_dim, rope_base)
  # The kernels take one index type for both arrays; widening never changes a value.
  index_dtype = jnp.promote_types(positions.dtype, slots.dtype)
  positions = jnp.asarray(positions).astype(index_dtype)
  slots = jnp.asarray(slots).astype(index_dtype)
  if check_slots:
    bad = slots >= spec.num_slots
    jax.debug.callback(functools.partial(_raise_bad_slots, num_slots=spec.num_slots),
                       jnp.sum(bad), jnp.argmax(bad))
  pools = (kv_buffer,) if kv_buffer is not None else (k_pool, v_pool)
  return tuple(_rope_pool_p.bind(q, k, v, positions, slots, jnp.asarray(inv_freq),
                                 _kv_scales(spec, k_scale, v_scale), *pools, spec=spec))


def _kv_scales(spec: RopePoolSpec, k_scale, v_scale):
  """The kernels' one scale operand: float32 [2, Hkv] (per-tensor scales broadcast to every KV
  head), or [0] without an fp8 pool."""
  if not spec.kv_scaled:
    return jnp.zeros((0,), jnp.float32)
  per_head = lambda s: jnp.broadcast_to(jnp.reshape(s, (-1,)), (spec.num_kv_heads,))
  return jnp.stack([per_head(k_scale), per_head(v_scale)])
