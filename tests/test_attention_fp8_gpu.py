"""fp8 attention on CUDA in every call shape the fp8-KV decode does not take: the portable kernel's
fp8 form (ffi/cuda/attention/prefill_sm80/kernel.cuh, kFp8; docs/kernels.md "portable_fp8"), and
on Hopper the e4m3 q/k/v calls the sm90 fp8 forward takes (dense, varlen and paged; its own
matrix is tests/test_attention_fp8_sm90_gpu.py).

Three kinds of fp8 call: e4m3 q/k/v with q/k/v_descale (bf16 out), the v_dequant path (bf16 /
fp16 q and k over e4m3 V with v_descale) and an fp8 KV cache read by more q rows than a decode
(chunked prefill, mixed batches, a 32-row verify; bf16 / fp16 q over e4m3 K/V with k/v_descale).
Layouts dense, varlen and paged (pages of 1 as a token pool, 5, 16 and 64 keys), GQA, causal /
window / softcap / sinks, ragged lengths (empty sequences, rows that see no key), every descale
shape ([], [1], [Hkv], [B, Hkv]), pools whose unreferenced pages and page tails hold NaN and
page-table entries outside the pool, head dims at each capacity (64, 128, 256) and between them.

Each GPU result is held to a float64 oracle of the dequantized inputs (stored x descale) by
FlashAttention's rule (error at most 3x that of the same math done in the compute type, plus a
float32-noise floor; P rounded to e4m3 where the sm90 fp8 forward runs the call, as its P V
product takes e4m3 P) and to the CPU kernel on the same inputs; LSE alike; no output element left
unwritten (the allocator is NaN-poisoned first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import (is_sm90_device, naive_attention, planned_kernels, poison_allocator,
                             random_page_table, run_attention_on)

pytestmark = pytest.mark.gpu

E4M3, BF16, F16 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float16
NAN_E4M3 = 0x7f
DESCALES = ("tensor", "one", "head", "batch_head")   # [], [1], [Hkv], [B, Hkv]


def _cpu():
  return jax.devices("cpu")[0]


def _gpu():
  return jax.devices("cuda")[0]


def _cast(x, dtype):
  return np.asarray(x, np.float32).astype(dtype)


def _nan(shape, dtype):
  if jnp.dtype(dtype) == jnp.dtype(E4M3):
    return np.full(shape, NAN_E4M3, np.uint8).view(E4M3)
  return np.full(shape, np.nan, np.float32).astype(dtype)


class Problem:
  """Random inputs of one fp8 call. kind: "qkv" (e4m3 q/k/v), "v_dequant" (e4m3 V) or "kv_cache"
  (e4m3 K and V); layout: "dense" (equal lengths), "varlen" or "paged" (varlen q unless dense_q;
  `bad` (batch, page index) entries point outside the pool). fp8 operands hold e4m3(40 x N(0, 1))
  with descales in [0.015, 0.035], so the dequantized values are about N(0, 1)."""

  def __init__(self, seed, kind, layout, q_lens, k_lens, *, h=8, hkv=2, d=128, dv=None,
               dtype=BF16, page=16, descale="head", bad=(), dense_q=False):
    rng = np.random.default_rng(seed)
    self.kind, self.layout, self.page = kind, layout, page
    self.q_lens, self.k_lens = list(q_lens), list(k_lens)
    self.h, self.hkv, self.d, self.dv = h, hkv, d, d if dv is None else dv
    self.compute = BF16 if kind == "qkv" else dtype
    self.dense_q = layout == "dense" or dense_q
    b = len(q_lens)
    fp8 = {"q": kind == "qkv", "k": kind != "v_dequant", "v": True}
    self.types = {n: E4M3 if fp8[n] else dtype for n in fp8}

    def values(name, shape):
      if fp8[name]:
        return _cast(rng.standard_normal(shape) * 40, E4M3)
      return _cast(rng.standard_normal(shape), dtype)

    def scales():   # the descale of (batch, kv head), and the operand as the API takes it
      if descale == "batch_head":
        full = rng.uniform(0.015, 0.035, (b, hkv))
        return full, full.astype(np.float32)
      if descale == "head":
        x = rng.uniform(0.015, 0.035, hkv)
        return np.broadcast_to(x, (b, hkv)), x.astype(np.float32)
      x = rng.uniform(0.015, 0.035)
      return np.full((b, hkv), x), np.float32(x) if descale == "tensor" else np.float32([x])

    self.scale = {}   # name -> [B, Hkv] float64 (1 where the operand has no descale)
    self.arrays = {}
    for n in "qkv":
      if fp8[n]:
        self.scale[n], self.arrays[f"{n}_descale"] = scales()
      else:
        self.scale[n] = np.ones((b, hkv))

    cu_q = np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)
    if self.dense_q:
      assert len(set(self.q_lens)) == 1
      self.q = values("q", (b, self.q_lens[0], h, d))
    else:
      self.q = values("q", (int(cu_q[-1]), h, d))
      self.arrays["cu_seqlens_q"] = cu_q
    self.cu_q = cu_q
    if layout == "dense":
      assert len(set(self.k_lens)) == 1
      self.k = values("k", (b, self.k_lens[0], hkv, d))
      self.v = values("v", (b, self.k_lens[0], hkv, self.dv))
    elif layout == "varlen":
      cu_k = np.concatenate([[0], np.cumsum(self.k_lens)]).astype(np.int32)
      self.k = values("k", (int(cu_k[-1]), hkv, d))
      self.v = values("v", (int(cu_k[-1]), hkv, self.dv))
      self.arrays["cu_seqlens_k"] = cu_k
    else:
      self._paged(rng, values, bad)

  def _paged(self, rng, values, bad):
    page = self.page
    table, num_pages = random_page_table(rng, self.k_lens, page, 3)   # 3 pages nobody reads
    for s, j in bad:
      table[s, j] = num_pages + 7 if (s + j) % 2 else -3
    written = np.zeros((num_pages, page), bool)   # the rows sequences' keys occupy
    for s, length in enumerate(self.k_lens):
      j = np.arange(length)
      pg = table[s, j // page]
      ok = (pg >= 0) & (pg < num_pages)
      written[pg[ok], j[ok] % page] = True
    self.pools = {}
    for n, dim in (("k", self.d), ("v", self.dv)):
      pool = _nan((num_pages, page, self.hkv, dim), self.types[n])
      pool[written] = values(n, (num_pages, page, self.hkv, dim))[written]
      self.pools[n] = pool
    if page == 1:   # a token pool [num_slots, Hkv, D]
      self.k, self.v = self.pools["k"][:, 0], self.pools["v"][:, 0]
    else:
      self.k, self.v = self.pools["k"], self.pools["v"]
    self.arrays["page_table"] = table
    self.arrays["seqused_k"] = np.asarray(self.k_lens, np.int32)

  def _sequence(self, s):
    """Sequence s's dequantized operands (float64) as one-sequence arguments of
    naive_attention."""
    group = self.h // self.hkv
    qs = np.repeat(self.scale["q"][s], group)[:, None]     # [H, 1]
    ks, vs = self.scale["k"][s][:, None], self.scale["v"][s][:, None]
    f64 = lambda x: np.asarray(x).astype(np.float64)
    q = f64(self.q[s] if self.dense_q else self.q[self.cu_q[s]:self.cu_q[s + 1]])
    q = (q * qs)[None]
    if self.layout == "paged":
      k = f64(self.pools["k"]) * ks
      v = f64(self.pools["v"]) * vs
      return q, k, v, dict(page_table=self.arrays["page_table"][s:s + 1],
                           seqused_k=self.arrays["seqused_k"][s:s + 1])
    if self.layout == "dense":
      k, v = f64(self.k[s]), f64(self.v[s])
    else:
      cu = self.arrays["cu_seqlens_k"]
      k, v = f64(self.k[cu[s]:cu[s + 1]]), f64(self.v[cu[s]:cu[s + 1]])
    return q, (k * ks)[None], (v * vs)[None], {}

  def oracle(self, options, rounding=None, p_rounding=None):
    """(out, lse) in jax_sgl's layouts: float64 over the dequantized inputs, or with `rounding`
    the kernels' math in their compute type: P (by `p_rounding` where given) and the output
    rounded (the scores, products of exactly widened e4m3 or 16-bit values, accumulate in
    float32)."""
    rnd = (lambda x: x) if rounding is None else rounding
    outs, lses = [], []
    for s in range(len(self.q_lens)):
      q, k, v, arrays = self._sequence(s)
      o, lse = naive_attention(q, k, v, return_lse=True, p_round=p_rounding or rounding,
                               **options, **arrays)
      outs.append(rnd(o[0]))
      lses.append(lse[0])     # [Sq, H]
    if self.dense_q:
      return np.stack(outs), np.swapaxes(np.stack(lses), 1, 2)       # [B, H, Sq]
    return np.concatenate(outs), np.concatenate(lses).T               # [H, total_q]


def _rounding(dtype):
  """x rounded to dtype (via float32, as the kernels' conversions), back in float64."""
  return lambda x: np.asarray(x, np.float32).astype(dtype).astype(np.float64)


def check(problem, **options):
  """The GPU against the float64 oracle (FlashAttention's rule) and the CPU kernel."""
  kw = dict(options, **problem.arrays)
  args = (problem.q, problem.k, problem.v)
  sm90 = is_sm90_device() and planned_kernels(*args, kw) == [("fwd", "sm90")]
  out_bytes = problem.q.size // problem.d * problem.dv * 4
  poison_allocator(out_bytes + problem.q.size // problem.d * 4)
  out, lse = run_attention_on(_gpu(), *args, kw)
  cpu_out, cpu_lse = run_attention_on(_cpu(), *args, kw)
  assert out.dtype == jnp.dtype(problem.compute), out.dtype
  assert out.shape == problem.q.shape[:-1] + (problem.dv,)
  got = np.asarray(out, np.float64)
  assert np.isfinite(got).all(), "unwritten or non-finite output elements (a masked NaN read?)"
  want, want_lse = problem.oracle(options)
  base, _ = problem.oracle(options, _rounding(problem.compute),
                           _rounding(E4M3) if sm90 else None)
  err, base_err = np.abs(got - want).max(), np.abs(base - want).max()
  assert err <= 3 * base_err + 1e-5, (err, base_err)
  if sm90:   # P in e4m3 against the CPU's P in bf16: each held to the oracle by the rule instead
    cpu_err = np.abs(np.asarray(cpu_out, np.float64) - want).max()
    assert cpu_err <= 3 * base_err + 1e-5, (cpu_err, base_err)
  else:
    tol = 2.5e-2 if problem.compute == BF16 else 4e-3
    np.testing.assert_allclose(got, np.asarray(cpu_out, np.float64), atol=tol, rtol=tol)
  lse_np, cpu_lse_np = np.asarray(lse), np.asarray(cpu_lse)
  for ref in (cpu_lse_np, want_lse):
    np.testing.assert_array_equal(np.isneginf(lse_np), np.isneginf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(lse_np[fin], ref[fin], atol=2e-3, rtol=1e-3)


# Ragged lengths: an empty sequence, rows that see no key (causal, more q rows than keys), keys
# no multiple of any page size, long enough for several key tiles.
Q_LENS = [1, 37, 32, 5, 64]
K_LENS = [0, 300, 32, 2, 517]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout,page", [("dense", 0), ("varlen", 0), ("paged", 1),
                                         ("paged", 5), ("paged", 16), ("paged", 64)])
def test_fp8_qkv(layout, page, causal):
  if layout == "dense":
    p = Problem(page + 1, "qkv", layout, [77] * 3, [200] * 3, h=8, hkv=2)
  else:
    p = Problem(page + 2, "qkv", layout, Q_LENS, K_LENS, h=8, hkv=2, page=max(page, 1),
                bad=[(1, 2), (4, 5)] if layout == "paged" else ())
  check(p, causal=causal)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("layout", ["dense", "varlen", "paged"])
def test_v_dequant(layout, dtype):
  if layout == "dense":
    p = Problem(3, "v_dequant", layout, [50] * 2, [333] * 2, h=16, hkv=4, dtype=dtype)
  else:
    p = Problem(4, "v_dequant", layout, Q_LENS, K_LENS, h=16, hkv=4, dtype=dtype,
                bad=[(4, 3)] if layout == "paged" else ())
  check(p, causal=True)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("page", [1, 5, 16, 64])
def test_kv_cache_chunked_prefill_and_mixed_batch(page, dtype):
  """Varlen q over an fp8 pool: decode rows, prefill chunks and a 32-row verify in one batch."""
  p = Problem(10 + page, "kv_cache", "paged", Q_LENS, K_LENS, h=16, hkv=2, dtype=dtype,
              page=page, bad=[(1, 3), (4, 7)])
  check(p, causal=True)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_kv_cache_verify_32_rows(group, page):
  """Dense q of 32 rows per sequence (speculative verify) over an fp8 pool."""
  p = Problem(20 + group, "kv_cache", "paged", [32] * 3, [40, 700, 95], h=2 * group, hkv=2,
              page=page, dense_q=True, bad=[(1, 4)])
  check(p, causal=True)


@pytest.mark.parametrize("kind", ["qkv", "v_dequant", "kv_cache"])
@pytest.mark.parametrize("descale", DESCALES)
def test_descale_shapes(kind, descale):
  p = Problem(30, kind, "paged", Q_LENS, K_LENS, h=8, hkv=4, page=16, descale=descale)
  check(p, causal=True)


@pytest.mark.parametrize("kind", ["qkv", "kv_cache"])
@pytest.mark.parametrize("options", [dict(window=(48, 0), causal=True), dict(window=(20, 7)),
                                     dict(softcap=15.0, causal=True),
                                     dict(softcap=30.0, window=(100, 0), causal=True)])
def test_masks_and_softcap(kind, options):
  p = Problem(40, kind, "paged", Q_LENS, K_LENS, h=8, hkv=2, page=16)
  check(p, **options)


@pytest.mark.parametrize("kind", ["qkv", "kv_cache"])
def test_sinks(kind):
  p = Problem(41, kind, "varlen", Q_LENS, K_LENS, h=8, hkv=2)
  sinks = np.random.default_rng(5).uniform(-2, 3, 8).astype(np.float32)
  check(p, causal=True, sinks=sinks)


@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (128, 64), (192, 192), (256, 256),
                                  (40, 40)])
def test_head_dims(d, dv):
  """Each capacity (64, 128, 256), head dims between them (zero-filled features) and d_v != d."""
  p = Problem(d + dv, "qkv", "varlen", Q_LENS, K_LENS, h=4, hkv=2, d=d, dv=dv)
  check(p, causal=True)


@pytest.mark.parametrize("kind", ["qkv", "v_dequant", "kv_cache"])
def test_long_keys_split_kv(kind):
  """One sequence, one kv head, a few q rows, many keys: the plan splits the keys, and each
  split's partial takes v_descale before the combine (which writes bf16 under e4m3 q)."""
  p = Problem(50, kind, "dense", [3], [9000], h=4, hkv=1)
  check(p, causal=False)
  check(p, causal=True)


def test_decode_shaped_fp8_q():
  """One q row per sequence under e4m3 q: the fp8-KV decode takes 16-bit q only."""
  p = Problem(60, "qkv", "paged", [1] * 6, [0, 1, 37, 130, 700, 2051], h=16, hkv=4, page=16,
              dense_q=True, bad=[(5, 3)])
  check(p, causal=False)
