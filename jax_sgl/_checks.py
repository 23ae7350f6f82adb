"""Every shape and dtype rule of jax_sgl, in one place.

The public functions call these on shapes and dtypes only, at trace time, so `jax.eval_shape` and
`jax.make_jaxpr` raise them without running a kernel. Messages taken from SGLang's kernels (the
seeds in shared/seeds) are verbatim; the others start with the function name and name the argument
and its shape. Each check returns a small frozen spec that the primitives use as static params.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jax_sgl._dtypes import (BLOCK_SCALE_DTYPES, E8M0, FLOAT_DTYPES, FP8_DTYPES, INDEX_DTYPES,
                             is_fp8, names)
from jax_sgl._kv_buffer import KvBufferShape, kv_buffer_shape

# Head dims the kernels are built for: multiples of 8 (16-byte rows of bf16) up to 256.
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8


def _shape(x) -> tuple[int, ...]:
  return tuple(x.shape)


def _check_index(fn: str, name: str, x, ndim: int) -> None:
  if jnp.dtype(x.dtype) not in INDEX_DTYPES:
    raise TypeError(f"{fn}: {name} must be int32 or int64, got {x.dtype} with shape {_shape(x)}")
  if x.ndim != ndim:
    raise ValueError(f"{fn}: {name} must be {ndim}-D, got shape {_shape(x)}")


# --------------------------------------------------------------------------------------------
# rope_pool_fused
# --------------------------------------------------------------------------------------------

ROPE_FN = "jax_sgl.rope_pool_fused"
DEFAULT_ROPE_BASE = 10000.0


@dataclasses.dataclass(frozen=True)
class RopePoolSpec:
  num_tokens: int
  num_qo_heads: int
  num_kv_heads: int
  head_dim: int
  num_slots: int       # pool rows: num_pages * page_size with a kv_buffer
  rotary_dim: int
  is_neox: bool
  kv_buffer_ndim: int  # 0: separate k_pool / v_pool; 3, 4 or 5: one fused kv_buffer of that rank
  kv_buffer_packing: int = 1  # the 5-D kv_buffer's packing axis (sharding needs it), else 1
  kv_scaled: bool = False     # an fp8 e4m3 pool, written as e4m3(x / scale) (check_rope_fp8_pool)


def _check_pool_form(k_pool, v_pool, kv_buffer) -> None:
  if kv_buffer is not None:
    if k_pool is not None or v_pool is not None:
      raise ValueError(f"{ROPE_FN}: give k_pool/v_pool or kv_buffer, not both")
  elif k_pool is None or v_pool is None:
    raise ValueError(f"{ROPE_FN}: needs k_pool and v_pool, or kv_buffer= (one fused K/V buffer)")
  elif k_pool.ndim != 3 or v_pool.ndim != 3:
    raise ValueError("rope_pool_fused expects pool tensors to be 3-D")


def _check_rope_kv_buffer(kv_buffer, k_shape, num_kv_heads: int, head_dim: int) -> int:
  """The fused buffer holds k's heads with room for head_dim; returns its rows (slots)."""
  geo = kv_buffer_shape(ROPE_FN, kv_buffer)
  if geo.num_kv_heads != num_kv_heads:
    raise ValueError(f"{ROPE_FN}: kv_buffer holds {geo.num_kv_heads} KV heads (K and V "
                     f"interleaved on its head axis) but k has {num_kv_heads}: k {k_shape}, "
                     f"kv_buffer {_shape(kv_buffer)}")
  if geo.head_dim_pad < head_dim:
    raise ValueError(f"{ROPE_FN}: kv_buffer's head dim {geo.head_dim_pad} is smaller than "
                     f"q/k/v's {head_dim}: kv_buffer {_shape(kv_buffer)}")
  return geo.num_slots


