"""The CUDA decode over jax_sgl's fp8 KV cache (decode_warp_tma_fp8kv for pages of a multiple of 16
keys, decode_warp_cp_async_fp8kv for the others: e4m3 K/V pages under bf16 / fp16 q, dequantized
in registers, k_descale in the score scale, v_descale in the output).

rope_pool_fused on the CPU writes the e4m3 pool (its quantization is the one under test in
test_rope_pool_fp8.py), then the same call runs on the CPU kernel and on the GPU. The GPU output is
held to a float64 oracle on the dequantized values (stored x scale) by FlashAttention's rule (its
error at most twice that of the same math done in q's 16-bit type, plus a float32-noise floor),
and to the CPU kernel on the same inputs; LSE alike. The matrix: pages of 1, 5, 16 and 64 keys and
a 3-D token pool, GQA groups 1 / 4 / 8, q
lengths 1..8 (causal), head dims 64 / 128, ragged seqused_k with empty sequences and lengths that
are no multiple of the page size, pools whose unreferenced pages and page tails hold NaN,
out-of-range page-table entries (negative, past the pool) inside used ranges (masked keys), and
per-head, per-(batch, head) and scalar descales. Dense fp8 K/V and a fused kv_buffer too, and
softcap / window. The kernels' mmas are f16 under bf16 q too (each q row scaled by a power of two
into f16's top binade, folded back through the row's score scale): q rows of extreme and mixed
magnitudes (zero, f16-subnormal-sized, 1e-30, 1e25) within one GQA group, and bf16 q against the
same values as f16 q (the same scores, so LSEs equal to float32 rounding). A 16-row prefill over
the pool runs on the portable kernel's fp8 form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from attention_cases import naive_attention, poison_allocator, run_attention_on

pytestmark = pytest.mark.gpu

E4M3, BF16, F16 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float16
NAN_E4M3 = 0x7f


def _cpu():
  return jax.devices("cpu")[0]


def _gpu():
  return jax.devices("cuda")[0]


class Pool:
  """A paged e4m3 pool written by rope_pool_fused (on the CPU): sequences of k_lens tokens on
  shuffled pages; `bad` (batch, page index) entries point outside the pool (their keys are
  masked and never written). Unwritten rows (other pages, page tails) hold NaN."""

  def __init__(self, seed, k_lens, *, page, h, hkv, d, dtype, per_head=True, bad=()):
    rng = np.random.default_rng(seed)
    self.rng, self.dtype, self.page, self.h, self.hkv, self.d = rng, dtype, page, h, hkv, d
    self.k_lens = np.asarray(k_lens, np.int32)
    batch = len(k_lens)
    max_pages = max(1, max(-(-n // page) for n in k_lens))
    self.num_pages = batch * max_pages + 3
    pages = rng.permutation(self.num_pages)[:batch * max_pages].reshape(batch, max_pages)
    for b, j in bad:
      pages[b, j] = self.num_pages + 7 if (b + j) % 2 else -3
    self.page_table = pages.astype(np.int32)
    n_scales = hkv if per_head else 1
    self.k_scale = rng.uniform(0.01, 0.03, n_scales).astype(np.float32)
    self.v_scale = rng.uniform(0.01, 0.03, n_scales).astype(np.float32)
    tokens = int(self.k_lens.sum())
    f = lambda mag, *s: np.asarray(jnp.asarray(rng.standard_normal(s) * mag, jnp.float32).astype(
        dtype))
    n = max(tokens, 1)
    q, k, v = f(1.0, n, h, d), f(2.0, n, hkv, d), f(2.0, n, hkv, d)
    positions = np.concatenate([np.arange(n) for n in k_lens] + [np.zeros(0)]).astype(np.int32)
    seq = np.repeat(np.arange(batch), k_lens)
    pg = pages[seq, positions // page]
    slots = np.where((pg >= 0) & (pg < self.num_pages), pg * page + positions % page, -1)
    if tokens == 0:
      positions, slots = np.zeros(1, np.int32), np.full(1, -1)
    with jax.default_device(_cpu()):
      pool = jax.lax.bitcast_convert_type(
          jnp.full((self.num_pages * page, hkv, d), NAN_E4M3, jnp.uint8), E4M3)
      _, _, k_pool, v_pool = jax_sgl.rope_pool_fused(
          q, k, v, jnp.asarray(positions), jnp.asarray(slots, jnp.int32), pool, pool,
          k_scale=self.k_scale, v_scale=self.v_scale)
    shape = (self.num_pages, page, hkv, d)
    self.k_pages = np.asarray(k_pool).reshape(shape)
    self.v_pages = np.asarray(v_pool).reshape(shape)
    assert self.k_pages.dtype == E4M3

  def query(self, q_len, mags=(1.0,)):
    """Normal q; with `mags`, (sequence, position, head) row i times mags[i % len(mags)], so that
    one GQA group's rows (and a lane's two rows, packed rows r and r + 8) mix magnitudes."""
    x = self.rng.standard_normal((len(self.k_lens), q_len, self.h, self.d))
    m = np.resize(np.asarray(mags, np.float64), x.shape[:3])[..., None]
    return jnp.asarray(x * m, jnp.float32).astype(self.dtype)

  def arrays(self, descale="head"):
    b, hkv = len(self.k_lens), self.hkv

    def fit(x):
      if descale == "scalar":
        return np.float32(x[0])
      if descale == "batch_head":
        return np.ascontiguousarray(np.broadcast_to(x, (b, hkv)))
      return np.ascontiguousarray(np.broadcast_to(x, (hkv,)))

    return dict(page_table=self.page_table, seqused_k=self.k_lens,
                k_descale=fit(self.k_scale), v_descale=fit(self.v_scale))

  def dequantized(self):
    s = lambda x: np.broadcast_to(np.asarray(x, np.float64).reshape(-1), (self.hkv,))[:, None]
    return (np.asarray(self.k_pages).astype(np.float64) * s(self.k_scale),
            np.asarray(self.v_pages).astype(np.float64) * s(self.v_scale))


def _same_math_in(dtype, q, k64, v64, *, causal, page_table, seqused_k, **_):
  """The attention of q over the dequantized K/V done in q's 16-bit type (scores, softmax and
  P V rounded at every step): the error scale of FlashAttention's rule."""
  q = np.asarray(q, np.float32)
  hkv, d, page = k64.shape[2], k64.shape[3], k64.shape[1]
  h = q.shape[2]
  num_pages = k64.shape[0]
  pool_k, pool_v = k64.reshape(-1, hkv, d), v64.reshape(-1, hkv, d)
  cast = lambda x: jnp.asarray(x, jnp.float32).astype(dtype)
  outs = []
  for b in range(q.shape[0]):
    n = int(seqused_k[b])
    lq = q.shape[1]
    if n == 0:
      outs.append(np.zeros((lq, h, d)))
      continue
    pg = np.asarray(page_table)[b, np.arange(n) // page]
    ok = (pg >= 0) & (pg < num_pages)
    rows = np.clip(pg, 0, num_pages - 1) * page + np.arange(n) % page
    kb = cast(np.repeat(np.where(ok[:, None, None], pool_k[rows], 0), h // hkv, axis=1))
    vb = cast(np.repeat(np.where(ok[:, None, None], pool_v[rows], 0), h // hkv, axis=1))
    s = jnp.einsum("qhd,khd->hqk", cast(q[b]), kb, preferred_element_type=dtype)
    s = s * jnp.asarray(1 / np.sqrt(d), dtype)
    mask = np.broadcast_to(ok[None, :], (lq, n))
    if causal:
      mask = mask & (np.arange(n)[None, :] <= np.arange(lq)[:, None] + n - lq)
    s = jnp.where(mask[None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(jnp.isfinite(m), jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0)), 0).astype(dtype)
    o = jnp.einsum("hqk,khd->qhd", p, vb, preferred_element_type=dtype)
    l = jnp.swapaxes(jnp.sum(p, axis=-1), 0, 1)[..., None]
    outs.append(np.asarray(jnp.where(l > 0, o / jnp.where(l > 0, l, 1), 0), np.float64))
  return np.stack(outs)


def check(pool, q_len, *, causal, descale="head", mags=(1.0,)):
  q = pool.query(q_len, mags)
  arrays = pool.arrays(descale)
  kw = dict(causal=causal, **arrays)
  poison_allocator(q.size * 8)
  out, lse = run_attention_on(_gpu(), q, pool.k_pages, pool.v_pages, kw)
  cpu_out, cpu_lse = run_attention_on(_cpu(), q, pool.k_pages, pool.v_pages, kw)
  assert out.dtype == pool.dtype and out.shape == q.shape
  got = np.asarray(out, np.float64)
  assert np.isfinite(got).all(), "unwritten or non-finite output elements (a masked NaN read?)"
  k64, v64 = pool.dequantized()
  want, want_lse = naive_attention(q, k64, v64, causal=causal, return_lse=True,
                                   page_table=arrays["page_table"], seqused_k=arrays["seqused_k"])
  base = _same_math_in(pool.dtype, q, k64, v64, causal=causal, **arrays)
  err, base_err = np.abs(got - want).max(), np.abs(base - want).max()
  assert err <= 2 * base_err + 1e-5, (err, base_err)
  # The CPU kernel (float32 math on the same bytes and descales).
  tol = 2.5e-2 if pool.dtype == BF16 else 4e-3
  np.testing.assert_allclose(got, np.asarray(cpu_out, np.float64), atol=tol, rtol=tol)
  lse_np, cpu_lse_np = np.asarray(lse), np.asarray(cpu_lse)
  np.testing.assert_array_equal(np.isneginf(lse_np), np.isneginf(cpu_lse_np))
  fin = np.isfinite(cpu_lse_np)
  np.testing.assert_allclose(lse_np[fin], cpu_lse_np[fin], atol=2e-3, rtol=1e-3)
  want_lse = np.swapaxes(want_lse, 1, 2)   # the oracle's [B, Sq, H] as jax_sgl's [B, H, Sq]
  np.testing.assert_array_equal(np.isneginf(lse_np), np.isneginf(want_lse))
  np.testing.assert_allclose(lse_np[fin], want_lse[fin], atol=2e-3, rtol=1e-3)


# Ragged: empty, one key, no multiple of the page size, several pages, long enough for splits.
K_LENS = [0, 1, 37, 130, 700, 2051]


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("page", [1, 5, 16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_decode(dtype, page, group):
  pool = Pool(page + group, K_LENS, page=page, h=4 * group, hkv=4, d=128, dtype=dtype,
              bad=[(2, 1), (4, 3), (5, 0)])
  check(pool, 1, causal=False)


# q row magnitudes: zero rows, rows far below and far above 1 (bf16: past f16's range both ways,
# where only the per-row power of two keeps them; f16: its subnormals and near its top after the
# scores' growth), each GQA group mixing them.
ROW_MAGS = {
    BF16: (1.0, 0.0, 1e-30, 3e-3, 40.0, 1e25, 2.0**-60, 1e4, 7.0),
    F16: (1.0, 0.0, 1e-7, 3e-3, 40.0, 100.0, 2.0**-20, 0.5, 7.0),
}


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("page", [5, 16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_q_row_magnitudes(dtype, group, d, page):
  """Both forms (pages of 5: cp.async, 16: TMA), GQA groups 1 / 4 / 8 (8: two q rows per sequence,
  so a lane's rows r and r + 8 are both real), ragged lengths with NaN page tails."""
  pool = Pool(3 * group + d + page, K_LENS, page=page, h=2 * group, hkv=2, d=d, dtype=dtype,
              bad=[(4, 1)])
  q_len = 2 if group == 8 else 1
  check(pool, q_len, causal=q_len > 1, mags=ROW_MAGS[dtype])


@pytest.mark.parametrize("d", [64, 128])
def test_bf16_q_scores_match_f16_q(d):
  """bf16 q holding values f16 holds exactly (no f16 subnormals) and the same values as f16 q: the
  bf16 kernel's scores are (2^e q) . k times score scale x 2^-e, powers of two, so its softmax is
  the f16 kernel's (TMA form: the same registers, plan and splits for both types) and the LSEs
  agree to float32 rounding (bitwise where the mma's accumulation is scale-invariant); a wrong
  power of two would move them by whole factors. The outputs differ by their last rounding."""
  pool = Pool(41 + d, K_LENS, page=16, h=8, hkv=2, d=d, dtype=BF16, bad=[(4, 1)])
  q = np.asarray(pool.query(1, (1.0, 30.0, 0.01, 1.0)), np.float32)
  q = np.where(np.abs(q) < 2.0**-10, 0.0, q).astype(np.float32)
  q_bf, q_f16 = jnp.asarray(q).astype(BF16), jnp.asarray(q).astype(F16)
  np.testing.assert_array_equal(np.asarray(q_bf, np.float32), np.asarray(q_f16, np.float32))
  kw = dict(causal=False, **pool.arrays())
  out_bf, lse_bf = run_attention_on(_gpu(), q_bf, pool.k_pages, pool.v_pages, kw)
  out_f16, lse_f16 = run_attention_on(_gpu(), q_f16, pool.k_pages, pool.v_pages, kw)
  np.testing.assert_allclose(np.asarray(lse_bf), np.asarray(lse_f16), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(out_bf, np.float32), np.asarray(out_f16, np.float32),
                             atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("page", [5, 16])
@pytest.mark.parametrize("q_len,group", [(2, 8), (4, 4), (8, 2), (3, 1)])
def test_short_q_causal(q_len, group, page):
  pool = Pool(11 * q_len, K_LENS, page=page, h=2 * group, hkv=2, d=128, dtype=BF16, bad=[(3, 2)])
  check(pool, q_len, causal=True)


@pytest.mark.parametrize("page", [5, 16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("descale", ["head", "batch_head", "scalar"])
def test_head_dims_and_descales(d, descale, page):
  pool = Pool(d + page, K_LENS, page=page, h=16, hkv=2, d=d, dtype=F16,
              per_head=descale != "scalar", bad=[(4, 1)])
  check(pool, 1, causal=False, descale=descale)


def test_descale_shapes_agree_on_the_gpu():
  """Per-head and per-(batch, head) descales with the same values give the same bits."""
  pool = Pool(5, [24, 9, 300], page=16, h=8, hkv=2, d=128, dtype=BF16)
  q = pool.query(1)
  a, b = (run_attention_on(_gpu(), q, pool.k_pages, pool.v_pages,
                           dict(causal=False, **pool.arrays(s)))[0]
          for s in ("head", "batch_head"))
  np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_token_pool():
  """A 3-D token pool [num_slots, Hkv, D] (page size 1; the cp.async form): page_table holds
  slots."""
  pool = Pool(21, K_LENS, page=1, h=16, hkv=4, d=128, dtype=BF16, bad=[(3, 5), (4, 100)])
  q = pool.query(1)
  arrays = pool.arrays()
  k_tok = pool.k_pages.reshape(-1, 4, 128)
  v_tok = pool.v_pages.reshape(-1, 4, 128)
  kw = dict(causal=False, **arrays)
  out, lse = run_attention_on(_gpu(), q, k_tok, v_tok, kw)
  paged, paged_lse = run_attention_on(_gpu(), q, pool.k_pages, pool.v_pages, kw)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(paged, np.float32))
  check(pool, 1, causal=False)


@pytest.mark.parametrize("page", [5, 16])
def test_kv_buffer_reads_as_its_k_and_v_pools(page):
  """A fused fp8 K/V buffer [pages, page, 2 Hkv, D] (K heads even, V heads odd) gives the bits of
  the same pools passed apart: both forms read K and V through the params' strides."""
  pool = Pool(31 + page, K_LENS, page=page, h=8, hkv=2, d=128, dtype=BF16, bad=[(4, 2)])
  buf = np.empty(pool.k_pages.shape[:2] + (4, 128), pool.k_pages.dtype)
  buf[:, :, 0::2], buf[:, :, 1::2] = pool.k_pages, pool.v_pages
  q = pool.query(1)
  arrays = {n: jax.device_put(np.asarray(x), _gpu()) for n, x in pool.arrays().items()}
  fused = jax.jit(lambda q, b, a: jax_sgl.attention(q, kv_buffer=b, **a))(
      jax.device_put(np.asarray(q), _gpu()), jax.device_put(buf, _gpu()), arrays)
  split, _ = run_attention_on(_gpu(), q, pool.k_pages, pool.v_pages,
                              dict(causal=False, **pool.arrays()))
  np.testing.assert_array_equal(np.asarray(fused, np.float32), np.asarray(split, np.float32))


@pytest.mark.parametrize("page", [5, 16])
def test_prefill_shape_runs_on_the_portable_fp8_kernel(page):
  """16 q rows per sequence: past the fp8-KV decode, the portable kernel's fp8 form
  (test_attention_fp8_gpu.py has the full matrix)."""
  pool = Pool(3 + page, K_LENS, page=page, h=8, hkv=2, d=128, dtype=BF16, bad=[(4, 1)])
  check(pool, 16, causal=True)


@pytest.mark.parametrize("page", [5, 16])
@pytest.mark.parametrize("extra", [dict(softcap=20.0), dict(window=(64, 0))])
def test_softcap_and_window_against_the_cpu(extra, page):
  pool = Pool(17, K_LENS, page=page, h=16, hkv=4, d=128, dtype=BF16, bad=[(5, 2)])
  q = pool.query(1)
  kw = dict(causal=True, **extra, **pool.arrays())
  out, lse = run_attention_on(_gpu(), q, pool.k_pages, pool.v_pages, kw)
  cpu_out, cpu_lse = run_attention_on(_cpu(), q, pool.k_pages, pool.v_pages, kw)
  got = np.asarray(out, np.float32)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, np.asarray(cpu_out, np.float32), atol=2.5e-2, rtol=2.5e-2)
  fin = np.isfinite(np.asarray(cpu_lse))
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(cpu_lse)[fin], atol=2e-3, rtol=1e-3)


def test_dense_fp8_kv():
  """Dense e4m3 K/V under bf16 q (one q row): the same kernel without a page table."""
  rng = np.random.default_rng(6)
  q = jnp.asarray(rng.standard_normal((3, 1, 16, 128)), jnp.float32).astype(BF16)
  e4m3 = lambda x: np.asarray(jnp.asarray(x * 50, jnp.float32).astype(E4M3))
  k8 = e4m3(rng.standard_normal((3, 333, 4, 128)))
  v8 = e4m3(rng.standard_normal((3, 333, 4, 128)))
  kw = dict(causal=False, k_descale=np.float32([0.02, 0.01, 0.015, 0.03]),
            v_descale=np.float32(0.03))
  out, _ = run_attention_on(_gpu(), q, k8, v8, kw)
  cpu_out, _ = run_attention_on(_cpu(), q, k8, v8, kw)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(cpu_out, np.float32),
                             atol=2.5e-2, rtol=2.5e-2)
