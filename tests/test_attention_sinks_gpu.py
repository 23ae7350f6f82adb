"""Attention sinks on every CUDA forward kernel family, and their gradient on CUDA, against the
pure-JAX reference (float32 oracle) on fresh random inputs.

Families, each picked by shape (and JAX_SGL_DISABLE, read when a call is lowered, hence
jax.clear_caches() after changing it):
  - the portable sm80 prefill (JAX_SGL_DISABLE=sm90 for dense/varlen; paged prefill always), with
    and without its split-KV (few CTAs over long keys) and the split combine;
  - the decode kernels: warp-sliced TMA form (pages of 16 keys on sm_90+), cp.async form (odd page
    sizes, token pools), block-wide kernel (more than 16 packed rows), split-KV decode (long KV,
    few sequences) through the split combine, the 64-bit-index form (a pool of 2^31+ rows);
  - the sm90 forward: dense, varlen and the dense tail split (its combine applies the sink).
Fully masked rows (KV shorter than q, empty sequences) give 0 and lse = sink. Outputs are
poisoned before each call (attention_cases.check_kernel_output).
"""

from __future__ import annotations

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from attention_cases import (check_kernel_output, is_sm90_device, make_case, poison_allocator,
                             reference_attention, turn_off_xla_autotuning)

pytestmark = pytest.mark.gpu

turn_off_xla_autotuning()

TOL = {jnp.dtype(jnp.bfloat16): 2.5e-2, jnp.dtype(jnp.float16): 4e-3}
MASKS = {"none": {}, "causal": {"causal": True}, "window": {"window": (37, 3)},
         "softcap": {"softcap": 5.0, "causal": True}}


@pytest.fixture(autouse=True)
def _gpu(monkeypatch):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU")
  monkeypatch.delenv("JAX_SGL_DISABLE", raising=False)
  jax.clear_caches()


def _sinks(num_heads, seed, hi=8.0):
  """Random sinks as large as a row's lse over hundreds of keys (log 1000 ~ 7), so the sink
  moves every output noticeably; never zeros."""
  return jnp.asarray(np.random.default_rng(seed + 77).uniform(-1.0, hi, num_heads), jnp.float32)


def _check(q, k, v, sinks, kw):
  want_out, want_lse = jax.jit(lambda q, k, v, s: reference_attention(
      q, k, v, sinks=s, return_lse=True, **kw))(q, k, v, sinks)
  check_kernel_output(lambda: jax_sgl.attention(q, k, v, sinks=sinks, return_lse=True, **kw),
                      want_out, want_lse, q.dtype, TOL[jnp.dtype(q.dtype)])
  return want_lse


def _seed(*parts):
  return zlib.crc32(repr(parts).encode()) % 1000


def _sm90_fwd_built(head_dim, dtype):
  built = jax_sgl.attention_backend_info()["kernels"].get("sm90_fwd", {})
  return head_dim in built.get("head_dims", ()) and jnp.dtype(dtype).name in built.get("dtypes", ())


