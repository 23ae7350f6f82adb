"""attention: flash attention over dense, varlen (packed) and paged KV, differentiable.

Two primitives: `_attention_fwd_p`, lowered to the FFI target `jax_sgl_attention_fwd`, and
`_attention_bwd_p` (`jax_sgl_attention_bwd`), joined by a custom_vjp whose forward saves only out
and lse besides the inputs (the backward recomputes the probabilities, FlashAttention-2 style).
The operands of both start with the eleven arrays of the forward's FFI signature; optional ones
that the caller left out travel as empty int32/float32 arrays and `present` says which are real.
Checks live in `_checks.check_attention`. Attention sinks need no backward kernel of their own:
the forward's lse includes the sink, so the dq/dk/dv kernels are unchanged, and d sinks is a
reduction over saved values (`_sinks_grad`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_sgl import _disable, reference
from jax_sgl._checks import (ATTN_FN, KV_PAGED, AttentionSpec, check_attention,
                             check_attention_cuda)
from jax_sgl._dtypes import is_fp8
from jax_sgl._kv_buffer import kv_buffer_shape
from jax_sgl._primitive import (at_front, batch_size, ffi_rule, register_lowerings,
                                warn_reference_once)
from jax_sgl import _registration
from jax_sgl._registration import warn_if_sm90_absent
from jax_sgl._sharding import partition_attention, partition_attention_bwd

TARGET = "jax_sgl_attention_fwd"
BWD_TARGET = "jax_sgl_attention_bwd"

# Optional operands, in FFI order after q, k, v.
OPTIONAL = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table", "q_descale", "k_descale",
            "v_descale", "sinks")
_INDEX_OPTIONAL = OPTIONAL[:4]


def _primitive(name: str) -> Primitive:
  """A multiple-results primitive whose eager call runs its lowering under jit, one compiled
  function per (spec, present)."""
  prim = Primitive(name)
  prim.multiple_results = True

  @functools.lru_cache(maxsize=None)
  def jitted(spec: AttentionSpec, present: tuple[bool, ...]):
    return jax.jit(functools.partial(prim.bind, spec=spec, present=present))

  prim.def_impl(lambda *args, spec, present: jitted(spec, present)(*args))
  return prim


def _map_if_index_batched(prim, args, dims, opt_dims, size, *, spec, present):
  """vmap with batched index arrays (cu_seqlens, seqused_k, page_table): a sequential map over
  the instances, (outputs, dims); None where every instance shares them."""
  if all(d is None for name, d in zip(OPTIONAL, opt_dims) if name in _INDEX_OPTIONAL):
    return None
  front = [at_front(a, d, size) for a, d in zip(args, dims)]
  outs = jax.lax.map(lambda xs: prim.bind(*xs, spec=spec, present=present), front)
  return list(outs), [0] * len(outs)


_attention_fwd_p = _primitive("jax_sgl_attention_fwd")


def _lse_shape(q_shape, spec: AttentionSpec):
  if spec.varlen_q:
    return (spec.num_heads, q_shape[0])
  return (q_shape[0], spec.num_heads, q_shape[1])


def _attention_fwd_abstract_eval(q, k, v, *optional, spec, present):
  out = ShapedArray(q.shape[:-1] + (spec.head_dim_v,), spec.out_dtype)
  return out, ShapedArray(_lse_shape(q.shape, spec), jnp.float32)


_native_rule = ffi_rule(TARGET)


def _ffi_attrs(ctx, spec: AttentionSpec) -> dict:
  """The attributes shared by the forward and backward FFI targets."""
  q_aval = ctx.avals_in[0]
  max_seqlen_q = q_aval.shape[0] if spec.varlen_q else q_aval.shape[1]
  if "cuda" in ctx.module_context.platforms:
    check_attention_cuda(q_aval.dtype, ctx.avals_in[2].dtype, spec.qk_blockscaled,
                         k_dtype=ctx.avals_in[1].dtype)
    warn_if_sm90_absent()
  return dict(
      kv_layout=np.int64(spec.kv_layout), varlen_q=np.bool_(spec.varlen_q),
      batch=np.int64(spec.batch), max_seqlen_q=np.int64(max_seqlen_q),
      softmax_scale=np.float32(spec.softmax_scale), softcap=np.float32(spec.softcap),
      causal=np.bool_(spec.causal), window_left=np.int64(spec.window_left),
      window_right=np.int64(spec.window_right), deterministic=np.bool_(spec.deterministic),
      disable=np.int64(_disable.disable_mask()), kv_buffer=np.bool_(spec.kv_buffer),
      qk_blockscaled=np.bool_(spec.qk_blockscaled))


# Head dims of the sm90 forward (ffi/cuda/attention/sm90/fwd/tile_size.h Sm90FwdHeadDim), one of
# which a call may be zero-padded to (padded_sm90_fwd_spec) where the build holds it.
SM90_FWD_HEAD_DIMS = (64, 128, 256)


def _fwd_plan(ctx, spec: AttentionSpec, dims=None) -> str:
  """The forward kernel CUDA's dispatch picks for this call on a Hopper GPU (jax_sgl/_plan.py),
  at its head dims or at `dims` (head_dim, head_dim_v)."""
  d, dv = dims or (spec.head_dim, spec.head_dim_v)
  avals = ctx.avals_in
  feat = lambda a, n: (list(a.shape[:-1]) + [n], jnp.dtype(a.dtype).name)
  operands = [feat(avals[0], d), feat(avals[1], d), feat(avals[2], dv)]
  operands += [(list(a.shape), jnp.dtype(a.dtype).name) for a in avals[3:]]
  out = ctx.avals_out[0]
  operands += [(list(out.shape[:-1]) + [dv], jnp.dtype(out.dtype).name),
               (list(ctx.avals_out[1].shape), "float32")]
  attrs = {k: v.item() for k, v in _ffi_attrs(ctx, spec).items()}
  return _registration._ext.attention_plan(False, operands, attrs, 9, 0, 132)


def padded_sm90_fwd_spec(ctx, spec: AttentionSpec) -> AttentionSpec | None:
  """A dense or varlen float16 / bfloat16 call that the sm90 forward does not serve at its head
  dims (head_dim != head_dim_v, e.g. MLA's 192 / 128, or a head dim between its own), run on the
  Hopper of this process, while it serves the call zero-padded to one of its head dims: that
  padded spec, so the call runs there instead of the portable kernel. Zero features change no
  score (the call's softmax scale is kept) and V's give zero output columns, dropped. Only where
  the dispatch takes the portable kernel at the call's dims and the sm90 one padded (decode and
  split calls keep their kernels); None otherwise."""
  q_dtype = ctx.avals_in[0].dtype
  d = max(spec.head_dim, spec.head_dim_v)
  if (spec.kv_layout == KV_PAGED or spec.kv_buffer or spec.qk_blockscaled or
      jnp.dtype(q_dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)) or
      jnp.dtype(ctx.avals_in[2].dtype) != jnp.dtype(q_dtype) or
      not _registration.local_cuda_devices_are_hopper()):
    return None
  wide = next((w for w in SM90_FWD_HEAD_DIMS
               if w >= d and _registration.sm90_fwd_built(w, q_dtype)), None)
  if wide is None or (wide, wide) == (spec.head_dim, spec.head_dim_v):
    return None
  if _fwd_plan(ctx, spec) != "portable" or _fwd_plan(ctx, spec, (wide, wide)) != "sm90":
    return None
  return dataclasses.replace(spec, head_dim=wide, head_dim_v=wide)


def _pad_features(x, n):
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])


def _attention_fwd_padded(q, k, v, *optional, spec, present, padded):
  """The forward of a call on its zero-padded head dims (padded_sm90_fwd_spec)."""
  out, lse = _attention_fwd_local_p.bind(
      _pad_features(q, padded.head_dim), _pad_features(k, padded.head_dim),
      _pad_features(v, padded.head_dim_v), *optional, spec=padded, present=present)
  return out[..., :spec.head_dim_v], lse


_padded_fwd_rule = mlir.lower_fun(_attention_fwd_padded, multiple_results=True)


def _attention_fwd_lowering(ctx, *args, spec, present):
  if "cuda" in ctx.module_context.platforms:
    padded = padded_sm90_fwd_spec(ctx, spec)
    if padded is not None:
      return _padded_fwd_rule(ctx, *args, spec=spec, present=present, padded=padded)
  return _native_rule(ctx, *args, **_ffi_attrs(ctx, spec))


def _attention_fwd_reference(q, k, v, *optional, spec, present):
  given = {name: x for name, x, p in zip(OPTIONAL, optional, present) if p}
  if spec.kv_buffer:   # k and v are both the fused buffer; the reference reads sliced views
    k, v = reference.split_kv_buffer(k, spec.head_dim)
  if spec.token_pool:  # [num_slots, Hkv, D]: pages of one token (k's block scales alike)
    k, v = k[:, None], v[:, None]
    if spec.qk_blockscaled:
      given["k_descale"] = given["k_descale"][:, None]
  return reference.attention(
      q, k, v, kv_layout=spec.kv_layout, varlen_q=spec.varlen_q, batch=spec.batch,
      softmax_scale=spec.softmax_scale, softcap=spec.softcap, causal=spec.causal,
      window_left=spec.window_left, window_right=spec.window_right, out_dtype=spec.out_dtype,
      **given)


def _fold_optional(name, x, d, size, spec: AttentionSpec):
  """A non-index optional operand under the head fold: descales [B, Hkv] -> [B, V * Hkv], [Hkv]
  or [1] -> [V * Hkv] (an unmapped [1] stays: one scale for every instance), sinks [H] -> [V * H],
  block scales (q's and k's layouts) as q and k (unmapped ones are broadcast: every instance has
  the same values)."""
  if name in _PER_HEAD_DESCALES and x.ndim - (d is not None) == 1:
    if d is None and x.shape[0] == 1:
      return x
    x = at_front(x, d, size)
    return jnp.broadcast_to(x, (size, spec.num_kv_heads)).reshape(-1)
  x = at_front(x, d, size)
  if name == "sinks":
    return x.reshape(-1)
  if spec.qk_blockscaled and name in ("q_descale", "k_descale"):
    return _fold_heads(x, size)
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(x.shape[0], -1)


def _unfold_heads(x, size, heads):
  """[..., V * heads, D] -> [V, ..., heads, D]: the inverse of _fold_heads."""
  x = x.reshape(x.shape[:-2] + (size, heads, x.shape[-1]))
  return jnp.moveaxis(x, -3, 0)


def _fold_lse(x, size, varlen_q):
  """lse-shaped [V, B, H, Sq] -> [B, V * H, Sq]; varlen [V, H, T] -> [V * H, T]."""
  if varlen_q:
    return x.reshape((size * x.shape[1],) + x.shape[2:])
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape((x.shape[0], size * x.shape[2]) + x.shape[3:])


def _unfold_lse(x, size, heads, varlen_q):
  if varlen_q:
    return x.reshape(size, heads, x.shape[-1])
  return jnp.moveaxis(x.reshape(x.shape[0], size, heads, x.shape[-1]), 1, 0)


def _folded_spec(spec: AttentionSpec, size: int) -> AttentionSpec:
  return AttentionSpec(**{**spec.__dict__, "num_heads": size * spec.num_heads,
                          "num_kv_heads": size * spec.num_kv_heads})


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
  mapped = _map_if_index_batched(_attention_fwd_p, args, dims, opt_dims, size, spec=spec,
                                 present=present)
  if mapped is not None:
    return mapped

  q, k, v = (_fold_heads(at_front(x, d, size), size)
             for x, d in ((q, qd), (k, kd), (v, vd)))
  folded_opt = []
  for name, x, d, p in zip(OPTIONAL, optional, opt_dims, present):
    if p and name not in _INDEX_OPTIONAL:
      x = _fold_optional(name, x, d, size, spec)
    folded_opt.append(x)
  out, lse = _attention_fwd_p.bind(q, k, v, *folded_opt, spec=_folded_spec(spec, size),
                                   present=present)
  return [_unfold_heads(out, size, spec.num_heads),
          _unfold_lse(lse, size, spec.num_heads, spec.varlen_q)], [0, 0]


_attention_fwd_p.def_abstract_eval(_attention_fwd_abstract_eval)
batching.primitive_batchers[_attention_fwd_p] = _attention_fwd_batch
# Under sharded jit the primitive runs per device as this twin (_sharding.py has the rules).
_attention_fwd_local_p = partition_attention(_attention_fwd_p, _attention_fwd_abstract_eval)
register_lowerings(_attention_fwd_local_p, TARGET, _attention_fwd_lowering,
                   _attention_fwd_reference)


# --------------------------------------------------------------------------------------------
# Backward: operands q, k, v, *optional (as the forward), out, lse, dout, dlse -> dq, dk, dv.
# --------------------------------------------------------------------------------------------

_attention_bwd_p = _primitive("jax_sgl_attention_bwd")


def _attention_bwd_abstract_eval(q, k, v, *rest, spec, present):
  return (ShapedArray(q.shape, q.dtype), ShapedArray(k.shape, k.dtype),
          ShapedArray(v.shape, v.dtype))


_native_bwd_rule = ffi_rule(BWD_TARGET)

# The CUDA backward kernels (ffi/cuda/attention/bwd_sm80/kernel.cuh, verified on an H200 on
# 2026-12-02, and the sm90 ones) serve the combinations below; CUDA lowers every other one, and
# every gradient traced while JAX_SGL_DISABLE names cuda_bwd, to the vjp of the pure-JAX reference.
# Largest head_dim / head_dim_v with a CUDA backward on any GPU (kBwdHeadDimCapacities in
# flash_bwd_launch.h).
CUDA_BWD_MAX_HEAD_DIM = 128
# Head dims above it with a CUDA backward on Hopper only: the sm90 backward's wide kernel
# (ffi/cuda/attention/sm90/bwd/wide_kernel.cuh), dense or varlen, head_dim == head_dim_v;
# deterministic=True with its dQ from the atomic-free dQ kernel.
SM90_BWD_WIDE_HEAD_DIMS = (192, 256)


def _wide_bwd_unsupported(spec: AttentionSpec, q_dtype) -> str | None:
  """Why the sm90 wide backward does not serve this call (head dims above 128), or None.

  The lowering cannot see the GPU the program will run on, and the dispatch finds no kernel for
  these head dims off Hopper (a run-time error), so the native call is emitted only when every
  CUDA device of this process is Hopper; a process without CUDA devices (exporting from a CPU)
  or with other GPUs lowers to the reference. A program lowered on a Hopper process and then run
  on another GPU (jax.export) gets the dispatch's error instead."""
  d = spec.head_dim
  if spec.head_dim_v != d or d not in SM90_BWD_WIDE_HEAD_DIMS:
    return (f"head dims {d}/{spec.head_dim_v}: the CUDA backward serves multiples of 8 up to "
            f"{CUDA_BWD_MAX_HEAD_DIM}, and head_dim == head_dim_v in {SM90_BWD_WIDE_HEAD_DIMS} "
            "on Hopper")
  if spec.kv_layout == KV_PAGED:
    return f"head dim {d}: gradients through paged KV have no CUDA backward"
  if "sm90_bwd" in _disable.disabled():
    return f"head dim {d}: {_disable.ENV} names sm90_bwd, the only CUDA backward above 128"
  if not _registration.sm90_bwd_built(d, q_dtype):
    return f"head dim {d}: this build has no sm90 backward for it (JAX_SGL_SM90_HEAD_DIMS)"
  if not _registration.local_cuda_devices_are_hopper():
    return f"head dim {d}: the CUDA backward above 128 runs on Hopper (compute capability 9.0) only"
  return None


def cuda_bwd_unsupported(spec: AttentionSpec, q_dtype) -> str | None:
  """Why the CUDA backward kernel does not serve this call (None when it does)."""
  if "cuda_bwd" in _disable.disabled():
    return f"{_disable.ENV} names cuda_bwd"
  if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
    return f"q/k/v are {jnp.dtype(q_dtype)}, the CUDA backward runs float16 and bfloat16"
  if spec.head_dim % 8 or spec.head_dim_v % 8:
    return (f"head dims {spec.head_dim}/{spec.head_dim_v}: the CUDA backward serves multiples of "
            "8")
  if max(spec.head_dim, spec.head_dim_v) > CUDA_BWD_MAX_HEAD_DIM:
    return _wide_bwd_unsupported(spec, q_dtype)
  return None


def padded_wide_bwd_spec(spec: AttentionSpec, q_dtype) -> AttentionSpec | None:
  """Head dims above 128 that the wide kernel does not serve as they are (between its head dims,
  or head_dim != head_dim_v, e.g. MLA's 192 / 128): the call zero-padded to the smallest of its
  head dims that holds both, where that one is served; else None. Zero features change no score
  (the softmax scale stays the call's), no output row (V's extra columns are 0) and no gradient
  of the real features; the extra columns of dq / dk / dv are dropped."""
  d = max(spec.head_dim, spec.head_dim_v)
  if d <= CUDA_BWD_MAX_HEAD_DIM or (spec.head_dim == spec.head_dim_v and
                                     d in SM90_BWD_WIDE_HEAD_DIMS):
    return None
  for wide in SM90_BWD_WIDE_HEAD_DIMS:
    padded = dataclasses.replace(spec, head_dim=wide, head_dim_v=wide)
    if wide >= d and cuda_bwd_unsupported(padded, q_dtype) is None:
      return padded
  return None


def _attention_bwd_padded(q, k, v, *rest, spec, present, padded):
  """The backward of a call on its zero-padded head dims (padded_wide_bwd_spec)."""
  n = len(OPTIONAL)
  optional, (out, lse, dout, dlse) = rest[:n], rest[n:]
  pad = _pad_features
  dq, dk, dv = _attention_bwd_local_p.bind(
      pad(q, padded.head_dim), pad(k, padded.head_dim), pad(v, padded.head_dim_v), *optional,
      pad(out, padded.head_dim_v), lse, pad(dout, padded.head_dim_v), dlse, spec=padded,
      present=present)
  return dq[..., :spec.head_dim], dk[..., :spec.head_dim], dv[..., :spec.head_dim_v]


_padded_bwd_rule = mlir.lower_fun(_attention_bwd_padded, multiple_results=True)


def _attention_bwd_lowering(ctx, *args, spec, present):
  if "cuda" in ctx.module_context.platforms:
    why = cuda_bwd_unsupported(spec, ctx.avals_in[0].dtype)
    padded = None if why is None else padded_wide_bwd_spec(spec, ctx.avals_in[0].dtype)
    if padded is not None:
      return _padded_bwd_rule(ctx, *args, spec=spec, present=present, padded=padded)
    if why is not None:
      warn_reference_once(BWD_TARGET, "cuda", f"the CUDA backward kernel is not used: {why}")
      return _reference_bwd_rule(ctx, *args, spec=spec, present=present)
  return _native_bwd_rule(ctx, *args, **_ffi_attrs(ctx, spec))


def _attention_bwd_reference(q, k, v, *rest, spec, present):
  """The vjp of the reference forward: the backward on platforms without a native kernel."""
  optional, (out, lse, dout, dlse) = rest[:len(OPTIONAL)], rest[len(OPTIONAL):]
  del out, lse   # the reference recomputes them
  _, vjp = jax.vjp(
      lambda q, k, v: _attention_fwd_reference(q, k, v, *optional, spec=spec, present=present),
      q, k, v)
  return vjp((dout, dlse))


_reference_bwd_rule = mlir.lower_fun(_attention_bwd_reference, multiple_results=True)


def _attention_bwd_batch(args, dims, *, spec, present):
  """vmap as in the forward: fold the mapped axis into the heads when the index arrays are
  shared, else map sequentially over the instances."""
  size = batch_size(args, dims)
  n = len(OPTIONAL)
  opt_dims = dims[3:3 + n]
  mapped = _map_if_index_batched(_attention_bwd_p, args, dims, opt_dims, size, spec=spec,
                                 present=present)
  if mapped is not None:
    return mapped

  front = [at_front(a, d, size) for a, d in zip(args, dims)]
  q, k, v = (_fold_heads(x, size) for x in front[:3])
  # Paged KV and fp8 never reach the backward, so the optional operands are index arrays (shared,
  # hence unbatched here), sinks (folded as in the forward) or absent.
  optional = [_fold_optional(name, x, d, size, spec) if name == "sinks" and p else x
              for name, x, d, p in zip(OPTIONAL, args[3:3 + n], opt_dims, present)]
  out, lse, dout, dlse = front[3 + n:]
  out, dout = _fold_heads(out, size), _fold_heads(dout, size)
  lse, dlse = _fold_lse(lse, size, spec.varlen_q), _fold_lse(dlse, size, spec.varlen_q)
  dq, dk, dv = _attention_bwd_p.bind(q, k, v, *optional, out, lse, dout, dlse,
                                     spec=_folded_spec(spec, size), present=present)
  return [_unfold_heads(dq, size, spec.num_heads), _unfold_heads(dk, size, spec.num_kv_heads),
          _unfold_heads(dv, size, spec.num_kv_heads)], [0, 0, 0]


_attention_bwd_p.def_abstract_eval(_attention_bwd_abstract_eval)
batching.primitive_batchers[_attention_bwd_p] = _attention_bwd_batch
_attention_bwd_local_p = partition_attention_bwd(_attention_bwd_p, _attention_bwd_abstract_eval)
register_lowerings(_attention_bwd_local_p, BWD_TARGET, _attention_bwd_lowering,
                   _attention_bwd_reference)


# --------------------------------------------------------------------------------------------
# custom_vjp joining the two
# --------------------------------------------------------------------------------------------

def _check_differentiable(spec: AttentionSpec, q, v) -> None:
  """Paged KV and fp8 are inference paths: say so at trace time rather than fail in a kernel."""
  if spec.kv_buffer:
    raise NotImplementedError(
        f"{ATTN_FN}: gradients through kv_buffer are not supported: a serving engine's fused KV "
        "cache is forward-only (inference), and the backward kernels take no dq-only path for "
        "it. Train with dense or varlen k/v.")
  if spec.kv_layout == KV_PAGED:
    raise NotImplementedError(
        f"{ATTN_FN}: gradients through paged KV are not supported; paged KV (page_table) is "
        "forward-only (inference). Train with dense or varlen (cu_seqlens_q/cu_seqlens_k) k/v.")
  if is_fp8(q.dtype) or is_fp8(v.dtype):
    raise NotImplementedError(
        f"{ATTN_FN}: gradients through fp8 inputs are not supported (q {q.dtype}, "
        f"v {v.dtype}); fp8 attention is forward-only. Differentiate with float32, float16 or "
        "bfloat16 q/k/v.")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention_diff(spec, present, q, k, v, optional):
  return tuple(_attention_fwd_p.bind(q, k, v, *optional, spec=spec, present=present))


def _attention_diff_fwd(spec, present, q, k, v, optional):
  _check_differentiable(spec, q, v)
  out, lse = _attention_fwd_p.bind(q, k, v, *optional, spec=spec, present=present)
  return (out, lse), (q, k, v, optional, out, lse)


def _sinks_grad(spec: AttentionSpec, out, lse, dout, dlse, sinks):
  """d loss / d sinks from saved values, in float32. With P_sink = exp(sink - lse) the sink's
  probability in a row (lse includes it), d out / d sink = -P_sink * out and d lse / d sink =
  P_sink, so each row adds P_sink * (dlse - rowsum(dout * out)). Rows that no sequence covers
  (lse -inf) add nothing."""
  dot = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [.., rows, H]
  dot = dot.T if spec.varlen_q else jnp.swapaxes(dot, 1, 2)                   # lse's layout
  sink = sinks[:, None] if spec.varlen_q else sinks[None, :, None]
  covered = lse > -jnp.inf
  p_sink = jnp.where(covered, jnp.exp(sink - jnp.where(covered, lse, 0.0)), 0.0)
  terms = p_sink * (dlse.astype(jnp.float32) - dot)
  return jnp.sum(terms, axis=-1) if spec.varlen_q else jnp.sum(terms, axis=(0, 2))


def _attention_diff_bwd(spec, present, residuals, cotangents):
  q, k, v, optional, out, lse = residuals
  dout, dlse = cotangents
  dq, dk, dv = _attention_bwd_p.bind(q, k, v, *optional, out, lse, dout.astype(out.dtype),
                                     dlse.astype(jnp.float32), spec=spec, present=present)
  # Index arrays and descales get no gradient; sinks do.
  d_optional = [None] * len(OPTIONAL)
  if present[OPTIONAL.index("sinks")]:
    d_optional[-1] = _sinks_grad(spec, out, lse, dout, dlse, optional[-1])
  return dq, dk, dv, tuple(d_optional)


_attention_diff.defvjp(_attention_diff_fwd, _attention_diff_bwd)


_PER_HEAD_DESCALES = ("q_descale", "k_descale", "v_descale")


def _descale_operand(x):
  """A per-head descale as the kernels take it: [batch, Hkv], [Hkv] or, per tensor, [1] (e.g.
  rope_pool_fused's k_scale / v_scale), never broadcast: the kernels index it with zero strides
  (HeadDescale), where a [batch, Hkv] copy would cost XLA a broadcast kernel per descale."""
  x = jnp.asarray(x)
  return jnp.reshape(x, (-1,)) if x.ndim < 2 else x


def attention(q, k=None, v=None, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
              cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, page_table=None,
              return_lse=False, q_descale=None, k_descale=None, v_descale=None, sinks=None,
              deterministic=False, kv_buffer=None):
  """Flash attention (forward, and backward under jax.grad).

  Layouts:
    dense:  q [batch, seqlen_q, num_heads, head_dim], k/v [batch, seqlen_k, num_kv_heads, D(_v)].
    varlen: q [total_q, H, D] with cu_seqlens_q [batch + 1]; k/v [total_k, Hkv, D] with
            cu_seqlens_k [batch + 1].
    paged:  k/v are pools, a token pool [num_slots, Hkv, D] (as written by rope_pool_fused) or a
            page pool [num_pages, page_size, Hkv, D]; page_table [batch, max_pages] int32 maps
            each sequence's pages (token pool: slots); seqused_k [batch] gives its length. q is
            dense or varlen. Entries outside [0, num_pages) are masked keys, never read.
    fused:  `kv_buffer` instead of k and v (pass k=None, v=None): a serving engine's one buffer
            per layer with K and V interleaved on the head axis (K0, V0, K1, V1, ...), as
            sglang-jax's MHATokenToKVPool keeps it: [num_pages, page_size, 2 * Hkv // packing,
            packing, head_dim_pad], [num_pages, page_size, 2 * Hkv, head_dim_pad], or a 3-D token
            pool [num_slots, 2 * Hkv, head_dim_pad]. It is paged (page_table and seqused_k
            required), q's dtype, and the kernels read K and V in place, the first D = q's head
            dim features of each padded head (D <= head_dim_pad; head_dim_v = D), never copying
            the pool. Forward-only: jax.grad raises NotImplementedError.
  seqused_k also limits the keys of dense and varlen sequences.

  Masks: `causal` aligns the last query with the last key (bottom-right, as FlashAttention), so
  decode and chunked prefill see their whole prefix. `window=(left, right)` keeps keys within
  left/right of that diagonal (-1: unbounded). `softcap > 0` applies softcap * tanh(s / softcap)
  to the scaled scores. GQA/MQA: num_heads a multiple of num_kv_heads.

  Attention sinks: `sinks` float32 [num_heads] gives each q head a logit that joins every row's
  softmax denominator (not multiplied by softmax_scale; it has no value vector), as gpt-oss uses
  them (FlashAttention-4 / FlashInfer semantics): out = sum_j exp(s_j - lse) v_j with
  lse = log(exp(sink) + sum_j exp(s_j)), and lse (returned) includes the sink. A fully masked row
  gives 0 and lse = sink. Differentiable: jax.grad reaches sinks.

  Dtypes: float32, float16, bfloat16 with float32 accumulation; fp8 (float8_e4m3fn/e5m2) q/k with
  q_descale/k_descale float32 [batch, num_kv_heads], fp8 v with v_descale (also beside bf16 q/k:
  SGLang's v_dequant path); fp8 output is bfloat16. A per-head descale may also be per kv head
  [num_kv_heads] or per tensor ([1] / []), read as given (no [batch, num_kv_heads] copy).

  Block-scaled q/k (SGLang's qk_blockscaled, the OCP MX format): float8_e4m3fn q/k with
  q_descale/k_descale of q's/k's shape with head_dim // 32 in place of head_dim, one scale per 32
  features: dense [B, Sq, H, D/32] / [B, Sk, Hkv, D/32], varlen [total_q, H, D/32] /
  [total_k, Hkv, D/32], paged K's a pool beside K's, [num_pages, page_size, Hkv, D/32] or
  [num_slots, Hkv, D/32] (with kv_buffer: those of its K view). Both float8_e8m0fnu
  (2^(e - 127)) or both float32 (else `Type mismatch: {sfq} != {sfk}`); head_dim a multiple of
  32. q/k element j means x[..., j] * scale[..., j // 32], exactly as float32 holds it (an e8m0
  scale is a power of two, so the product is exact while it stays a normal float32). The e8m0
  NaN encoding 0xff is not a scale: the CPU kernel rejects a call that reads one (a runtime
  error naming the argument); the pure-JAX reference follows the MX spec (the block is NaN).
  V is bf16/f16/f32 or fp8 with v_descale (no Type mismatch between q and v here, as in SGLang).
  Forward-only, CPU only: lowering for CUDA raises NotImplementedError (no block-scaled kernel).

  Gradients: differentiable (reverse mode) with respect to q, k and v for dense and varlen
  layouts in float32/float16/bfloat16, including through lse when `return_lse` (a loss on lse is
  handled exactly: d lse / d scores = P), and with respect to sinks. The backward kernel recomputes the probabilities from
  the saved lse (no second forward). Index arrays get no gradient. Paged KV and fp8 inputs are
  forward-only: differentiating through them raises NotImplementedError at trace time.
  `deterministic` (a Python bool): on a compute-capability-9.0 GPU, float16/bfloat16 calls
  (dense or varlen, head dims 64, 96, 128, 192, 256) run the Hopper backward, whose dQ is summed
  with float32 atomics by default (dK/dV are deterministic; dQ can differ in the last bits
  between runs); deterministic=True computes dQ with an atomic-free kernel instead, bitwise
  reproducible and a few percent slower. The CPU backward is always deterministic, so there it
  has no effect.
  On CUDA the native backward kernels serve float16/bfloat16 with head dims up to 128, and on
  Hopper every head dim up to 256 (192 and 256 as they are, others zero-padded to the next of
  them, head_dim != head_dim_v too); for float32, larger head dims off Hopper, or gradients
  traced while JAX_SGL_DISABLE names cuda_bwd, CUDA runs the backward as the vjp of the pure-JAX
  reference (correct, slower) and warns once.

  Returns:
    out in q's layout with head_dim_v (q's dtype; bfloat16 for fp8), and with `return_lse` also
    lse float32 [batch, num_heads, seqlen_q] (varlen: [num_heads, total_q]), the natural-log
    sum of exp of the scaled scores (and of the sink). Fully masked rows give 0 and -inf (with
    sinks: 0 and the sink).
  """
  spec = check_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                         softcap=softcap, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         seqused_k=seqused_k, page_table=page_table, q_descale=q_descale,
                         k_descale=k_descale, v_descale=v_descale, sinks=sinks,
                         deterministic=deterministic, kv_buffer=kv_buffer)
  if spec.kv_buffer:
    # Passed as both k and v: a page pool as [pages, page_size, 2 * Hkv, head_dim_pad] (merging
    # the packing axis is a bitcast in XLA), a token pool as it is. Token pools (fused or not)
    # keep their rank: inserting a unit page axis makes jax 0.10's XLA copy the whole pool.
    buf = kv_buffer_shape(ATTN_FN, kv_buffer)
    if kv_buffer.ndim != 3:
      kv_buffer = kv_buffer.reshape(buf.num_pages, buf.page_size, 2 * buf.num_kv_heads,
                                    buf.head_dim_pad)
    k = v = kv_buffer
  given = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
               page_table=page_table, q_descale=q_descale, k_descale=k_descale,
               v_descale=v_descale, sinks=sinks)
  present = tuple(given[name] is not None for name in OPTIONAL)
  operands = []
  for name in OPTIONAL:
    x = given[name]
    dtype = jnp.int32 if name in _INDEX_OPTIONAL else jnp.float32
    if spec.qk_blockscaled and name in ("q_descale", "k_descale"):
      dtype = x.dtype   # e8m0 block scales reach the kernel as stored (a quarter of the bytes)
    if x is not None and name in _PER_HEAD_DESCALES and not (
        spec.qk_blockscaled and name != "v_descale"):
      x = _descale_operand(x)
    operands.append(jnp.zeros((0,), dtype) if x is None else jnp.asarray(x).astype(dtype))
  out, lse = _attention_diff(spec, present, q, k, v, tuple(operands))
  return (out, lse) if return_lse else out