def _check_inv_freq(inv_freq, rope_base, rotary_dim: int) -> None:
  """Frequencies: rope_base (a static float) or the caller's inv_freq table, not both."""
  if inv_freq is not None:
    if rope_base is not None:
      raise ValueError(f"{ROPE_FN}: give rope_base or inv_freq, not both (inv_freq already "
                       "holds the frequencies)")
    if jnp.dtype(inv_freq.dtype) != jnp.float32:
      raise TypeError(f"{ROPE_FN}: inv_freq must be float32, got {inv_freq.dtype} with shape "
                      f"{_shape(inv_freq)}")
    if _shape(inv_freq) != (rotary_dim // 2,):
      raise ValueError(f"{ROPE_FN}: inv_freq must have shape [rotary_dim // 2] = "
                       f"({rotary_dim // 2},), got {_shape(inv_freq)}")
    return
  try:
    base = DEFAULT_ROPE_BASE if rope_base is None else float(rope_base)
  except TypeError:
    raise TypeError(f"{ROPE_FN}: rope_base must be a Python float (a static value), "
                    f"got {type(rope_base).__name__}") from None
  if not base > 0 or not math.isfinite(base):
    raise ValueError(f"{ROPE_FN}: rope_base must be a positive finite float, got {base}")


def _check_rope_scale(name: str, x, num_kv_heads: int) -> None:
  if jnp.dtype(x.dtype) != jnp.float32:
    raise TypeError(f"{ROPE_FN}: {name} must be float32, got {x.dtype} with shape {_shape(x)}")
  if _shape(x) not in ((), (1,), (num_kv_heads,)):
    raise ValueError(f"{ROPE_FN}: {name} must be one scale per tensor ([] or [1]) or per KV "
                     f"head [num_kv_heads] = ({num_kv_heads},), got {_shape(x)}")


def check_rope_fp8_pool(q_dtype, pool_dtypes, k_scale, v_scale, num_kv_heads: int) -> bool:
  """jax_sgl's fp8 KV cache: with k_scale and v_scale the pools may be float8_e4m3fn (the
  rotated k and v stored as e4m3(x / scale)). Returns whether the pools are fp8. Without scales
  the seed's rule stands, and its words are the error."""
  if k_scale is None and v_scale is None:
    if any(d != q_dtype for d in pool_dtypes):
      raise ValueError("pool dtypes must match q/k/v dtype")
    return False
  if k_scale is None or v_scale is None:
    raise ValueError(f"{ROPE_FN}: an fp8 pool needs both k_scale and v_scale, got only "
                     f"{'k_scale' if v_scale is None else 'v_scale'}")
  pool_dtype = jnp.dtype(pool_dtypes[0])
  if any(jnp.dtype(d) != pool_dtype for d in pool_dtypes):
    raise ValueError(f"{ROPE_FN}: k_pool and v_pool must have one dtype, got "
                     f"{pool_dtypes[0]} and {pool_dtypes[1]}")
  if pool_dtype == jnp.dtype(jnp.float8_e5m2):
    raise NotImplementedError(f"{ROPE_FN}: fp8 pools are served in float8_e4m3fn only (k_scale/"
                              f"v_scale given), got a {pool_dtype} pool")
  if pool_dtype != jnp.dtype(jnp.float8_e4m3fn):
    raise ValueError(f"{ROPE_FN}: k_scale/v_scale apply to a float8_e4m3fn pool only (they "
                     f"quantize on write), got a {pool_dtype} pool with {q_dtype} q/k/v")
  _check_rope_scale("k_scale", k_scale, num_kv_heads)
  _check_rope_scale("v_scale", v_scale, num_kv_heads)
  return True


def _is_5d(kv_buffer) -> bool:
  return kv_buffer is not None and kv_buffer.ndim == 5


def check_rope_pool(q, k, v, positions, slots, k_pool, v_pool, *, head_dim: int | None,
                    num_qo_heads: int | None, num_kv_heads: int | None, rope_base: Any,
                    rotary_dim: int | None, is_neox: bool, inv_freq=None,
                    kv_buffer=None, k_scale=None, v_scale=None) -> RopePoolSpec:
  """SGLang's checks in SGLang's order, then jax_sgl's own (the fused kv_buffer, dtypes, index
  types, rotary_dim, frequencies)."""
  if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
    raise ValueError("rope_pool_fused expects q/k/v to be 3-D")
  if positions.ndim != 1 or slots.ndim != 1:
    raise ValueError("rope_pool_fused expects positions/slots to be 1-D")
  _check_pool_form(k_pool, v_pool, kv_buffer)
  q_shape, k_shape = _shape(q), _shape(k)
  head_dim = q_shape[2] if head_dim is None else int(head_dim)
  num_qo_heads = q_shape[1] if num_qo_heads is None else int(num_qo_heads)
  num_kv_heads = k_shape[1] if num_kv_heads is None else int(num_kv_heads)
  if q_shape != (q_shape[0], num_qo_heads, head_dim):
    raise ValueError(f"q shape must be [num_tokens, num_qo_heads, head_dim], got {q_shape}")
  if k_shape != (q_shape[0], num_kv_heads, head_dim):
    raise ValueError(f"k shape must be [num_tokens, num_kv_heads, head_dim], got {k_shape}")
  if _shape(v) != k_shape:
    raise ValueError(f"v shape must match k shape, got {_shape(v)} vs {k_shape}")
  if _shape(positions) != (q_shape[0],) or _shape(slots) != (q_shape[0],):
    raise ValueError("positions/slots must have one entry per token")
  if kv_buffer is None:
    if _shape(k_pool)[1:] != (num_kv_heads, head_dim):
      raise ValueError(f"k_pool has incompatible shape {_shape(k_pool)}")
    if _shape(v_pool) != _shape(k_pool):
      raise ValueError(
          f"v_pool shape must match k_pool shape, got {_shape(v_pool)} vs {_shape(k_pool)}")
    num_slots, pool_dtypes = _shape(k_pool)[0], (k_pool.dtype, v_pool.dtype)
  else:
    num_slots = _check_rope_kv_buffer(kv_buffer, k_shape, num_kv_heads, head_dim)
    pool_dtypes = (kv_buffer.dtype,)
  if q.dtype != k.dtype or q.dtype != v.dtype:
    raise ValueError("q/k/v dtypes must match")
  kv_scaled = check_rope_fp8_pool(q.dtype, pool_dtypes, k_scale, v_scale, num_kv_heads)

  if jnp.dtype(q.dtype) not in FLOAT_DTYPES:
    raise TypeError(f"{ROPE_FN}: q/k/v dtype {q.dtype} is not supported; "
                    f"supported: {names(FLOAT_DTYPES)}")
  _check_index(ROPE_FN, "positions", positions, 1)
  _check_index(ROPE_FN, "slots", slots, 1)
  rotary_dim = head_dim if rotary_dim is None else int(rotary_dim)
  if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
    raise ValueError(f"{ROPE_FN}: rotary_dim must be even and in (0, head_dim={head_dim}], "
                     f"got {rotary_dim}")
  _check_inv_freq(inv_freq, rope_base, rotary_dim)
  return RopePoolSpec(num_tokens=q_shape[0], num_qo_heads=num_qo_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, num_slots=num_slots,
                      rotary_dim=rotary_dim, is_neox=bool(is_neox),
                      kv_buffer_ndim=0 if kv_buffer is None else kv_buffer.ndim,
                      kv_buffer_packing=_shape(kv_buffer)[3] if _is_5d(kv_buffer) else 1,
                      kv_scaled=kv_scaled)


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------

ATTN_FN = "jax_sgl.attention"
KV_DENSE, KV_VARLEN, KV_PAGED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  kv_layout: int       # KV_DENSE, KV_VARLEN or KV_PAGED
  varlen_q: bool       # q packed [total_q, H, D] with cu_seqlens_q
  batch: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  head_dim_v: int
  softmax_scale: float
  softcap: float
  causal: bool
  window_left: int
  window_right: int
  out_dtype: Any       # q's dtype, bfloat16 for fp8 q
  page_size: int       # paged only (1 for a token pool)
  deterministic: bool  # backward: bitwise reproducible dQ (no float atomics)
  # k and v are one fused buffer [num_pages, page_size, 2 * Hkv, head_dim_pad] (_kv_buffer.py),
  # passed as both operands; the kernels read K and V in place through strides.
  kv_buffer: bool = False
  # Paged k/v (or kv_buffer) given as a token pool [num_slots, Hkv, D], rank 3, page size 1.
  token_pool: bool = False
  # q_descale / k_descale are block scales (SGLang's qk_blockscaled): q's (k's) shape with
  # head_dim // QK_SCALE_BLOCK features, e8m0 or float32; else per (batch, kv head) float32.
  qk_blockscaled: bool = False


# Features per q/k block scale: the OCP MX block size, which SGLang's qk_blockscaled uses.
QK_SCALE_BLOCK = 32


def _check_head_dim(name: str, d: int) -> None:
  if d <= 0 or d > MAX_HEAD_DIM or d % HEAD_DIM_MULTIPLE:
    raise NotImplementedError(
        f"{ATTN_FN}: {name} {d} is not supported; supported: multiples of {HEAD_DIM_MULTIPLE} "
        f"from {HEAD_DIM_MULTIPLE} to {MAX_HEAD_DIM}")


def descale_shapes(batch: int, num_kv_heads: int) -> tuple[tuple[int, ...], ...]:
  """Per-head descale shapes: per (batch, kv head), per kv head or per tensor (the shapes
  rope_pool_fused's k_scale / v_scale take), each read by the kernels as given (HeadDescale)."""
  return (batch, num_kv_heads), (num_kv_heads,), (1,), ()


def _check_descale(name: str, x, batch: int, num_kv_heads: int) -> None:
  if jnp.dtype(x.dtype) != jnp.float32:
    raise TypeError(f"{ATTN_FN}: {name} must be float32, got {x.dtype} with shape {_shape(x)}")
  if _shape(x) not in descale_shapes(batch, num_kv_heads):
    block = "" if name == "v_descale" else \
        " (or, as block scales, the operand's shape with head_dim // 32 in place of head_dim)"
    raise ValueError(f"{ATTN_FN}: {name} must have shape [batch, num_kv_heads] = "
                     f"{(batch, num_kv_heads)}, [num_kv_heads] = ({num_kv_heads},), [1] or []"
                     f"{block}, got {_shape(x)}")


def _is_block_scale(scale, x) -> bool:
  """A q/k descale is a block scale when it has its operand's rank (per-head descales are 2-D and
  q/k never are) or the MX scale dtype."""
  return scale is not None and (scale.ndim == x.ndim or jnp.dtype(scale.dtype) == E8M0)


def _check_block_scale(name: str, scale, x, x_name: str, layout: str) -> None:
  """scale: x's shape with head_dim // QK_SCALE_BLOCK in place of head_dim, e8m0 or float32."""
  if jnp.dtype(scale.dtype) not in BLOCK_SCALE_DTYPES:
    raise TypeError(f"{ATTN_FN}: {name} (block scales) must be {names(BLOCK_SCALE_DTYPES)}, got "
                    f"{scale.dtype} with shape {_shape(scale)}")
  want = _shape(x)[:-1] + (_shape(x)[-1] // QK_SCALE_BLOCK,)
  if _shape(scale) != want:
    raise ValueError(f"{ATTN_FN}: {name} (block scales) must have {x_name}'s shape with "
                     f"head_dim // {QK_SCALE_BLOCK} last, {layout} = {want}, got "
                     f"{_shape(scale)} ({x_name} {_shape(x)})")


def _check_sinks(x, num_heads: int) -> None:
  """sinks: one float32 logit per q head (float32 because it joins the float32 softmax as is)."""
  if jnp.dtype(x.dtype) != jnp.float32:
    raise TypeError(f"{ATTN_FN}: sinks must be float32, got {x.dtype} with shape {_shape(x)}")
  if _shape(x) != (num_heads,):
    raise ValueError(f"{ATTN_FN}: sinks must have shape [num_heads] = ({num_heads},), "
                     f"got {_shape(x)}")


def check_attention_dtypes(q, k, v, q_descale, k_descale, v_descale) -> tuple[Any, bool]:
  """SGLang's dtype rules (flash_fwd_sm100), in its order; returns the output dtype and whether
  q/k are block-scaled (qk_blockscaled). Block-scale shapes are checked with the layout."""
  if is_fp8_kv_cache_read(q, k, k_descale):
    return _check_fp8_kv_cache_dtypes(q, k, v, q_descale, v_descale), False
  if q.dtype != k.dtype:
    raise TypeError(f"Type mismatch: {q.dtype} != {k.dtype}")
  v_dequant = is_fp8(v.dtype) and v_descale is not None
  blockscaled = _is_block_scale(q_descale, q) or _is_block_scale(k_descale, k)
  # Block-scaled q/k take a V of their own dtype (bf16, or fp8 with v_descale), as SGLang's does.
  if not blockscaled and not v_dequant and q.dtype != v.dtype:
    raise TypeError(f"Type mismatch: {q.dtype} != {v.dtype}")
  if is_fp8(q.dtype):
    if q_descale is None or k_descale is None:
      raise ValueError(f"{ATTN_FN}: fp8 q/k ({q.dtype}) need q_descale and k_descale "
                       "(float32 [batch, num_kv_heads], or block scales: q's and k's shapes with "
                       f"head_dim // {QK_SCALE_BLOCK} last)")
    if q_descale.dtype != k_descale.dtype:
      raise TypeError(f"Type mismatch: {q_descale.dtype} != {k_descale.dtype}")
    if blockscaled:
      _check_blockscaled_dtypes(q, k, v, q_descale, k_descale)
    if is_fp8(v.dtype) and v_descale is None:
      raise ValueError(f"{ATTN_FN}: fp8 v ({v.dtype}) needs v_descale "
                       "(float32 [batch, num_kv_heads])")
  elif jnp.dtype(q.dtype) not in FLOAT_DTYPES:
    raise TypeError(f"{ATTN_FN}: q dtype {q.dtype} is not supported; supported: "
                    f"{names(FLOAT_DTYPES + FP8_DTYPES)}")
  elif q_descale is not None or k_descale is not None:
    raise ValueError(f"{ATTN_FN}: q_descale/k_descale (descales or block scales) apply to fp8 "
                     f"q/k only, got q {q.dtype}")
  if v_descale is not None and not is_fp8(v.dtype):
    raise ValueError(f"{ATTN_FN}: v_descale applies to fp8 v only, got v {v.dtype}")
  out_dtype = jnp.dtype(jnp.bfloat16) if is_fp8(q.dtype) else jnp.dtype(q.dtype)
  return out_dtype, blockscaled


def is_fp8_kv_cache_read(q, k, k_descale) -> bool:
  """jax_sgl's fp8 KV cache (an extension of SGLang's rules): 16/32-bit q over fp8 k/v (an e4m3
  pool rope_pool_fused wrote) with k_descale. Without k_descale, k's dtype must be q's."""
  return k_descale is not None and is_fp8(k.dtype) and not is_fp8(q.dtype)


def _check_fp8_kv_cache_dtypes(q, k, v, q_descale, v_descale) -> Any:
  """The fp8 KV-cache read: k and v float8_e4m3fn, dequantized as stored * descale; returns q's
  dtype, the output's."""
  if jnp.dtype(q.dtype) not in FLOAT_DTYPES:
    raise TypeError(f"{ATTN_FN}: q dtype {q.dtype} is not supported; supported: "
                    f"{names(FLOAT_DTYPES + FP8_DTYPES)}")
  if jnp.dtype(k.dtype) != jnp.dtype(jnp.float8_e4m3fn):
    raise NotImplementedError(f"{ATTN_FN}: the fp8 KV cache ({q.dtype} q, k_descale) is served "
                              f"in float8_e4m3fn only, got k {k.dtype}")
  if v.dtype != k.dtype:
    raise TypeError(f"Type mismatch: {k.dtype} != {v.dtype} ({ATTN_FN}: an fp8 KV cache holds "
                    f"k and v in float8_e4m3fn)")
  if v_descale is None:
    raise ValueError(f"{ATTN_FN}: the fp8 KV cache (float8_e4m3fn k/v under {q.dtype} q) needs "
                     "v_descale as well as k_descale (float32 [batch, num_kv_heads], "
                     "[num_kv_heads], [1] or [])")
  if q_descale is not None:
    raise ValueError(f"{ATTN_FN}: q_descale applies to fp8 q only, got q {q.dtype} (the fp8 KV "
                     "cache takes k_descale and v_descale)")
  return jnp.dtype(q.dtype)


def _check_blockscaled_dtypes(q, k, v, q_descale, k_descale) -> None:
  """qk_blockscaled: both scales are block scales, q/k are e4m3 (MXFP8 E4M3), v a float dtype or
  fp8 (with v_descale, checked by the caller)."""
  if not (_is_block_scale(q_descale, q) and _is_block_scale(k_descale, k)):
    raise ValueError(f"{ATTN_FN}: q_descale and k_descale must both be block scales (q's and k's "
                     f"shapes with head_dim // {QK_SCALE_BLOCK} last) or both per (batch, kv "
                     f"head) descales [batch, num_kv_heads]; got q_descale {_shape(q_descale)}, "
                     f"k_descale {_shape(k_descale)} (q {_shape(q)}, k {_shape(k)})")
  if jnp.dtype(q.dtype) != jnp.dtype(jnp.float8_e4m3fn):
    raise NotImplementedError(f"{ATTN_FN}: block-scaled q/k (qk_blockscaled) are served for "
                              f"float8_e4m3fn q/k only, got {q.dtype}")
  if jnp.dtype(v.dtype) not in FLOAT_DTYPES + FP8_DTYPES:
    raise TypeError(f"{ATTN_FN}: v dtype {v.dtype} is not supported with block-scaled q/k; "
                    f"supported: {names(FLOAT_DTYPES + FP8_DTYPES)}")


def _check_attention_kv_buffer(q, k, v, kv_buffer, page_table, k_descale) -> KvBufferShape:
  """The kv_buffer form: no k/v beside it, a page table, and q's head dim within the padded one."""
  buf = kv_buffer_shape(ATTN_FN, kv_buffer)
  if k is not None or v is not None:
    given = ", ".join(f"{n} {_shape(x)}" for n, x in (("k", k), ("v", v)) if x is not None)
    raise ValueError(f"{ATTN_FN}: kv_buffer {_shape(kv_buffer)} holds K and V; pass k=None and "
                     f"v=None with it, got {given}")
  if page_table is None:
    raise ValueError(f"{ATTN_FN}: kv_buffer {_shape(kv_buffer)} is a paged pool and needs "
                     "page_table [batch, max_pages] and seqused_k [batch] (a 3-D token pool: "
                     "page_table holds slots)")
  # K shares q's dtype (SGLang's rule), and V is the same buffer: one dtype for all three. The
  # seed's words first, then which argument.
  if q.dtype != kv_buffer.dtype and not is_fp8_kv_cache_read(q, kv_buffer, k_descale):
    raise TypeError(f"Type mismatch: {q.dtype} != {kv_buffer.dtype} ({ATTN_FN}: kv_buffer "
                    f"{_shape(kv_buffer)} must have q's dtype, q {_shape(q)})")
  head_dim = _shape(q)[-1]
  if head_dim > buf.head_dim_pad:
    raise ValueError(f"{ATTN_FN}: q's head_dim {head_dim} (q {_shape(q)}) exceeds kv_buffer's "
                     f"padded head dim {buf.head_dim_pad} (kv_buffer {_shape(kv_buffer)})")
  # Every K/V row and the V offset must stay 16-byte aligned (the GPU kernels' vector loads and
  # TMA boxes): head_dim_pad a multiple of 8 elements (sglang-jax pads to 128).
  if buf.head_dim_pad % HEAD_DIM_MULTIPLE:
    raise ValueError(f"{ATTN_FN}: kv_buffer's padded head dim must be a multiple of "
                     f"{HEAD_DIM_MULTIPLE}, got shape {_shape(kv_buffer)}")
  return buf


def check_attention(q, k, v, *, causal: bool, softmax_scale, window, softcap, cu_seqlens_q,
                    cu_seqlens_k, seqused_k, page_table, q_descale, k_descale,
                    v_descale, sinks=None, deterministic=False, kv_buffer=None) -> AttentionSpec:
  # A traced or numpy bool would be silently truthy or fail later; the flag selects a kernel.
  if not isinstance(deterministic, bool):
    raise TypeError(f"{ATTN_FN}: deterministic must be a Python bool, got {deterministic!r} "
                    f"({type(deterministic).__name__})")
  buf = None
  if kv_buffer is not None:
    buf = _check_attention_kv_buffer(q, k, v, kv_buffer, page_table, k_descale)
    # From here on the buffer stands for both: the rules below see K and V as the views the
    # kernels read (heads Hkv, q's head dim, the buffer's page size).
    views = (buf.num_pages,) + ((buf.page_size,) if kv_buffer.ndim != 3 else ())
    k = v = jax.ShapeDtypeStruct(views + (buf.num_kv_heads, _shape(q)[-1]), kv_buffer.dtype)
  elif k is None or v is None:
    raise ValueError(f"{ATTN_FN}: k and v are required unless kv_buffer is given")
  out_dtype, blockscaled = check_attention_dtypes(q, k, v, q_descale, k_descale, v_descale)

  # Layout.
  paged = page_table is not None
  varlen_q = cu_seqlens_q is not None
  if paged:
    if cu_seqlens_k is not None:
      raise ValueError(f"{ATTN_FN}: paged KV (page_table) takes seqused_k, not cu_seqlens_k")
    if seqused_k is None:
      raise ValueError(f"{ATTN_FN}: paged KV (page_table) needs seqused_k [batch]")
    kv_layout = KV_PAGED
  elif cu_seqlens_k is not None:
    if not varlen_q:
      raise ValueError(f"{ATTN_FN}: cu_seqlens_k needs cu_seqlens_q (varlen q and k together)")
    kv_layout = KV_VARLEN
  else:
    if varlen_q:
      raise ValueError(f"{ATTN_FN}: cu_seqlens_q needs cu_seqlens_k, or page_table for paged KV")
    kv_layout = KV_DENSE

  q_ndim = 3 if varlen_q else 4
  if q.ndim != q_ndim:
    want = "[total_q, num_heads, head_dim]" if varlen_q else \
        "[batch, seqlen_q, num_heads, head_dim]"
    raise ValueError(f"{ATTN_FN}: q must be {want}, got shape {_shape(q)}")
  if kv_layout == KV_DENSE and k.ndim != 4:
    raise ValueError(f"{ATTN_FN}: k must be [batch, seqlen_k, num_kv_heads, head_dim], "
                     f"got shape {_shape(k)}")
  if kv_layout == KV_VARLEN and k.ndim != 3:
    raise ValueError(f"{ATTN_FN}: k must be [total_k, num_kv_heads, head_dim] with cu_seqlens_k, "
                     f"got shape {_shape(k)}")
  if kv_layout == KV_PAGED and k.ndim not in (3, 4):
    raise ValueError(f"{ATTN_FN}: paged k must be a token pool [num_slots, num_kv_heads, "
                     f"head_dim] or a page pool [num_pages, page_size, num_kv_heads, head_dim], "
                     f"got shape {_shape(k)}")
  if v.ndim != k.ndim or _shape(v)[:-1] != _shape(k)[:-1]:
    raise ValueError(f"{ATTN_FN}: v must match k in every dimension but head_dim, "
                     f"got v {_shape(v)} vs k {_shape(k)}")

  num_heads, head_dim = _shape(q)[-2:]
  num_kv_heads, k_head_dim = _shape(k)[-2:]
  head_dim_v = _shape(v)[-1]
  if k_head_dim != head_dim:
    raise ValueError(f"{ATTN_FN}: q and k head_dim differ: q {_shape(q)} vs k {_shape(k)}")
  _check_head_dim("head_dim", head_dim)
  _check_head_dim("head_dim_v", head_dim_v)
  if num_kv_heads == 0 or num_heads % num_kv_heads:
    raise ValueError(f"{ATTN_FN}: num_heads ({num_heads}) must be a multiple of num_kv_heads "
                     f"({num_kv_heads}); q {_shape(q)}, k {_shape(k)}")

  if varlen_q:
    _check_index(ATTN_FN, "cu_seqlens_q", cu_seqlens_q, 1)
    batch = _shape(cu_seqlens_q)[0] - 1
    if batch < 0:
      raise ValueError(f"{ATTN_FN}: cu_seqlens_q must have batch + 1 >= 1 entries, got shape "
                       f"{_shape(cu_seqlens_q)}")
  else:
    batch = _shape(q)[0]
  if kv_layout == KV_DENSE and _shape(k)[0] != batch:
    raise ValueError(f"{ATTN_FN}: q and k batch sizes differ: q {_shape(q)} vs k {_shape(k)}")
  if kv_layout == KV_VARLEN:
    _check_index(ATTN_FN, "cu_seqlens_k", cu_seqlens_k, 1)
    if _shape(cu_seqlens_k) != (batch + 1,):
      raise ValueError(f"{ATTN_FN}: cu_seqlens_k must have batch + 1 = {batch + 1} entries like "
                       f"cu_seqlens_q, got shape {_shape(cu_seqlens_k)}")
  if paged:
    _check_index(ATTN_FN, "page_table", page_table, 2)
    if _shape(page_table)[0] != batch:
      raise ValueError(f"{ATTN_FN}: page_table must be [batch={batch}, max_pages], got shape "
                       f"{_shape(page_table)}")
  if seqused_k is not None:
    _check_index(ATTN_FN, "seqused_k", seqused_k, 1)
    if _shape(seqused_k) != (batch,):
      raise ValueError(f"{ATTN_FN}: seqused_k must be [batch={batch}], got shape "
                       f"{_shape(seqused_k)}")
  if blockscaled:
    _check_blockscaled_shapes(q, k, q_descale, k_descale, head_dim, varlen_q, kv_layout)
  per_head = (("v_descale", v_descale),) if blockscaled else \
      (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
  for name, d in per_head:
    if d is not None:
      _check_descale(name, d, batch, num_kv_heads)
  if sinks is not None:
    _check_sinks(sinks, num_heads)

  # Masks and scalars.
  try:
    left, right = (int(w) for w in window)
  except (TypeError, ValueError):
    raise TypeError(f"{ATTN_FN}: window must be a pair of Python ints (left, right), "
                    f"got {window!r}") from None
  if left < -1 or right < -1:
    raise ValueError(f"{ATTN_FN}: window sizes must be >= 0, or -1 for unbounded; got {window}")
  if causal:
    if right > 0:
      raise ValueError(f"{ATTN_FN}: causal=True allows no keys right of the diagonal, but "
                       f"window={window} asks for {right}")
    right = 0
  scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
  softcap = float(softcap)
  if softcap < 0 or not math.isfinite(softcap):
    raise ValueError(f"{ATTN_FN}: softcap must be >= 0 (0 disables it), got {softcap}")
  return AttentionSpec(
      kv_layout=kv_layout, varlen_q=varlen_q, batch=batch, num_heads=num_heads,
      num_kv_heads=num_kv_heads, head_dim=head_dim, head_dim_v=head_dim_v, softmax_scale=scale,
      softcap=softcap, causal=bool(causal), window_left=left, window_right=right,
      out_dtype=out_dtype, page_size=(_shape(k)[1] if paged and k.ndim == 4 else 1),
      deterministic=deterministic, kv_buffer=buf is not None, token_pool=paged and k.ndim == 3,
      qk_blockscaled=blockscaled)


def _check_blockscaled_shapes(q, k, q_descale, k_descale, head_dim: int, varlen_q: bool,
                              kv_layout: int) -> None:
  """One scale per QK_SCALE_BLOCK features of every q and k row; paged K's scales are a pool
  beside K's (same pages and slots), a fused kv_buffer's those of its K view."""
  if head_dim % QK_SCALE_BLOCK:
    raise ValueError(f"{ATTN_FN}: block-scaled q/k need head_dim a multiple of "
                     f"{QK_SCALE_BLOCK} (one scale per {QK_SCALE_BLOCK} features), got head_dim "
                     f"{head_dim} (q {_shape(q)})")
  q_layout = ("[total_q, num_heads, head_dim // 32]" if varlen_q else
              "[batch, seqlen_q, num_heads, head_dim // 32]")
  if kv_layout == KV_DENSE:
    k_layout = "[batch, seqlen_k, num_kv_heads, head_dim // 32]"
  elif kv_layout == KV_VARLEN:
    k_layout = "[total_k, num_kv_heads, head_dim // 32]"
  elif k.ndim == 3:
    k_layout = "[num_slots, num_kv_heads, head_dim // 32]"
  else:
    k_layout = "[num_pages, page_size, num_kv_heads, head_dim // 32]"
  _check_block_scale("q_descale", q_descale, q, "q", q_layout)
  _check_block_scale("k_descale", k_descale, k, "k", k_layout)


# --------------------------------------------------------------------------------------------
# attention: limits of the CUDA kernel (checked when lowering for the CUDA platform only)
# --------------------------------------------------------------------------------------------

CUDA_ATTENTION_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def check_attention_cuda(q_dtype, v_dtype, qk_blockscaled: bool = False, k_dtype=None) -> None:
  """The CUDA kernels (ffi/cuda/attention) run float16/bfloat16 q/k/v and fp8 as float8_e4m3fn
  (check_fp8_cuda: e4m3 q/k/v, v_dequant, an fp8 KV cache; every call shape); float32 inputs have
  no GPU kernel. Every head dim the checks above accept is served (multiples of 8 up to 256, and
  head_dim_v != head_dim)."""
  k_dtype = q_dtype if k_dtype is None else k_dtype
  if qk_blockscaled:
    # Hopper has no block-scaled MMA, and the Blackwell collectives we build on (CUTLASS's FMHA)
    # do not use tcgen05's block-scaled MMA: named first, it is what a caller must know.
    raise NotImplementedError(
        f"{ATTN_FN}: block-scaled q/k (qk_blockscaled) runs on the CPU only: no CUDA kernel "
        "applies e8m0 block scales yet (the Hopper kernels have no block-scaled MMA and the "
        "Blackwell kernels' FMHA collectives do not use tcgen05's block-scaled MMA)")
  if any(is_fp8(t) for t in (q_dtype, k_dtype, v_dtype)):
    check_fp8_cuda(q_dtype, k_dtype, v_dtype)
    return
  if jnp.dtype(q_dtype) not in CUDA_ATTENTION_DTYPES or jnp.dtype(v_dtype) != jnp.dtype(q_dtype):
    raise NotImplementedError(
        f"{ATTN_FN}: the CUDA kernel supports q/k/v in {names(CUDA_ATTENTION_DTYPES)}; got q "
        f"{jnp.dtype(q_dtype)}, v {jnp.dtype(v_dtype)} (float32 inputs run on the CPU backend "
        "only)")


# Head-dim capacities of the CUDA portable kernel's fp8 form (ffi/cuda/attention/
# flash_fwd_launch.h kFp8HeadDimCapacities): a call runs on the smallest one >= its head dim.
CUDA_FP8_HEAD_DIM_CAPACITIES = (64, 128, 256)


def check_fp8_cuda(q_dtype, k_dtype, v_dtype) -> None:
  """fp8 on CUDA (the dtypes check_attention_dtypes accepted): float8_e4m3fn only, under float16/
  bfloat16 compute. The fp8-KV decode takes decode calls over an fp8 KV cache, the portable
  kernel's fp8 form every other call shape (dense, varlen, paged at any page size; fp8 q/k/v,
  v_dequant, chunked prefill / mixed batches / verify over an fp8 pool), except the e4m3 q/k/v
  calls the Hopper fp8 forward takes first (dense, varlen, paged; ffi/cuda/attention/
  fwd_dispatch.cc). Forward only: jax.grad through fp8 raises in jax_sgl.attention."""
  got = f"q {jnp.dtype(q_dtype)}, k {jnp.dtype(k_dtype)}, v {jnp.dtype(v_dtype)}"
  e4m3 = jnp.dtype(jnp.float8_e4m3fn)
  if any(is_fp8(t) and jnp.dtype(t) != e4m3 for t in (q_dtype, k_dtype, v_dtype)):
    raise NotImplementedError(f"{ATTN_FN}: the CUDA kernels read fp8 as float8_e4m3fn only; got "
                              f"{got} (float8_e5m2 runs on the CPU backend only)")
  if not is_fp8(q_dtype) and jnp.dtype(q_dtype) not in CUDA_ATTENTION_DTYPES:
    raise NotImplementedError(f"{ATTN_FN}: the CUDA kernels read fp8 k/v under float16 or "
                              f"bfloat16 q; got {got} ({jnp.dtype(q_dtype)} q over fp8 k/v runs "
                              "on the CPU backend only)")
