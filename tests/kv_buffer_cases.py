"""Random problems over a fused K/V buffer (sglang-jax's pool layout), shared by the CPU, GPU and
Metal tests of `jax_sgl.attention(q, kv_buffer=...)`.

The buffer is [num_pages, page_size, 2 * Hkv, head_dim_pad] with K head h at 2h and V head h at
2h + 1 (optionally reshaped to sglang-jax's 5-D packing form or the 3-D token pool). Every element
that no correct kernel reads holds NaN: the padding features D..head_dim_pad, pages the page table
does not name, and the slots of a sequence's last page past its length. K and V are also returned
sliced out of the buffer with NumPy (independently of jax_sgl), for the references.
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

import jax_sgl
from attention_cases import naive_attention, reference_attention


def make_buffer_case(*, seed, q_lens, k_lens, num_heads=4, num_kv_heads=2, head_dim=64,
                     head_dim_pad=128, page_size=16, dtype=jnp.bfloat16, form="4d", packing=2,
                     dense_q=False, extra_pages=3, table_seed=None):
  """Returns (q, kv_buffer, k, v, arrays): arrays holds page_table, seqused_k (and cu_seqlens_q
  unless dense_q: then q is [batch, q_len, H, D], every q_lens equal). Cases of one table_seed
  share their page table."""
  rng = np.random.default_rng(seed)
  batch, hkv, d = len(q_lens), num_kv_heads, head_dim
  ps = page_size
  pages_per_seq = [-(-kl // ps) for kl in k_lens]
  max_pages = max(pages_per_seq + [1]) + 1            # a spare column of padding
  num_pages = sum(pages_per_seq) + extra_pages         # some pages nobody names
  perm = np.random.default_rng(seed if table_seed is None else table_seed).permutation(num_pages)
  table = np.full((batch, max_pages), -1, np.int32)
  used = 0
  for b, n in enumerate(pages_per_seq):
    table[b, :n] = perm[used:used + n]
    used += n

  buf = np.full((num_pages, ps, 2 * hkv, head_dim_pad), np.nan, np.float32)
  for b, kl in enumerate(k_lens):
    for j in range(kl):
      buf[table[b, j // ps], j % ps, :, :d] = rng.standard_normal((2 * hkv, d))
  buf = jnp.asarray(buf).astype(dtype)
  k = np.asarray(buf[:, :, 0::2, :d].astype(jnp.float32)).astype(np.float32)
  v = np.asarray(buf[:, :, 1::2, :d].astype(jnp.float32)).astype(np.float32)
  k, v = jnp.asarray(k).astype(dtype), jnp.asarray(v).astype(dtype)
  if form == "5d":
    buf = buf.reshape(num_pages, ps, 2 * hkv // packing, packing, head_dim_pad)
  elif form == "3d":
    assert ps == 1
    buf = buf.reshape(num_pages, 2 * hkv, head_dim_pad)
    k, v = k[:, 0], v[:, 0]

  arrays = dict(page_table=jnp.asarray(table), seqused_k=jnp.asarray(np.array(k_lens, np.int32)))
  if dense_q:
    assert len(set(q_lens)) == 1
    q = rng.standard_normal((batch, q_lens[0], num_heads, d), dtype=np.float32)
  else:
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    arrays["cu_seqlens_q"] = jnp.asarray(cu_q)
    q = rng.standard_normal((int(cu_q[-1]), num_heads, d), dtype=np.float32)
  return jnp.asarray(q).astype(dtype), buf, k, v, arrays


def check_buffer_case(q, buf, k, v, arrays, *, tol, **flags):
  """attention(q, kv_buffer=buf) against the float32 reference on the sliced k/v (out and lse),
  and, FlashAttention's rule, its error vs a float64 oracle within 2x (+ slack) of the
  reference's error when the reference's output is rounded to q's dtype. Returns (out, lse)."""
  out, lse = jax_sgl.attention(q, None, None, kv_buffer=buf, return_lse=True, **arrays, **flags)
  ref_out, ref_lse = reference_attention(q, k, v, return_lse=True, **arrays, **flags)
  assert out.shape == ref_out.shape and out.dtype == q.dtype
  got, want = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
  assert np.isfinite(got).all(), "NaN from the buffer's padding, tails or unnamed pages"
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
  lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  fin = np.isfinite(ref_lse)
  np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-3, atol=2e-3)

  o64 = naive_attention(q, k, v, **arrays, **flags)
  rows = slice(0, o64.shape[0])
  err = np.abs(got[rows] - o64).max(initial=0.0)
  ref_err = np.abs(want[rows] - o64).max(initial=0.0)
  assert err <= 2 * ref_err + 1e-5, f"error {err:.3g} vs the reference's {ref_err:.3g}"
  return out, lse