# --------------------------------------------------------------------------------------------
# Portable sm80 prefill (and its split-KV + combine)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("layout", ["dense", "varlen", "paged_tokens", "paged_pages"])
def test_prefill_sm80(monkeypatch, layout, mask):
  monkeypatch.setenv("JAX_SGL_DISABLE", "sm90")
  jax.clear_caches()
  seed = _seed("prefill", layout, mask)
  # Ragged: an empty q sequence, KV shorter than q (rows that see no key under causal).
  q, k, v, kw = make_case(layout, seed=seed, q_lens=[37, 0, 130, 19], k_lens=[300, 9, 70, 19],
                          num_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
  _check(q, k, v, _sinks(8, seed), {**kw, **MASKS[mask]})


@pytest.mark.parametrize("head_dim", [64, 96, 192, 256])
def test_prefill_sm80_head_dims(monkeypatch, head_dim):
  monkeypatch.setenv("JAX_SGL_DISABLE", "sm90")
  jax.clear_caches()
  q, k, v, kw = make_case("varlen", seed=head_dim, q_lens=[33, 90], k_lens=[33, 200],
                          num_heads=6, num_kv_heads=3, head_dim=head_dim, dtype=jnp.float16)
  _check(q, k, v, _sinks(6, head_dim), dict(kw, causal=True))


def test_prefill_sm80_split_kv(monkeypatch):
  """One short q over a long KV: too few CTAs for a wave, so the prefill kernel splits the keys
  and the combine applies the sink once."""
  monkeypatch.setenv("JAX_SGL_DISABLE", "sm90")
  jax.clear_caches()
  q, k, v, kw = make_case("dense", seed=5, q_lens=[64], k_lens=[8000], num_heads=4,
                          num_kv_heads=4, head_dim=128)
  _check(q, k, v, _sinks(4, 5), dict(kw, window=(3000, 0)))


# --------------------------------------------------------------------------------------------
# Decode kernels
# --------------------------------------------------------------------------------------------

DECODE_K_LENS = [1000, 0, 1, 517, 2053]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("page_size", [16, 5, 1])   # TMA form (sm_90+), cp.async forms
@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_warp(page_size, q_len, mask):
  """q_len x group <= 16 packed rows: the warp-sliced kernels; long KV and few sequences: split-KV
  with the combine."""
  layout = "paged_tokens" if page_size == 1 else "paged_pages"
  seed = _seed("warp", page_size, q_len, mask)
  q, k, v, kw = make_case(layout, seed=seed, q_lens=[q_len] * 5, k_lens=DECODE_K_LENS,
                          num_heads=8, num_kv_heads=2, head_dim=128, page_size=page_size)
  _check(q, k, v, _sinks(8, seed), {**kw, **MASKS[mask]})


@pytest.mark.parametrize("q_len", [1, 8])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_decode_dense_varlen_kv(layout, q_len):
  q, k, v, kw = make_case(layout, seed=q_len, q_lens=[q_len] * 5, k_lens=DECODE_K_LENS,
                          num_heads=8, num_kv_heads=1, head_dim=64)
  if layout == "dense":
    kw["seqused_k"] = jnp.asarray(DECODE_K_LENS, jnp.int32)
  _check(q, k, v, _sinks(8, q_len), dict(kw, causal=True))


@pytest.mark.parametrize("heads", [(16, 4), (64, 4)])
@pytest.mark.parametrize("q_len", [5, 8])
def test_decode_block(heads, q_len):
  """More than 16 packed rows (q_len x group): the block-wide decode kernel (two row blocks at
  64 q heads over 4 kv heads x 8 rows)."""
  seed = _seed("block", heads, q_len)
  q, k, v, kw = make_case("paged_pages", seed=seed, q_lens=[q_len] * 5, k_lens=DECODE_K_LENS,
                          num_heads=heads[0], num_kv_heads=heads[1], head_dim=128, page_size=16)
  _check(q, k, v, _sinks(heads[0], seed), dict(kw, causal=True))


@pytest.mark.parametrize("head_dim", [64, 96, 192, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_decode_head_dims(head_dim, dtype):
  seed = _seed("hd", head_dim, dtype)
  q, k, v, kw = make_case("paged_pages", seed=seed, q_lens=[2] * 5, k_lens=DECODE_K_LENS,
                          num_heads=4, num_kv_heads=2, head_dim=head_dim, dtype=dtype,
                          page_size=16)
  _check(q, k, v, _sinks(4, seed), dict(kw, causal=True))


def test_decode_long_kv_many_splits():
  q, k, v, kw = make_case("paged_pages", seed=9, q_lens=[1, 1], k_lens=[30000, 7],
                          num_heads=8, num_kv_heads=8, head_dim=128, page_size=64)
  _check(q, k, v, _sinks(8, 9, hi=12.0), kw)


@pytest.mark.bigmem
def test_decode_over_a_pool_of_2_31_rows():
  """A pool of 2^31+ rows takes the block-wide decode kernel's 64-bit rows; the pages used lie
  past 2^31 rows. head_dim 8 keeps the two pools at 32 GiB each. The reference runs on a compact
  copy of the used pages (its int32 row index would overflow on the big pool)."""
  # Its 64 GiB starve the other workers of a parallel run (pytest -n: 7 of them failed to
  # allocate on the H200), so it runs only in a run of its own (marked bigmem: gpu_check.sh runs
  # those after the rest, without -n).
  if os.environ.get("PYTEST_XDIST_WORKER"):
    pytest.skip("needs ~70 GiB: run without pytest -n (tools/gpu_check.sh runs it alone)")
  stats = jax.devices()[0].memory_stats() or {}
  if stats.get("bytes_limit", 0) < 100 * 2**30:
    pytest.skip("needs ~70 GiB of free device memory")
  page_size, hkv, d, h = 2, 1, 8, 4
  num_pages = 2**30 + 64
  k_lens = [37, 1, 100]
  rng = np.random.default_rng(3)
  used = num_pages - 1 - rng.permutation(60)[:55]          # 55 distinct pages past 2^31 rows
  need = [-(-n // page_size) for n in k_lens]
  small_table = np.full((len(k_lens), max(need)), -1, np.int32)
  for b, n in enumerate(need):
    small_table[b, :n] = rng.permutation(len(used))[:n]   # indices into the compact pool
  big_table = np.where(small_table >= 0, used[np.maximum(small_table, 0)], -1).astype(np.int32)
  rand = lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  k_small, v_small = (rand((len(used), page_size, hkv, d)) for _ in range(2))
  fill = jax.jit(lambda x, i, vals: x.at[i].set(vals), donate_argnums=0)
  big = lambda small: fill(jnp.zeros((num_pages, page_size, hkv, d), jnp.bfloat16),
                           jnp.asarray(used, jnp.int32), small)
  q = rand((len(k_lens), 1, h, d))
  sinks = _sinks(h, 3, hi=5.0)
  kw = dict(seqused_k=jnp.asarray(k_lens, jnp.int32), causal=True)
  want_out, want_lse = reference_attention(q, k_small, v_small, sinks=sinks, return_lse=True,
                                           page_table=jnp.asarray(small_table), **kw)
  k, v = big(k_small), big(v_small)
  check_kernel_output(lambda: jax_sgl.attention(q, k, v, sinks=sinks, return_lse=True,
                                                page_table=jnp.asarray(big_table), **kw),
                      want_out, want_lse, q.dtype, TOL[jnp.dtype(q.dtype)])


# --------------------------------------------------------------------------------------------
# sm90 forward
# --------------------------------------------------------------------------------------------

def _need_sm90(head_dim, dtype=jnp.bfloat16):
  if not is_sm90_device():
    pytest.skip("the sm90 kernel needs a compute capability 9.0 device")
  if not _sm90_fwd_built(head_dim, dtype):
    pytest.skip(f"sm90 hdim{head_dim} {jnp.dtype(dtype).name} not in this build")


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_dense(head_dim, mask):
  """Dense q longer than k under causal: whole 128-row tiles whose rows see no key."""
  _need_sm90(head_dim)
  seed = _seed("sm90", head_dim, mask)
  q, k, v, kw = make_case("dense", seed=seed, q_lens=[700, 700], k_lens=[523, 523], num_heads=8,
                          num_kv_heads=2, head_dim=head_dim)
  _check(q, k, v, _sinks(8, seed), {**kw, **MASKS[mask]})


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_varlen(head_dim, mask):
  _need_sm90(head_dim)
  seed = _seed("sm90_varlen", head_dim, mask)
  q, k, v, kw = make_case("varlen", seed=seed, q_lens=[300, 1, 0, 129], k_lens=[200, 17, 5, 900],
                          num_heads=6, num_kv_heads=2, head_dim=head_dim)
  _check(q, k, v, _sinks(6, seed), {**kw, **MASKS[mask]})


def test_sm90_fp16():
  _need_sm90(128, jnp.float16)
  q, k, v, kw = make_case("dense", seed=4, q_lens=[300], k_lens=[700], num_heads=4,
                          num_kv_heads=4, head_dim=128, dtype=jnp.float16)
  _check(q, k, v, _sinks(4, 4), dict(kw, causal=True))


def _tail_lens():
  """(batch, seqlen_q, seqlen_k, heads, kv heads) with 128-row tiles just past a whole wave of
  the SMs (as tests/test_attention_sm90.py), so that the tail split runs."""
  sms = getattr(jax.devices()[0], "core_count", None) or 132
  blocks = -(-(sms + 1) // 4)
  return (1, 128 * blocks - 50, 1000, 4, 2)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_tail_split(head_dim):
  """Dense non-causal: the last partial wave's tiles run as key shares, merged by the tail
  combine, which applies the sink once. Bitwise repeatable."""
  _need_sm90(head_dim)
  b, sq, sk, h, hkv = _tail_lens()
  q, k, v, kw = make_case("dense", seed=head_dim, q_lens=[sq] * b, k_lens=[sk] * b, num_heads=h,
                          num_kv_heads=hkv, head_dim=head_dim)
  sinks = _sinks(h, head_dim)
  _check(q, k, v, sinks, kw)
  fn = jax.jit(lambda q, k, v, s: jax_sgl.attention(q, k, v, sinks=s, return_lse=True))
  first = [np.asarray(x) for x in fn(q, k, v, sinks)]
  poison_allocator(first[0].size * 2)
  again = [np.asarray(x) for x in fn(q, k, v, sinks)]
  np.testing.assert_array_equal(first[0].view(np.uint16), again[0].view(np.uint16))
  np.testing.assert_array_equal(first[1], again[1])


def test_sm90_and_portable_agree(monkeypatch):
  """The switch changes the kernel; both match the reference (above) and each other closely."""
  _need_sm90(128)
  q, k, v, kw = make_case("dense", seed=8, q_lens=[512, 512], k_lens=[512, 512], num_heads=4,
                          num_kv_heads=4, head_dim=128)
  sinks = _sinks(4, 8, hi=5.0)
  fn = jax.jit(lambda q, k, v: jax_sgl.attention(q, k, v, sinks=sinks, causal=True))
  sm90 = np.asarray(fn(q, k, v).astype(jnp.float32))
  monkeypatch.setenv("JAX_SGL_DISABLE", "sm90")
  jax.clear_caches()
  sm80 = np.asarray(fn(q, k, v).astype(jnp.float32))
  np.testing.assert_allclose(sm90, sm80, atol=2.5e-2, rtol=2.5e-2)


# --------------------------------------------------------------------------------------------
# Gradients on CUDA (d sinks included)
# --------------------------------------------------------------------------------------------

GRAD_TOL = {jnp.dtype(jnp.bfloat16): 1.5e-2, jnp.dtype(jnp.float16): 2e-3}


@pytest.mark.parametrize("bwd", ["sm90", "sm80"])
@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("layout,head_dim", [("dense", 128), ("dense", 64), ("varlen", 128)])
def test_grad(monkeypatch, bwd, layout, head_dim, with_lse):
  if bwd == "sm80":
    monkeypatch.setenv("JAX_SGL_DISABLE", "sm90_bwd")
  elif not is_sm90_device():
    pytest.skip("the sm90 backward needs a compute capability 9.0 device")
  jax.clear_caches()
  seed = _seed("grad", layout, head_dim, with_lse)
  q, k, v, kw = make_case(layout, seed=seed, q_lens=[200, 37], k_lens=[150, 300], num_heads=4,
                          num_kv_heads=2, head_dim=head_dim)
  kw = dict(kw, causal=True)
  sinks = _sinks(4, seed, hi=5.0)
  rng = np.random.default_rng(seed)
  out_shape = q.shape[:-1] + (v.shape[-1],)
  w_out = jnp.asarray(rng.standard_normal(out_shape), jnp.float32)
  lse_shape = jax.eval_shape(lambda: reference_attention(q, k, v, return_lse=True, **kw))[1].shape
  w_lse = jnp.asarray(rng.standard_normal(lse_shape), jnp.float32)

  def loss(attn):
    def f(q, k, v, s):
      out, lse = attn(q, k, v, s)
      total = jnp.sum(out.astype(jnp.float32) * w_out)
      if with_lse:
        total += jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)
      return total
    return f

  ours = jax.jit(jax.grad(loss(lambda q, k, v, s: jax_sgl.attention(
      q, k, v, sinks=s, return_lse=True, **kw)), argnums=(0, 1, 2, 3)))
  ref = jax.jit(jax.grad(loss(lambda q, k, v, s: reference_attention(
      q, k, v, sinks=s, return_lse=True, **kw)), argnums=(0, 1, 2, 3)))
  got = ours(q, k, v, sinks)
  want = ref(*(x.astype(jnp.float32) for x in (q, k, v)), sinks)
  tol = GRAD_TOL[jnp.dtype(q.dtype)]
  for name, x, g, r in zip(("q", "k", "v", "sinks"), (q, k, v, sinks), got, want):
    assert g.shape == x.shape and g.dtype == x.dtype, name
    g, r = np.asarray(g.astype(jnp.float32)), np.asarray(r)
    assert np.isfinite(g).all(), f"d{name} has non-finite entries"
    err = float(np.max(np.abs(g - r))) / max(float(np.max(np.abs(r))), 1e-6)
    assert err <= tol, f"d{name}: relative error {err:.3g} > {tol:g}"
