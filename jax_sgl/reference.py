"""Pure-JAX float32 references of every jax_sgl op.

They are the test oracle and the lowering on platforms without a native kernel, so they are
written for clarity and static shapes (jit-able everywhere), not speed: attention materializes
the full score matrix of each sequence padded to the longest. They take arguments already
normalized by the public functions (see jax_sgl.attention / jax_sgl.rope_pool_fused), and follow
the same semantics: bottom-right causal alignment, masked keys for out-of-range page entries,
0 output and -inf LSE for fully masked rows (the sink's logit with attention sinks), nothing
written for negative or too-large slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_sgl._checks import DEFAULT_ROPE_BASE, KV_DENSE, KV_VARLEN, QK_SCALE_BLOCK
from jax_sgl._kv_buffer import kv_buffer_shape


# --------------------------------------------------------------------------------------------
# RoPE + pool write
# --------------------------------------------------------------------------------------------

def rope_inv_freq(rotary_dim: int, rope_base: float | None = None) -> np.ndarray:
  """inv_freq_i = base^(-2i / rotary_dim), float32 [rotary_dim // 2], base 10000 by default:
  evaluated in float64 and rounded once, the table every backend reads when the caller gives no
  inv_freq (a one-ulp difference would move the angle of position 4096 by ~2e-4 rad, far above
  float32 noise)."""
  rope_base = DEFAULT_ROPE_BASE if rope_base is None else float(rope_base)
  i = np.arange(rotary_dim // 2, dtype=np.float64)
  log2_base = np.float64(np.log2(np.float64(np.float32(rope_base))))
  return np.exp2(-(2.0 * i / rotary_dim) * log2_base).astype(np.float32)


def rope_cos_sin(positions, inv_freq):
  """cos/sin [num_tokens, rotary_dim // 2] in float32, angle_i = float32(pos) * inv_freq_i."""
  angle = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
  return jnp.cos(angle), jnp.sin(angle)


def apply_rope(x, cos, sin, *, rotary_dim: int, is_neox: bool):
  """Rotates x [T, H, D] in float32; features past rotary_dim pass through. Returns x's dtype."""
  xf = x.astype(jnp.float32)
  rot, rest = xf[..., :rotary_dim], xf[..., rotary_dim:]
  c, s = cos[:, None, :], sin[:, None, :]
  if is_neox:
    a, b = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
    rot = jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)
  else:
    a, b = rot[..., 0::2], rot[..., 1::2]
    rot = jnp.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(rot.shape)
  return jnp.concatenate([rot, rest], axis=-1).astype(x.dtype)


def _write_kv_buffer(kv_buffer, geo, idx, k_rot, v):
  """Rows idx of the fused buffer (its shape: geo), read as [num_slots, 2 * Hkv, Dp]: K heads at
  even positions of the head axis, V heads at odd ones, features [0, D) of each; the pad columns
  stay as they are."""
  d = k_rot.shape[-1]
  rows = kv_buffer.reshape(geo.num_slots, 2 * geo.num_kv_heads, geo.head_dim_pad)
  rows = rows.at[idx, 0::2, :d].set(k_rot.astype(rows.dtype), mode="drop")
  rows = rows.at[idx, 1::2, :d].set(v.astype(rows.dtype), mode="drop")
  return rows.reshape(kv_buffer.shape)


E4M3_MAX = 448.0


def quantize_e4m3(x, scale):
  """e4m3(x / scale) per KV head: x [T, Hkv, D], scale [] / [1] / [Hkv] float32. The quotient in
  float32, saturated at +-448 (the convert alone would make NaN of it), rounded to nearest even."""
  scale = jnp.reshape(jnp.asarray(scale, jnp.float32), (-1,))[None, :, None]
  # XLA rewrites A / broadcast(B) as A * broadcast(1 / B), one ulp off the quotient at times: the
  # barrier hands it a divisor of x's shape that it cannot see through.
  y = x.astype(jnp.float32) / jax.lax.optimization_barrier(jnp.broadcast_to(scale, x.shape))
  return jnp.clip(y, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def rope_pool_fused(q, k, v, positions, slots, k_pool=None, v_pool=None, *,
                    rope_base: float | None = None, rotary_dim: int | None = None,
                    is_neox: bool = True, inv_freq=None, kv_buffer=None, k_scale=None,
                    v_scale=None):
  """Returns (q_rot, k_rot, k_pool, v_pool) with rotated k and v written at `slots`, or
  (q_rot, k_rot, kv_buffer) with a fused kv_buffer. Frequencies: inv_freq, else rope_base
  (default 10000). With k_scale / v_scale the pools are e4m3 and get quantize_e4m3 of k_rot and
  v."""
  rotary_dim = q.shape[-1] if rotary_dim is None else rotary_dim
  if inv_freq is None:
    inv_freq = rope_inv_freq(rotary_dim, rope_base)
  cos, sin = rope_cos_sin(positions, inv_freq)
  q_rot = apply_rope(q, cos, sin, rotary_dim=rotary_dim, is_neox=is_neox)
  k_rot = apply_rope(k, cos, sin, rotary_dim=rotary_dim, is_neox=is_neox)
  geo = None if kv_buffer is None else kv_buffer_shape("jax_sgl.reference.rope_pool_fused",
                                                        kv_buffer)
  num_slots = k_pool.shape[0] if geo is None else geo.num_slots
  # Negative slots would wrap around in .at[]: send them past the end, where mode="drop" skips.
  idx = jnp.where(slots < 0, num_slots, slots)
  k_new, v_new = k_rot, v
  if k_scale is not None:
    k_new, v_new = quantize_e4m3(k_rot, k_scale), quantize_e4m3(v, v_scale)
  if geo is not None:
    return q_rot, k_rot, _write_kv_buffer(kv_buffer, geo, idx, k_new, v_new)
  k_pool = k_pool.at[idx].set(k_new.astype(k_pool.dtype), mode="drop")
  v_pool = v_pool.at[idx].set(v_new.astype(v_pool.dtype), mode="drop")
  return q_rot, k_rot, k_pool, v_pool


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------

def _clamped_ranges(cu, total):
  begin = jnp.clip(cu[:-1], 0, total)
  end = jnp.clip(cu[1:], begin, total)
  return begin, end - begin


def split_kv_buffer(kv_buffer, head_dim: int):
  """K and V sliced out of a fused buffer [pages, page_size, 2 * Hkv, head_dim_pad] (K at even
  heads, V at odd ones, the first head_dim features): copies, as an oracle may; the kernels read
  the buffer in place."""
  return kv_buffer[..., 0::2, :head_dim], kv_buffer[..., 1::2, :head_dim]


def dequantize_blocks(x, scale):
  """x [..., D] times its block scales [..., D // QK_SCALE_BLOCK] (element j by scale j // 32),
  in float32. An e8m0 scale converts exactly (a power of two; 0xff is NaN, as the MX spec says),
  so each product is exact while it stays a normal float32."""
  return x.astype(jnp.float32) * jnp.repeat(scale.astype(jnp.float32), QK_SCALE_BLOCK, axis=-1)


def attention(q, k, v, *, kv_layout: int, varlen_q: bool, batch: int, softmax_scale: float,
              softcap: float = 0.0, causal: bool = False, window_left: int = -1,
              window_right: int = -1, out_dtype=None, cu_seqlens_q=None, cu_seqlens_k=None,
              seqused_k=None, page_table=None, q_descale=None, k_descale=None, v_descale=None,
              sinks=None):
  """Attention in float32 over normalized operands; returns (out, lse).

  q: [B, Sq, H, D] or [total_q, H, D] (varlen_q); k/v: [B, Sk, Hkv, D] (KV_DENSE),
  [total_k, Hkv, D] (KV_VARLEN) or [num_pages, page_size, Hkv, D] (KV_PAGED).
  lse: [B, H, Sq], or [H, total_q] for varlen q.
  q_descale/k_descale/v_descale: per (batch, kv head) [B, Hkv], per kv head [Hkv] or per tensor
  [1] / []; q's and k's may instead be block scales with q's/k's rank (qk_blockscaled: q's/k's
  shape with D // 32 features, applied by dequantize_blocks).
  sinks: [H] float32 or None: each head's logit joins the softmax denominator (unscaled, no value
  vector), so lse' = logaddexp(lse, sink) and out *= exp(lse - lse'); a fully masked row gets 0
  and lse' = sink.
  """
  out_dtype = q.dtype if out_dtype is None else out_dtype
  if q_descale is not None and q_descale.ndim == q.ndim:   # block scales: dequantize up front
    q, k = dequantize_blocks(q, q_descale), dequantize_blocks(k, k_descale)
    q_descale = k_descale = None
  num_heads, head_dim = q.shape[-2:]
  num_kv_heads = k.shape[-2]
  group = num_heads // num_kv_heads
  f32 = jnp.float32

  # Queries as [B, Sq_pad, H, D] with a per-sequence length.
  if varlen_q:
    total_q = q.shape[0]
    q_begin, q_len = _clamped_ranges(cu_seqlens_q.astype(jnp.int32), total_q)
    sq = total_q
    rows = q_begin[:, None] + jnp.arange(sq)[None, :]
    q_valid = jnp.arange(sq)[None, :] < q_len[:, None]
    qb = q[jnp.clip(rows, 0, max(total_q - 1, 0))] if total_q else \
        jnp.zeros((batch, 0) + q.shape[1:], q.dtype)
  else:
    sq = q.shape[1]
    q_len = jnp.full((batch,), sq, jnp.int32)
    q_valid = jnp.ones((batch, sq), bool)
    qb = q

  # Keys as [B, Sk_pad, Hkv, D] with per-key validity and a per-sequence length.
  if kv_layout == KV_DENSE:
    sk = k.shape[1]
    k_cap = jnp.full((batch,), sk, jnp.int32)
    kb, vb = k, v
    key_ok = jnp.ones((batch, sk), bool)
  elif kv_layout == KV_VARLEN:
    total_k = k.shape[0]
    k_begin, k_cap = _clamped_ranges(cu_seqlens_k.astype(jnp.int32), total_k)
    sk = total_k
    krows = jnp.clip(k_begin[:, None] + jnp.arange(sk)[None, :], 0, max(total_k - 1, 0))
    kb, vb = k[krows], v[krows]
    key_ok = jnp.ones((batch, sk), bool)
  else:
    num_pages, page_size = k.shape[:2]
    max_pages = page_table.shape[1]
    sk = max_pages * page_size
    k_cap = jnp.full((batch,), sk, jnp.int32)
    j = jnp.arange(sk)
    page = page_table.astype(jnp.int32)[:, j // page_size]          # [B, Sk]
    key_ok = (page >= 0) & (page < num_pages)
    flat = jnp.clip(page, 0, max(num_pages - 1, 0)) * page_size + (j % page_size)[None, :]
    kf = k.reshape((num_pages * page_size,) + k.shape[2:])
    vf = v.reshape((num_pages * page_size,) + v.shape[2:])
    kb, vb = kf[flat], vf[flat]
  k_len = k_cap if seqused_k is None else jnp.clip(seqused_k.astype(jnp.int32), 0, k_cap)

  qf = qb.astype(f32)
  kf_ = kb.astype(f32)
  vf_ = vb.astype(f32)
  per_head = lambda d: None if d is None else jnp.broadcast_to(d, (batch, num_kv_heads))
  q_descale, k_descale, v_descale = map(per_head, (q_descale, k_descale, v_descale))
  if q_descale is not None:   # [B, Hkv] -> per q head
    qf = qf * jnp.repeat(q_descale, group, axis=1)[:, None, :, None]
  if k_descale is not None:
    kf_ = kf_ * k_descale[:, None, :, None]
  if v_descale is not None:
    vf_ = vf_ * v_descale[:, None, :, None]
  kf_ = jnp.repeat(kf_, group, axis=2)
  vf_ = jnp.repeat(vf_, group, axis=2)

  s = jnp.einsum("bqhd,bkhd->bhqk", qf, kf_, precision="highest") * np.float32(softmax_scale)
  if softcap > 0:
    s = softcap * jnp.tanh(s / softcap)

  # Keys no sequence may read (page tails past seqused_k, masked pages) hold whatever the pool
  # holds, NaN included: their V rows become zeros so that P = 0 never meets them in P V.
  readable = key_ok & (jnp.arange(sk)[None, :] < k_len[:, None])             # [B, Sk]
  vf_ = jnp.where(readable[:, :, None, None], vf_, 0.0)

  i = jnp.arange(sq)[None, :, None]
  jj = jnp.arange(sk)[None, None, :]
  diag = i + (k_len - q_len)[:, None, None]
  mask = (jj < k_len[:, None, None]) & key_ok[:, None, :] & q_valid[:, :, None]
  if window_left >= 0:
    mask &= jj >= diag - window_left
  if window_right >= 0 or causal:
    mask &= jj <= diag + (0 if causal else window_right)
  mask = mask[:, None]                                             # [B, 1, Sq, Sk]
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(s - m_safe), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(l > 0, l, 1.0), vf_, precision="highest")
  lse = jnp.where(l[..., 0] > 0, m_safe[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1)),
                  -jnp.inf)                                        # [B, H, Sq]
  if sinks is not None:
    lse_sink = jnp.logaddexp(lse, sinks.astype(f32)[None, :, None])
    o = o * jnp.swapaxes(jnp.exp(lse - lse_sink), 1, 2)[..., None]  # masked rows: exp(-inf) = 0
    lse = lse_sink

  if not varlen_q:
    return o.astype(out_dtype), lse
  # Scatter the padded rows back to the packed layout; rows no sequence covers stay 0 / -inf.
  total_q = q.shape[0]
  dest = jnp.where(q_valid, rows, total_q)                          # invalid -> dropped
  out = jnp.zeros((total_q, num_heads, o.shape[-1]), f32).at[dest].set(o, mode="drop")
  lse_packed = jnp.full((total_q, num_heads), -jnp.inf, f32).at[dest].set(
      jnp.swapaxes(lse, 1, 2), mode="drop")
  return out.astype(out_dtype), lse_packed.T
