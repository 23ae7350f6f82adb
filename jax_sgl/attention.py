"""attention: flash attention forward over dense, varlen (packed) and paged KV.

One primitive, `_attention_fwd_p`, lowered to the FFI target `jax_sgl_attention_fwd` (CPU, CUDA).
Its operands are always the ten arrays of the FFI signature; optional ones that the caller left
out travel as empty int32/float32 arrays and `present` says which are real. Checks live in
`_checks.check_attention`.
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
from jax_sgl._checks import KV_PAGED, AttentionSpec, check_attention
from jax_sgl._primitive import at_front, batch_size, ffi_rule, register_lowerings
from jax_sgl._sharding import partition_attention

TARGET = "jax_sgl_attention_fwd"

# Optional operands, in FFI order after q, k, v.
OPTIONAL = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table", "q_descale", "k_descale",
            "v_descale")
_INDEX_OPTIONAL = OPTIONAL[:4]

_attention_fwd_p = Primitive("jax_sgl_attention_fwd")
_attention_fwd_p.multiple_results = True


@functools.lru_cache(maxsize=None)
def _jitted_bind(spec: AttentionSpec, present: tuple[bool, ...]):
  return jax.jit(functools.partial(_attention_fwd_p.bind, spec=spec, present=present))


def _attention_fwd_impl(*args, spec, present):
  return _jitted_bind(spec, present)(*args)


def _lse_shape(q_shape, spec: AttentionSpec):
  if spec.varlen_q:
    return (spec.num_heads, q_shape[0])
  return (q_shape[0], spec.num_heads, q_shape[1])


def _attention_fwd_abstract_eval(q, k, v, *optional, spec, present):
  out = ShapedArray(q.shape[:-1] + (spec.head_dim_v,), spec.out_dtype)
  return out, ShapedArray(_lse_shape(q.shape, spec), jnp.float32)


_native_rule = ffi_rule(TARGET)


def _attention_fwd_lowering(ctx, *args, spec, present):
  q_aval = ctx.avals_in[0]
  max_seqlen_q = q_aval.shape[0] if spec.varlen_q else q_aval.shape[1]
  return _native_rule(
      ctx, *args, kv_layout=np.int64(spec.kv_layout), varlen_q=np.bool_(spec.varlen_q),
      batch=np.int64(spec.batch), max_seqlen_q=np.int64(max_seqlen_q),
      softmax_scale=np.float32(spec.softmax_scale), softcap=np.float32(spec.softcap),
      causal=np.bool_(spec.causal), window_left=np.int64(spec.window_left),
      window_right=np.int64(spec.window_right))


def _attention_fwd_reference(q, k, v, *optional, spec, present):
  given = {name: x for name, x, p in zip(OPTIONAL, optional, present) if p}
  return reference.attention(
      q, k, v, kv_layout=spec.kv_layout, varlen_q=spec.varlen_q, batch=spec.batch,
      softmax_scale=spec.softmax_scale, softcap=spec.softcap, causal=spec.causal,
      window_left=spec.window_left, window_right=spec.window_right, out_dtype=spec.out_dtype,
      **given)


def _fold_heads(x, size):
  """[V, ..., heads, D] -> [..., V * heads, D]: the mapped axis joins the head axis."""
  x = jnp.moveaxis(x, 0, x.ndim - 3)
  return x.reshape(x.shape[:-3] + (size * x.shape[-2], x.shape[-1]))


def _attention_fwd_batch(args, dims, *, spec, present):
  """vmap over heads: with shared index arrays, instance b's heads become heads
  [b * H, (b + 1) * H) of one call (GQA groups stay aligned since H = group * Hkv). Batched index
  arrays fall back to a sequential map over the instances."""
  size = batch_size(args, dims)
  q, k, v, *optional = args
  qd, kd, vd, *opt_dims = dims
  index_batched = any(d is not None
                      for name, d in zip(OPTIONAL, opt_dims) if name in _INDEX_OPTIONAL)
  if index_batched:
    front = [at_front(a, d, size) for a, d in zip(args, dims)]
    outs = jax.lax.map(lambda xs: _attention_fwd_p.bind(*xs, spec=spec, present=present), front)
    return list(outs), [0, 0]

  q, k, v = (_fold_heads(at_front(x, d, size), size)
             for x, d in ((q, qd), (k, kd), (v, vd)))
  folded_opt = []
  for name, x, d, p in zip(OPTIONAL, optional, opt_dims, present):
    if p and name not in _INDEX_OPTIONAL:    # descale [B, Hkv] -> [B, V * Hkv]
      x = jnp.moveaxis(at_front(x, d, size), 0, 1)
      x = x.reshape(x.shape[0], -1)
    folded_opt.append(x)
  folded = AttentionSpec(**{**spec.__dict__, "num_heads": size * spec.num_heads,
                            "num_kv_heads": size * spec.num_kv_heads})
  out, lse = _attention_fwd_p.bind(q, k, v, *folded_opt, spec=folded, present=present)
  out = jnp.moveaxis(out.reshape(out.shape[:-2] + (size, spec.num_heads, out.shape[-1])),
                     -3, 0)
  if spec.varlen_q:
    lse = lse.reshape(size, spec.num_heads, lse.shape[-1])
  else:
    lse = jnp.moveaxis(lse.reshape(lse.shape[0], size, spec.num_heads, lse.shape[-1]), 1, 0)
  return [out, lse], [0, 0]


_attention_fwd_p.def_impl(_attention_fwd_impl)
_attention_fwd_p.def_abstract_eval(_attention_fwd_abstract_eval)
batching.primitive_batchers[_attention_fwd_p] = _attention_fwd_batch
# Under sharded jit the primitive runs per device as this twin (_sharding.py has the rules).
_attention_fwd_local_p = partition_attention(_attention_fwd_p, _attention_fwd_abstract_eval)
register_lowerings(_attention_fwd_local_p, TARGET, _attention_fwd_lowering,
                   _attention_fwd_reference)


def attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
              cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, page_table=None,
              return_lse=False, q_descale=None, k_descale=None, v_descale=None):
  """Flash attention forward.

  Layouts:
    dense:  q [batch, seqlen_q, num_heads, head_dim], k/v [batch, seqlen_k, num_kv_heads, D(_v)].
    varlen: q [total_q, H, D] with cu_seqlens_q [batch + 1]; k/v [total_k, Hkv, D] with
            cu_seqlens_k [batch + 1].
    paged:  k/v are pools, a token pool [num_slots, Hkv, D] (as written by rope_pool_fused) or a
            page pool [num_pages, page_size, Hkv, D]; page_table [batch, max_pages] int32 maps
            each sequence's pages (token pool: slots); seqused_k [batch] gives its length. q is
            dense or varlen. Entries outside [0, num_pages) are masked keys, never read.
  seqused_k also limits the keys of dense and varlen sequences.

  Masks: `causal` aligns the last query with the last key (bottom-right, as FlashAttention), so
  decode and chunked prefill see their whole prefix. `window=(left, right)` keeps keys within
  left/right of that diagonal (-1: unbounded). `softcap > 0` applies softcap * tanh(s / softcap)
  to the scaled scores. GQA/MQA: num_heads a multiple of num_kv_heads.

  Dtypes: float32, float16, bfloat16 with float32 accumulation; fp8 (float8_e4m3fn/e5m2) q/k with
  q_descale/k_descale float32 [batch, num_kv_heads], fp8 v with v_descale (also beside bf16 q/k:
  SGLang's v_dequant path); fp8 output is bfloat16.

  Returns:
    out in q's layout with head_dim_v (q's dtype; bfloat16 for fp8), and with `return_lse` also
    lse float32 [batch, num_heads, seqlen_q] (varlen: [num_heads, total_q]), the natural-log
    sum of exp of the scaled scores. Fully masked rows give 0 and -inf.
  """
  spec = check_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                         softcap=softcap, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         seqused_k=seqused_k, page_table=page_table, q_descale=q_descale,
                         k_descale=k_descale, v_descale=v_descale)
  if spec.kv_layout == KV_PAGED and k.ndim == 3:   # token pool: pages of one token
    k, v = k[:, None], v[:, None]
  given = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
               page_table=page_table, q_descale=q_descale, k_descale=k_descale,
               v_descale=v_descale)
  present = tuple(given[name] is not None for name in OPTIONAL)
  operands = []
  for name in OPTIONAL:
    x = given[name]
    dtype = jnp.int32 if name in _INDEX_OPTIONAL else jnp.float32
    operands.append(jnp.zeros((0,), dtype) if x is None else jnp.asarray(x).astype(dtype))
  out, lse = _attention_fwd_p.bind(q, k, v, *operands, spec=spec, present=present)
  return (out, lse) if return_lse else out
