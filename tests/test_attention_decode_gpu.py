"""The CUDA decode kernels (ffi/cuda/attention/decode/) against the pure-JAX reference (float32
oracle).

Decode-shaped calls (at most 8 q rows per sequence) run on the dedicated decode kernels, picked by
shape and device alone: at most 16 packed rows (q length x GQA group) per (sequence, kv head) on
the warp-sliced forms (TMA loads where they serve: sm_90+, head dims up to 128, pages of a multiple
of 16 keys; else cp.async), more on the block-wide kernel.

The matrix: KV layout (page pools of page size 1, 16 and 64, dense, varlen) x q length 1..8 x
mask (none, causal, window, softcap) x GQA ratio (MHA, 4, 8, MQA, 16 with two row blocks), then
head dims 64..256 (and d != d_v) x dtype, varlen q, page sizes that are no power of two and pools
whose unreferenced pages hold NaN (a kernel that reads a masked key's row would show it).
Sequences are ragged: empty, one key, lengths that are no multiple of the page size, KV shorter
than q (rows that see no key), and long enough for many tiles per split. Page tables are shuffled
and carry padding and out-of-range entries (negative, past the pool, huge), also inside a used
range (those keys are masked). Outputs are poisoned before each call.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from attention_cases import (check_kernel_output, random_normal, random_paged_kv,
                             reference_attention, turn_off_xla_autotuning)

pytestmark = pytest.mark.gpu

turn_off_xla_autotuning()

TOL = {jnp.dtype(jnp.bfloat16): 2.5e-2, jnp.dtype(jnp.float16): 4e-3}
K_LENS = (1000, 0, 1, 517, 2053)
MASK_KW = {"none": {}, "causal": {"causal": True}, "window": {"window": (300, 2)},
           "softcap": {"softcap": 5.0, "causal": True}}


def _make(layout, q_len, heads, head_dim, dtype, seed, k_lens=K_LENS, head_dim_v=None,
          varlen_q=False):
  """(q, k, v, kwargs) of a decode step: dense q [B, q_len, H, D] over the given KV layout
  ("paged1", "paged16", "paged64", "dense", "varlen"); varlen_q packs q with cu_seqlens_q."""
  h, hkv = heads
  dv = head_dim if head_dim_v is None else head_dim_v
  rng = np.random.default_rng(seed)
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  batch = len(k_lens)
  kw = {}
  if varlen_q:
    q_lens = [min(q_len, 1 + b % 2) for b in range(batch)]  # ragged, total <= 8
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = random_normal(keys[0], (int(cu_q[-1]) + 1, h, head_dim), dtype)  # one uncovered row
    kw["cu_seqlens_q"] = jnp.asarray(cu_q)
  else:
    q = random_normal(keys[0], (batch, q_len, h, head_dim), dtype)
  if layout == "dense":
    sk = max(k_lens)
    k = random_normal(keys[1], (batch, sk, hkv, head_dim), dtype)
    v = random_normal(keys[2], (batch, sk, hkv, dv), dtype)
    kw["seqused_k"] = jnp.asarray(k_lens, jnp.int32)
    return q, k, v, kw
  if layout == "varlen":
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    k = random_normal(keys[1], (int(cu_k[-1]), hkv, head_dim), dtype)
    v = random_normal(keys[2], (int(cu_k[-1]), hkv, dv), dtype)
    kw["cu_seqlens_k"] = jnp.asarray(cu_k)
    if not varlen_q:  # a varlen KV comes with a varlen q in the public API
      kw["cu_seqlens_q"] = jnp.asarray(np.arange(batch + 1, dtype=np.int32) * q_len)
      q = q.reshape(batch * q_len, h, head_dim)
    return q, k, v, kw
  page_size = int(layout.removeprefix("paged"))
  k, v, paged_kw = random_paged_kv(rng, keys, k_lens, page_size, hkv, head_dim, dv, dtype)
  return q, k, v, {**kw, **paged_kw}


def _check(q, k, v, kw, kernel_kv=None):
  """The kernel on (q, k, v), or on kernel_kv's (k, v) when given, against the reference on
  (q, k, v)."""
  want_out, want_lse = jax.jit(lambda q, k, v: reference_attention(
      q, k, v, return_lse=True, **kw))(q, k, v)
  kk, kv = kernel_kv if kernel_kv is not None else (k, v)
  check_kernel_output(lambda: jax_sgl.attention(q, kk, kv, return_lse=True, **kw), want_out,
                      want_lse, q.dtype, TOL[jnp.dtype(q.dtype)])


def _seed(*parts):
  return zlib.crc32(repr(parts).encode()) % 1000


# (num_heads, num_kv_heads) per mask: GQA 4, GQA 8, MHA, MQA.
HEADS = {"none": (32, 8), "causal": (16, 2), "window": (4, 4), "softcap": (8, 1)}


@pytest.mark.parametrize("mask", MASK_KW)
@pytest.mark.parametrize("q_len", (1, 3, 8))
@pytest.mark.parametrize("layout", ("paged1", "paged16", "paged64", "dense", "varlen"))
def test_decode_layouts(layout, q_len, mask):
  q, k, v, kw = _make(layout, q_len, HEADS[mask], 128, jnp.bfloat16,
                      _seed(layout, q_len, mask))
  _check(q, k, v, {**kw, **MASK_KW[mask]})


@pytest.mark.parametrize("heads", ((4, 4), (8, 1), (32, 8), (48, 4), (64, 4)),
                         ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("q_len", (1, 2, 5, 8))
def test_decode_gqa(heads, q_len):
  """Packed rows from 1 to 128 per (sequence, kv head): one to four m16 tiles per CTA, and two
  row blocks (64 q heads / 4 kv heads x 8 rows); the warp forms up to 16 rows."""
  q, k, v, kw = _make("paged16", q_len, heads, 128, jnp.bfloat16, _seed(heads, q_len))
  _check(q, k, v, {**kw, "causal": True})


@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim,head_dim_v",
                         [(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (80, 80),
                          (192, 128), (40, 24)])
@pytest.mark.parametrize("q_len", (1, 5))
def test_decode_head_dims(q_len, head_dim, head_dim_v, dtype):
  q, k, v, kw = _make("paged16", q_len, (8, 2), head_dim, dtype,
                      _seed(q_len, head_dim, head_dim_v), head_dim_v=head_dim_v)
  _check(q, k, v, {**kw, "causal": True, "softcap": 10.0})


@pytest.mark.parametrize("layout", ("paged16", "varlen"))
def test_decode_varlen_q(layout):
  """A packed q of at most 8 rows in all (ragged per sequence, one uncovered row)."""
  q, k, v, kw = _make(layout, 2, (8, 2), 128, jnp.bfloat16, 17, varlen_q=True)
  _check(q, k, v, {**kw, "causal": True})


def test_decode_long_kv():
  """A single long sequence (many splits of many tiles each) next to a short one."""
  q, k, v, kw = _make("paged16", 1, (32, 8), 128, jnp.bfloat16, 23, k_lens=(40000, 7))
  _check(q, k, v, kw)


def _poison_unused_pages(k, v, table):
  """NaN in every page of the pool the page table does not name in range."""
  num_pages = k.shape[0]
  t = np.asarray(table)
  used = np.zeros(num_pages, bool)
  used[t[(t >= 0) & (t < num_pages)]] = True
  bad = jnp.asarray(~used).reshape((num_pages,) + (1,) * (k.ndim - 1))
  return jnp.where(bad, jnp.nan, k), jnp.where(bad, jnp.nan, v)


@pytest.mark.parametrize("q_len", (1, 4))
@pytest.mark.parametrize("layout", ("paged3", "paged7", "paged24", "paged1", "paged64"))
def test_decode_page_sizes_nan_pool(layout, q_len):
  """Page sizes that are no power of two (the page lookup's divide), stages that straddle pages,
  and NaN in the unreferenced pages: masked keys (bad entries, past the length) are never read."""
  q, k, v, kw = _make(layout, q_len, (32, 8), 128, jnp.bfloat16, _seed("nan", layout, q_len),
                      k_lens=(1000, 3, 517, 2053))
  # The reference gathers masked keys' rows (clamped pages) too, so it runs on the clean pool.
  _check(q, k, v, {**kw, "causal": True}, kernel_kv=_poison_unused_pages(k, v, kw["page_table"]))


def _poison_outside(k, v, k_lens, lo_hi):
  """NaN in every row of a dense [B, S, Hkv, D] K/V outside each sequence's [lo, hi) keys."""
  pos = jnp.arange(k.shape[1])[None, :]
  lo = jnp.asarray([lo_hi(n)[0] for n in k_lens])[:, None]
  hi = jnp.asarray([lo_hi(n)[1] for n in k_lens])[:, None]
  bad = ((pos < lo) | (pos >= hi))[:, :, None, None]
  return jnp.where(bad, jnp.nan, k), jnp.where(bad, jnp.nan, v)


@pytest.mark.parametrize("window", (None, 300))
def test_decode_dense_nan_outside_range(window):
  """Dense K/V holding NaN outside every sequence's key range (past seqused_k, and before a
  window's first key, which is no multiple of 16): the TMA form loads whole 16-row stages
  around those rows, so it must zero their V rows, and its -inf scores must mask their K rows."""
  k_lens = (1000, 1, 517, 2053, 0, 33)
  q, k, v, kw = _make("dense", 1, (32, 8), 128, jnp.bfloat16, _seed("nan_dense", window),
                      k_lens=k_lens)
  mask = {} if window is None else {"window": (window, 0)}
  lo_hi = (lambda n: (0, n)) if window is None else (lambda n: (max(n - 1 - window, 0), n))
  _check(q, k, v, {**kw, **mask}, kernel_kv=_poison_outside(k, v, k_lens, lo_hi))


@pytest.mark.parametrize("layout", ("paged16", "paged32", "paged48"))
def test_decode_paged_nan_page_tails(layout):
  """Pages of a multiple of 16 keys whose slots past each sequence's length hold NaN, and NaN in
  the unreferenced pages: the last stage of a sequence covers those slots."""
  k_lens = (1000, 3, 517, 2053)
  q, k, v, kw = _make(layout, 2, (32, 8), 128, jnp.bfloat16, _seed("nan_tail", layout),
                      k_lens=k_lens)
  page_size = k.shape[1]
  table = np.asarray(kw["page_table"])
  kk, vv = _poison_unused_pages(k, v, kw["page_table"])
  bad = np.zeros(k.shape[:2], bool)
  for b, n in enumerate(k_lens):
    last = (n - 1) // page_size
    page = table[b, last] if n > 0 else -1
    if 0 <= page < k.shape[0]:
      bad[page, n - last * page_size:] = True
  bad = jnp.asarray(bad)[:, :, None, None]
  kk, vv = jnp.where(bad, jnp.nan, kk), jnp.where(bad, jnp.nan, vv)
  _check(q, k, v, {**kw, "causal": True}, kernel_kv=(kk, vv))
