"""FlashAttention's gradient rule, shared by the GPU gradient tests of the Hopper and Blackwell
backwards: each of dQ / dK / dV from the kernel is within 3x (plus a small floor) of the error
that jax.grad of the pure-JAX reference makes in the input precision, both measured against a
float64 oracle (dense attention under x64, independent of reference.py, which computes in
float32). The oracle covers dense layouts: causal / sliding window (bottom-right aligned),
softcap, seqused_k, GQA and sinks; check_varlen_grads applies it sequence by sequence to packed
(cu_seqlens) calls. Arguments it lacks use the float32 reference as the oracle. Gradient buffers
are poisoned with NaN first, so an unwritten element fails."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_sgl
from attention_cases import poison_allocator, random_normal, reference_attention

# The kernel's error may be 3x the reference's in the input precision, plus a floor for entries
# that both round the same way (relative to the largest oracle entry).
FACTOR, FLOOR = 3.0, 2e-3
# Arguments the float64 oracle implements.
ORACLE_ARGS = ("causal", "sinks", "window", "softcap", "seqused_k")


def dense_inputs(shape, head_dim, dtype, seed):
  """q, k, v for (batch, seqlen_q, seqlen_k, num_heads, num_kv_heads), standard normal."""
  b, sq, sk, h, hkv = shape
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (random_normal(keys[0], (b, sq, h, head_dim), dtype),
          random_normal(keys[1], (b, sk, hkv, head_dim), dtype),
          random_normal(keys[2], (b, sk, hkv, head_dim), dtype))


def _loss(attn, w_out, w_lse):
  def loss(q, k, v):
    out, lse = attn(q, k, v)
    total = jnp.sum(out.astype(w_out.dtype) * w_out)
    if w_lse is not None:   # rows that see no key have lse = -inf: leave them out
      total += jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0).astype(w_lse.dtype) * w_lse)
    return total
  return loss


def _reference_grads(q, k, v, kw, w_out, w_lse):
  fn = _loss(lambda q, k, v: reference_attention(q, k, v, return_lse=True, **kw), w_out, w_lse)
  return jax.jit(jax.grad(fn, argnums=(0, 1, 2)))(q, k, v)


def _oracle_attention(q, k, v, kw):
  """Dense attention (GQA; sinks join the denominator unscaled; the causal diagonal and windows
  end at each sequence's last used key). Returns (out, lse [B, H, Sq]); a row that sees no key
  gives out 0 and lse -inf."""
  b, sq, h, d = q.shape
  sk, group = k.shape[1], h // k.shape[2]
  kk, vv = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(d)
  softcap = kw.get("softcap", 0.0)
  if softcap:
    s = softcap * jnp.tanh(s / softcap)
  used = kw.get("seqused_k")
  k_len = (jnp.full((b,), sk) if used is None else jnp.minimum(jnp.asarray(used), sk))
  k_len = k_len[:, None, None, None]
  rows = jnp.arange(sq)[None, None, :, None] + k_len - sq   # the row's diagonal key
  keys = jnp.arange(sk)[None, None, None, :]
  left, right = kw.get("window", (-1, -1))
  if kw.get("causal", False):
    right = 0
  visible = keys < k_len
  if left >= 0:
    visible &= keys >= rows - left
  if right >= 0:
    visible &= keys <= rows + right
  s = jnp.where(visible, s, -jnp.inf)
  sinks = kw.get("sinks")
  m = jnp.max(s, axis=-1, keepdims=True)
  if sinks is not None:
    m = jnp.maximum(m, sinks[None, :, None, None])
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.exp(s - m)
  z = jnp.sum(e, axis=-1, keepdims=True)
  if sinks is not None:
    z = z + jnp.exp(sinks[None, :, None, None] - m)
  covered = z > 0
  z_safe = jnp.where(covered, z, 1.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", e / z_safe, vv)
  lse = jnp.where(covered, jnp.log(z_safe) + m, -jnp.inf)[..., 0]
  return out, lse


def _oracle_grads(q, k, v, kw, w_out, w_lse):
  with jax.enable_x64(True):
    f64 = [jnp.asarray(np.asarray(x.astype(jnp.float32)), jnp.float64) for x in (q, k, v)]
    kw = dict(kw)
    if kw.get("sinks") is not None:
      kw["sinks"] = jnp.asarray(np.asarray(kw["sinks"]), jnp.float64)
    attn = lambda q, k, v: _oracle_attention(q, k, v, kw)
    w_lse = None if w_lse is None else jnp.asarray(w_lse)
    grads = jax.grad(_loss(attn, jnp.asarray(w_out), w_lse), argnums=(0, 1, 2))(*f64)
    return [np.asarray(g) for g in grads]


def check_grads(q, k, v, kw, *, with_lse=False, deterministic=False):
  """Our gradients against the oracle by FlashAttention's rule (dense q [B, Sq, H, D])."""
  rng = np.random.default_rng(7)
  w_out = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
  w_lse = rng.standard_normal((q.shape[0], q.shape[2], q.shape[1])) if with_lse else None
  oracle = all(n in ORACLE_ARGS for n in kw)
  want = _oracle_grads(q, k, v, kw, w_out, w_lse) if oracle else None
  w_out32 = jnp.asarray(w_out, jnp.float32)
  w_lse32 = None if w_lse is None else jnp.asarray(w_lse, jnp.float32)
  low = _reference_grads(q, k, v, kw, w_out32, w_lse32)   # the same math in the input dtype
  if want is None:   # arguments the float64 oracle lacks: the float32 reference
    with jax.default_matmul_precision("highest"):
      want = [np.asarray(g, np.float64) for g in _reference_grads(
          *(x.astype(jnp.float32) for x in (q, k, v)), kw, w_out32, w_lse32)]
  _compare(q, k, v, kw, w_out32, w_lse32, low, want, deterministic)


def _compare(q, k, v, kw, w_out32, w_lse32, low, want, deterministic):
  """Runs jax_sgl's gradients on NaN-poisoned buffers and applies the rule."""
  poison_allocator(sum(x.size * x.dtype.itemsize for x in (q, k, v)))
  fn = _loss(lambda q, k, v: jax_sgl.attention(q, k, v, return_lse=True,
                                               deterministic=deterministic, **kw), w_out32, w_lse32)
  got = jax.jit(jax.grad(fn, argnums=(0, 1, 2)))(q, k, v)
  for name, x, g, lo, r in zip("qkv", (q, k, v), got, low, want):
    assert g.shape == x.shape and g.dtype == x.dtype, name
    g = np.asarray(g.astype(jnp.float32), np.float64)
    lo = np.asarray(lo.astype(jnp.float32), np.float64)
    assert np.isfinite(g).all(), f"d{name}: unwritten (NaN) or non-finite elements"
    scale = max(float(np.max(np.abs(r))), 1e-6)
    err = float(np.max(np.abs(g - r))) / scale
    ref_err = float(np.max(np.abs(lo - r))) / scale
    assert err <= FACTOR * ref_err + FLOOR, (
        f"d{name}: error {err:.3g} > {FACTOR:g} x the reference's {ref_err:.3g} + {FLOOR:g}")


def bwd_kernel(q, k, v, kw):
  """The backward kernel the dispatch picks for this device (jax_sgl/_plan.py), e.g.
  ("bwd", "sm90_bwd"); None when the backward lowers to the reference (no native call)."""
  from jax_sgl._plan import cuda_attention_kernels
  cc = tuple(int(x) for x in jax.devices("cuda")[0].compute_capability.split("."))
  loss = lambda q, k, v: jax_sgl.attention(q, k, v, **kw).astype(jnp.float32).sum()
  kernels = cuda_attention_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, k, v,
                                   compute_capability=cc)
  return kernels[-1] if kernels[-1][0] == "bwd" else None


