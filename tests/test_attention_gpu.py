"""jax_sgl.attention on the CUDA backend against the pure-JAX reference (float32 oracle).

The matrix: layout (dense, varlen, paged token pool, paged page pool) x mask (none, causal, window,
softcap) x head dim x dtype, with the GQA ratio varying with the mask; ragged lengths, an empty
sequence, KV shorter than q and page tables with padding and out-of-range entries everywhere.
Then the decode path (q length 1..8 over a long paged KV, split-KV) and the CUDA-only limits.
Output buffers are poisoned (NaN left in the allocator) before each call, so an element the
kernel forgets to write shows up as NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from attention_cases import (check_kernel_output, matrix_case, padded_dense_case,
                             parametrize_matrix, random_normal, random_paged_kv,
                             turn_off_xla_autotuning)
from jax_sgl import reference
from jax_sgl._checks import check_attention

pytestmark = pytest.mark.gpu

turn_off_xla_autotuning()

LAYOUTS = ("dense", "varlen", "paged_token", "paged_page")
HEAD_DIMS = (64, 96, 128, 192, 256)
MASK_KW = {"none": {}, "causal": {"causal": True}, "window": {"window": (13, 4)},
           "softcap": {"softcap": 5.0, "causal": True}}
TOL = {jnp.dtype(jnp.bfloat16): 2.5e-2, jnp.dtype(jnp.float16): 4e-3}

# Ragged batch: an empty sequence, KV shorter than q (rows that see no key), long KV.
Q_LENS = (5, 0, 37, 19)
K_LENS = (70, 9, 20, 131)


def _reference(q, k, v, **kw):
  """The oracle with the public function's normalization (defaults, token pool as page size 1)."""
  spec = check_attention(q, k, v, causal=kw.get("causal", False),
                         softmax_scale=kw.get("softmax_scale"), window=kw.get("window", (-1, -1)),
                         softcap=kw.get("softcap", 0.0), cu_seqlens_q=kw.get("cu_seqlens_q"),
                         cu_seqlens_k=kw.get("cu_seqlens_k"), seqused_k=kw.get("seqused_k"),
                         page_table=kw.get("page_table"), q_descale=None, k_descale=None,
                         v_descale=None)
  if kw.get("page_table") is not None and k.ndim == 3:
    k, v = k[:, None], v[:, None]
  index = {name: jnp.asarray(kw[name]) for name in
           ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table") if kw.get(name) is not None}
  ref = functools.partial(
      reference.attention, kv_layout=spec.kv_layout, varlen_q=spec.varlen_q, batch=spec.batch,
      softmax_scale=spec.softmax_scale, softcap=spec.softcap, causal=spec.causal,
      window_left=spec.window_left, window_right=spec.window_right, out_dtype=spec.out_dtype)
  return jax.jit(ref)(q, k, v, **index)


def _make_case(layout, head_dim, head_dim_v, heads, dtype, seed, q_lens=Q_LENS, k_lens=K_LENS):
  """Returns (q, k, v, kwargs) for one layout over the ragged batch."""
  num_heads, num_kv_heads = heads
  rng = np.random.default_rng(seed)
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  if layout == "dense":
    return padded_dense_case(keys, q_lens, k_lens, heads, head_dim, head_dim_v, dtype)
  # Packed q with 3 trailing rows no sequence covers (they must come out 0 / -inf).
  cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = random_normal(keys[0], (int(cu_q[-1]) + 3, num_heads, head_dim), dtype)
  kw = {"cu_seqlens_q": jnp.asarray(cu_q)}
  if layout == "varlen":
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    k = random_normal(keys[1], (int(cu_k[-1]), num_kv_heads, head_dim), dtype)
    v = random_normal(keys[2], (int(cu_k[-1]), num_kv_heads, head_dim_v), dtype)
    kw["cu_seqlens_k"] = jnp.asarray(cu_k)
    return q, k, v, kw
  page_size = 1 if layout == "paged_token" else 16
  k, v, paged_kw = random_paged_kv(rng, keys, k_lens, page_size, num_kv_heads, head_dim,
                                   head_dim_v, dtype)
  return q, k, v, {**kw, **paged_kw}


def _check(q, k, v, kw):
  want_out, want_lse = _reference(q, k, v, **kw)
  check_kernel_output(lambda: jax_sgl.attention(q, k, v, return_lse=True, **kw), want_out,
                      want_lse, q.dtype, TOL[jnp.dtype(q.dtype)])


@parametrize_matrix(LAYOUTS, HEAD_DIMS)
def test_matrix(layout, mask, head_dim, dtype):
  q, k, v, kw = matrix_case(_make_case, layout, mask, head_dim, dtype)
  _check(q, k, v, {**kw, **MASK_KW[mask]})


@pytest.mark.parametrize("head_dim,head_dim_v", [(80, 80), (192, 128), (64, 128), (40, 24)])
@pytest.mark.parametrize("layout", ("dense", "paged_page"))
def test_other_head_dims(layout, head_dim, head_dim_v):
  """Head dims without their own kernel run zero-padded on the next one; d_v != d too."""
  q, k, v, kw = _make_case(layout, head_dim, head_dim_v, (4, 2), jnp.bfloat16, head_dim)
  _check(q, k, v, {**kw, "causal": True})


@pytest.mark.parametrize("mask", ("none", "causal", "window"))
@pytest.mark.parametrize("q_len", (1, 2, 4, 8))
def test_paged_decode(q_len, mask):
  """q length 1..8 per sequence over long paged KV: the decode kernels (decode/); split-KV
  partials are merged by the combine kernel. tests/test_attention_decode_gpu.py has the decode matrix."""
  batch, k_lens = 5, (1000, 1, 0, 517, 2048)
  q, k, v, kw = _make_case("paged_page", 128, 128, (32, 8), jnp.bfloat16, q_len,
                           q_lens=(q_len,) * batch, k_lens=k_lens)
  q = q[: batch * q_len].reshape(batch, q_len, 32, 128)   # dense q, as a decode step passes it
  del kw["cu_seqlens_q"]
  _check(q, k, v, {**kw, **MASK_KW[mask]})


@pytest.mark.parametrize("causal", (False, True))
def test_long_prefill(causal):
  """Several row blocks and many key blocks per CTA (and the fp16 path), KV longer than q."""
  keys = jax.random.split(jax.random.PRNGKey(7), 3)
  q = random_normal(keys[0], (2, 777, 8, 128), jnp.float16)
  k = random_normal(keys[1], (2, 989, 2, 128), jnp.float16)
  v = random_normal(keys[2], (2, 989, 2, 128), jnp.float16)
  _check(q, k, v, {"causal": causal})


def test_dense_kv_shorter_than_q():
  keys = jax.random.split(jax.random.PRNGKey(3), 3)
  q = random_normal(keys[0], (3, 99, 4, 64), jnp.bfloat16)
  k = random_normal(keys[1], (3, 19, 4, 64), jnp.bfloat16)
  v = random_normal(keys[2], (3, 19, 4, 64), jnp.bfloat16)
  _check(q, k, v, {"causal": True})
  _check(q, k, v, {"window": (5, 0)})


def test_jit_and_vmap():
  keys = jax.random.split(jax.random.PRNGKey(11), 3)
  q = random_normal(keys[0], (2, 3, 19, 4, 64), jnp.bfloat16)
  k = random_normal(keys[1], (2, 3, 33, 2, 64), jnp.bfloat16)
  v = random_normal(keys[2], (2, 3, 33, 2, 64), jnp.bfloat16)
  got = jax.jit(jax.vmap(lambda q, k, v: jax_sgl.attention(q, k, v, causal=True)))(q, k, v)
  for i in range(2):
    want, _ = _reference(q[i], k[i], v[i], causal=True)
    np.testing.assert_allclose(np.asarray(got[i].astype(jnp.float32)),
                               np.asarray(want.astype(jnp.float32)), atol=2.5e-2, rtol=2.5e-2)


def test_unsupported_dtype_raises():
  q = jnp.ones((1, 4, 2, 64), jnp.float32)
  with pytest.raises(NotImplementedError, match="CUDA kernel supports"):
    jax.jit(lambda q: jax_sgl.attention(q, q, q)).lower(q)