def varlen_inputs(q_lens, k_lens, heads, head_dim, dtype, seed, pad=3):
  """(q, k, v, kw): packed q and k / v over sequences of q_lens / k_lens rows, each with `pad`
  trailing rows that no sequence covers (their gradients must be 0), and the cu_seqlens in kw."""
  num_heads, num_kv_heads = heads
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
  q = random_normal(keys[0], (int(cu_q[-1]) + pad, num_heads, head_dim), dtype)
  k = random_normal(keys[1], (int(cu_k[-1]) + pad, num_kv_heads, head_dim), dtype)
  v = random_normal(keys[2], (int(cu_k[-1]) + pad, num_kv_heads, head_dim), dtype)
  return q, k, v, {"cu_seqlens_q": jnp.asarray(cu_q), "cu_seqlens_k": jnp.asarray(cu_k)}


def check_varlen_grads(q, k, v, kw, *, with_lse=False, deterministic=False):
  """The rule for a call with cu_seqlens_q and cu_seqlens_k: the float64 oracle and the
  input-precision reference run on each sequence alone (dense [1, len, H, D]) and are placed at
  its rows; rows no sequence covers want 0. `deterministic` may be a tuple of both modes: one
  oracle for both (it costs a compile per sequence length)."""
  cu_q, cu_k = np.asarray(kw["cu_seqlens_q"]), np.asarray(kw["cu_seqlens_k"])
  used = kw.get("seqused_k")
  seq_kw = {n: x for n, x in kw.items() if n in ORACLE_ARGS and n != "seqused_k"}
  rng = np.random.default_rng(7)
  w_out = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
  w_lse = rng.standard_normal((q.shape[1], q.shape[0])) if with_lse else None  # lse [H, total_q]
  want = [np.zeros(x.shape, np.float64) for x in (q, k, v)]
  low = [np.zeros(x.shape, np.float64) for x in (q, k, v)]
  for b in range(len(cu_q) - 1):
    iq, ik = np.s_[cu_q[b]:cu_q[b + 1]], np.s_[cu_k[b]:cu_k[b + 1]]
    qb, kb, vb = q[iq][None], k[ik][None], v[ik][None]
    k_len = kb.shape[1] if used is None else min(int(np.asarray(used)[b]), kb.shape[1])
    if qb.shape[1] == 0 or k_len == 0:
      continue   # no query or no key: every gradient of the sequence is 0
    kwb = dict(seq_kw)
    if used is not None:
      kwb["seqused_k"] = jnp.asarray([k_len], jnp.int32)
    wo = w_out[iq][None]
    wl = None if w_lse is None else w_lse[:, iq][None]
    parts = (_oracle_grads(qb, kb, vb, kwb, wo, wl),
             _reference_grads(qb, kb, vb, kwb, jnp.asarray(wo, jnp.float32),
                              None if wl is None else jnp.asarray(wl, jnp.float32)))
    for full, part in zip((want, low), parts):
      for j, idx in enumerate((iq, ik, ik)):
        full[j][idx] += np.asarray(part[j]).astype(np.float64)[0]
  low = [jnp.asarray(x, jnp.float32) for x in low]
  w_lse32 = None if w_lse is None else jnp.asarray(w_lse, jnp.float32)
  for det in (deterministic if isinstance(deterministic, tuple) else (deterministic,)):
    _compare(q, k, v, kw, jnp.asarray(w_out, jnp.float32), w_lse32, low, want, det)
