"""The Hopper fp8 forward (ffi/cuda/attention/sm90/fwd/fp8.cuh: e4m3 q/k/v, bf16 out, V transposed
in smem by the producer, P in e4m3, q_descale * k_descale in the softmax scale, v_descale on O).

Inputs are fresh random values quantized to e4m3 with per-(batch, kv head) descales (stored =
e4m3(x / descale), never zeros); the dequantized values (stored x descale, float64) are the
problem. The GPU output is held to a float64 oracle on them (attention_cases.naive_attention) by
FlashAttention's rule: its error at most 3x that of the same math done in the kernel's
precision (scores and softmax in float32, P rounded to e4m3 before P V, as FlashAttention-3's
fp8 test rounds its reference's P, O in bf16), plus a float32-noise floor. The CPU kernel on the
same inputs is held to the same bound, LSE to the oracle's within float32 noise. The matrix:
head dims 64 / 128 / 256, odd lengths that end mid-tile, q longer and shorter than k, GQA,
causal, sliding window, softcap, sinks, varlen q/k (an empty sequence, seqused_k), paged k/v
(pages of 1 (a token pool), 5, 16, 64 and 128 keys: TMA page boxes and the producer's gather;
chunked prefill, mixed batches packing the GQA group, verify split over the keys; NaN in the
pool's unreferenced pages and page tails, page-table entries outside the pool), and descales
per (batch, kv head), per kv head and per tensor. Skipped without a compute capability 9.0
device or the e4m3 instantiation; outputs are poisoned beforehand so unwritten elements show up
as NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from attention_cases import (DENSE_SHAPES, climbing, naive_attention, planned_kernels,
                             poison_allocator, random_page_table, require_sm90, run_attention_on)

pytestmark = pytest.mark.gpu

E4M3 = jnp.float8_e4m3fn
HEAD_DIMS = (64, 128, 256)
SHAPES = {
    **DENSE_SHAPES,
    # One key past a 192-key tile (tile_size.h kFp8Hd128Keys), q longer than k: causal rows
    # above the bottom-right diagonal see no key.
    "k_one_past": (2, 200, 193, 4, 2),
}


@pytest.fixture(autouse=True)
def _sm90(monkeypatch):
  require_sm90(monkeypatch, "the sm90 fp8 forward")


def _need(head_dim):
  built = jax_sgl.attention_backend_info()["kernels"].get("sm90_fwd", {})
  if head_dim not in built.get("head_dims", ()) or "float8_e4m3fn" not in built.get("dtypes", ()):
    pytest.skip(f"hdim{head_dim}_e4m3 not in this build (JAX_SGL_SM90_DTYPES)")


def _cpu():
  return jax.devices("cpu")[0]


def _gpu():
  return jax.devices("cuda")[0]


def _quantize(rng, shape, descale, head_axis):
  """e4m3(x / descale) of x ~ N(0, 1), descale [batch, kv heads] broadcast over the rows (q heads
  map to kv head h // group)."""
  x = rng.standard_normal(shape)
  d = np.asarray(descale, np.float64)
  group = shape[head_axis] // d.shape[1]
  per = np.repeat(d, group, axis=1)  # [batch, heads]
  per = per[:, None, :, None] if len(shape) == 4 else per
  q = jnp.asarray(x / per, jnp.float32).astype(E4M3)
  return np.asarray(q)


def _quantize_rows(rng, rows_batch, heads, head_dim, descale):
  """The packed (varlen) form of _quantize: rows [len(rows_batch), heads, head_dim], row i
  quantized with its sequence's descales (rows_batch[i] its batch index)."""
  d = np.asarray(descale)
  per = np.repeat(d, heads // d.shape[1], axis=1)[rows_batch][:, :, None]  # [rows, heads, 1]
  x = rng.standard_normal((len(rows_batch), heads, head_dim))
  return np.asarray(jnp.asarray(x / per, jnp.float32).astype(E4M3))


def _cu_seqlens(lens):
  return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _descales(rng, batch, hkv):
  # |x| / descale stays well inside e4m3's +-448 for x ~ N(0, 1).
  return [rng.uniform(0.02, 0.05, (batch, hkv)).astype(np.float32) for _ in range(3)]


def _fit(d, kind):
  """A [batch, kv heads] descale as the API takes it: per (batch, kv head), per kv head (row 0
  broadcast), per tensor (element [0, 0])."""
  if kind == "batch_head":
    return d
  if kind == "head":
    return np.ascontiguousarray(d[0])
  return np.float32(d[0, 0])


def _effective(d, kind, batch):
  """The [batch, kv heads] descales a call with _fit(d, kind) means."""
  if kind == "batch_head":
    return d
  if kind == "head":
    return np.broadcast_to(d[0], d.shape).copy()
  return np.full(d.shape, d[0, 0], np.float32)


def _dequantize(x, d, rows_batch):
  """stored x descale in float64; rows_batch: the batch index of each row (varlen) or None."""
  x = np.asarray(x).astype(np.float64)
  heads = x.shape[-2]
  per = np.repeat(np.asarray(d, np.float64), heads // d.shape[1], axis=1)  # [batch, heads]
  if rows_batch is None:
    return x * per[:, None, :, None]
  return x * per[rows_batch][:, :, None]


def _same_math(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, sinks=None, **arrays):
  """The kernel's precision on the dequantized problem: float32 scores and softmax, P (relative to
  the row max) rounded to e4m3, float32 P V, O rounded to bf16. The error scale of the rule."""
  f32 = lambda x: np.asarray(x, np.float32)
  # P rounds through NumPy (ml_dtypes' e4m3, the same round-to-nearest-even as XLA's): it runs
  # once per (row, head), where a jnp conversion's dispatch made this 10x the oracle's time.
  out = naive_attention(f32(q), f32(k), f32(v), causal=causal, window=window, softcap=softcap,
                        sinks=sinks, p_round=lambda p: np.asarray(p, np.float32).astype(
                            E4M3).astype(np.float64), **arrays)
  return np.asarray(jnp.asarray(out, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def _check(q, k, v, qd, kd, vd, kind, rows_batch_q, rows_batch_k, static, arrays,
           lse_rtol=3e-4):
  """Runs the call on the GPU and the CPU and holds both to the oracle by the rule."""
  batch = qd.shape[0]
  eff = [_effective(d, kind, batch) for d in (qd, kd, vd)]
  q64 = _dequantize(q, eff[0], rows_batch_q)
  k64 = _dequantize(k, eff[1], rows_batch_k)
  v64 = _dequantize(v, eff[2], rows_batch_k)
  descales = dict(q_descale=_fit(qd, kind), k_descale=_fit(kd, kind), v_descale=_fit(vd, kind))
  _hold(q, k, v, (q64, k64, v64), descales, rows_batch_q is not None, static, arrays, lse_rtol)


def _hold(q, k, v, dequantized, descales, varlen_q, static, arrays, lse_rtol=3e-4):
  """The GPU and the CPU on (q, k, v) with `descales`, each held to the float64 oracle on the
  dequantized operands (q64, k64, v64) by the rule; LSE alike."""
  q64, k64, v64 = dequantized
  want, want_lse = naive_attention(q64, k64, v64, return_lse=True, **static, **arrays)
  ref = _same_math(q64, k64, v64, **static, **arrays)
  kwargs = dict(static, **descales, **arrays)
  # The call must reach the fp8 kernel, not a fallback that would pass for it.
  planned = planned_kernels(q, k, v, kwargs)
  assert planned == [("fwd", "sm90")], planned
  poison_allocator(want.size * 2 + want_lse.size * 4)
  out, lse = run_attention_on(_gpu(), q, k, v, kwargs)
  assert out.dtype == jnp.bfloat16 and out.shape == want.shape
  got = np.asarray(out.astype(jnp.float32), np.float64)
  assert np.isfinite(got).all(), "unwritten (NaN) or non-finite output elements"
  floor = 1e-3  # float32 noise and bf16's last bit of O at |O| ~ 0.1
  bound = 3 * np.abs(ref - want).max() + floor
  err = np.abs(got - want).max()
  assert err <= bound, (err, bound)
  cpu_out, cpu_lse = run_attention_on(_cpu(), q, k, v, kwargs)
  cpu_err = np.abs(np.asarray(cpu_out.astype(jnp.float32), np.float64) - want).max()
  assert cpu_err <= bound, (cpu_err, bound)
  # LSE: [B, H, Sq] (dense) or [H, total_q] (varlen); the oracle's per row in q's row layout.
  lse = np.asarray(lse, np.float64)
  oracle = want_lse.T if varlen_q else np.moveaxis(want_lse, -1, -2)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(oracle))
  fin = np.isfinite(oracle)
  # rtol 3e-4, not float32's 1e-4: Hopper's fp8 wgmma adds its products in fewer bits than
  # float32 (about 14 mantissa bits, DeepSeek-V3 report 3.3.2), so scores near 10 err ~1e-3.
  np.testing.assert_allclose(lse[fin], oracle[fin], atol=2e-3, rtol=lse_rtol)
  np.testing.assert_allclose(lse[fin], np.asarray(cpu_lse, np.float64)[fin], atol=2e-3,
                             rtol=lse_rtol)


def _dense_case(seed, shape, head_dim):
  rng = np.random.default_rng(seed)
  b, sq, sk, h, hkv = shape
  qd, kd, vd = _descales(rng, b, hkv)
  q = _quantize(rng, (b, sq, h, head_dim), qd, 2)
  k = _quantize(rng, (b, sk, hkv, head_dim), kd, 2)
  v = _quantize(rng, (b, sk, hkv, head_dim), vd, 2)
  return rng, q, k, v, qd, kd, vd


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense(head_dim, shape, causal):
  _need(head_dim)
  _, q, k, v, qd, kd, vd = _dense_case(1, SHAPES[shape], head_dim)
  _check(q, k, v, qd, kd, vd, "batch_head", None, None, {"causal": causal}, {})


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_many_tiles(head_dim, causal):
  """More work tiles than SMs (2 x 16 heads x 8 row blocks = 256 on an H100 / H200's 132), so a
  persistent CTA runs several: the K, V staging and V^T rings' slots and barrier phases carry
  from one tile to the next (by a per-tile key-tile count that varies when causal), and the
  transpose writes every ring slot many times. 1000 rows and keys end mid-tile."""
  _need(head_dim)
  _, q, k, v, qd, kd, vd = _dense_case(6, (2, 1000, 1000, 16, 4), head_dim)
  _check(q, k, v, qd, kd, vd, "batch_head", None, None, {"causal": causal}, {})


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kind", ["batch_head", "head", "scalar"])
def test_descale_shapes(head_dim, kind):
  _need(head_dim)
  _, q, k, v, qd, kd, vd = _dense_case(2, SHAPES["square"], head_dim)
  _check(q, k, v, qd, kd, vd, kind, None, None, {"causal": True}, {})


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_running_max_climbs(head_dim, causal):
  """test_attention_sm90.py's climbing scores at e4m3: 600 keys climbing 24 log2 units per 128.
  k's descale 0.25 keeps the climb's largest key (~55) inside e4m3. LSEs near 82 here: the fp8
  wgmma's ~14-bit sums (see _check) put them up to 7.4e-4 off (H100, 2026-12-07), so rtol 1.5e-3."""
  _need(head_dim)
  rng = np.random.default_rng(9)
  b, sq, sk, h, hkv = 1, 300, 600, 4, 2
  qd = np.full((b, hkv), 0.05, np.float32)
  kd = np.full((b, hkv), 0.25, np.float32)
  vd = rng.uniform(0.02, 0.05, (b, hkv)).astype(np.float32)
  q, k = climbing(rng.standard_normal((b, sq, h, head_dim)),
                  rng.standard_normal((b, sk, hkv, head_dim)), 24.0, 16.0)
  q = np.asarray(jnp.asarray(q / qd[0, 0], jnp.float32).astype(E4M3))
  k = np.asarray(jnp.asarray(k / kd[0, 0], jnp.float32).astype(E4M3))
  v = _quantize(rng, (b, sk, hkv, head_dim), vd, 2)
  _check(q, k, v, qd, kd, vd, "batch_head", None, None, {"causal": causal}, {}, lse_rtol=1.5e-3)


MASKS = {
    "window": {"window": (100, 0)},
    "window_two_sided": {"window": (64, 32)},
    "softcap": {"softcap": 20.0},
    "softcap_causal": {"softcap": 20.0, "causal": True},
}


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
def test_masks(head_dim, mask):
  _need(head_dim)
  _, q, k, v, qd, kd, vd = _dense_case(3, SHAPES["square"], head_dim)
  _check(q, k, v, qd, kd, vd, "batch_head", None, None, MASKS[mask], {})


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_sinks(head_dim):
  _need(head_dim)
  rng, q, k, v, qd, kd, vd = _dense_case(4, SHAPES["k_short"], head_dim)
  sinks = rng.standard_normal(SHAPES["k_short"][3]).astype(np.float32)
  _check(q, k, v, qd, kd, vd, "batch_head", None, None, {"causal": True}, {"sinks": sinks})


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen(head_dim, causal):
  """Packed q and k/v with ragged lengths (one empty sequence, one of a single row), and
  seqused_k below the packed key counts."""
  _need(head_dim)
  rng = np.random.default_rng(5)
  q_lens, k_lens = [200, 0, 1, 457], [300, 17, 129, 600]
  used = np.asarray([251, 17, 100, 600], np.int32)
  h, hkv, batch = 8, 2, len(q_lens)
  qd, kd, vd = _descales(rng, batch, hkv)
  rq = np.repeat(np.arange(batch), q_lens)
  rk = np.repeat(np.arange(batch), k_lens)
  q = _quantize_rows(rng, rq, h, head_dim, qd)
  k, v = (_quantize_rows(rng, rk, hkv, head_dim, d) for d in (kd, vd))
  arrays = {"cu_seqlens_q": _cu_seqlens(q_lens), "cu_seqlens_k": _cu_seqlens(k_lens),
            "seqused_k": used}
  _check(q, k, v, qd, kd, vd, "batch_head", rq, rk, {"causal": causal}, arrays)


def _nan_pool(shape):
  return np.full(shape, 0x7F, np.uint8).view(E4M3)  # e4m3 NaN


def _paged_case(seed, q_lens, k_lens, page, head_dim, h, hkv, dense_q=False):
  """e4m3 q over an e4m3 page pool (page 1: the token pool [slots, Hkv, D]) whose unreferenced
  pages and page tails hold NaN, with two page-table entries outside the pool (masked, never
  read); q descales per (batch, kv head), k / v per kv head (a pool's pages serve every
  sequence). Returns the call's operands, descales, the dequantized operands and the arrays."""
  rng = np.random.default_rng(seed)
  b = len(q_lens)
  table, num_pages = random_page_table(rng, k_lens, page, 3)  # 3 pages nobody reads
  # Bad entries among the used pages of the longest sequence (its keys there are masked).
  s = int(np.argmax(k_lens))
  used_pages = -(-k_lens[s] // page)
  table[s, 1] = num_pages + 5
  table[s, used_pages // 2] = -3
  qd = rng.uniform(0.02, 0.05, (b, hkv)).astype(np.float32)
  kd, vd = (rng.uniform(0.02, 0.05, hkv).astype(np.float32) for _ in range(2))
  if dense_q:
    q = _quantize(rng, (b, q_lens[0], h, head_dim), qd, 2)
    q64 = _dequantize(q, qd, None)
  else:
    rows = np.repeat(np.arange(b), q_lens)
    q = _quantize_rows(rng, rows, h, head_dim, qd)
    q64 = _dequantize(q, qd, rows)
  written = np.zeros((num_pages, page), bool)  # the pool rows the sequences' keys occupy
  for seq, length in enumerate(k_lens):
    j = np.arange(length)
    pg = table[seq, j // page]
    ok = (pg >= 0) & (pg < num_pages)
    written[pg[ok], j[ok] % page] = True
  pools, pools64 = [], []
  for d in (kd, vd):
    pool = _nan_pool((num_pages, page, hkv, head_dim))
    fresh = rng.standard_normal((num_pages, page, hkv, head_dim)) / d[:, None]
    pool[written] = np.asarray(jnp.asarray(fresh[written], jnp.float32).astype(E4M3))
    pools64.append(pool.astype(np.float64) * d[:, None].astype(np.float64))
    pools.append(pool[:, 0] if page == 1 else pool)
  if page == 1:
    pools64 = [x[:, 0] for x in pools64]
  arrays = {"page_table": table, "seqused_k": np.asarray(k_lens, np.int32)}
  if not dense_q:
    arrays["cu_seqlens_q"] = _cu_seqlens(q_lens)
  descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
  return (q, *pools), descales, (q64, *pools64), arrays


PAGES = (1, 5, 16, 64, 128)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged_chunked_prefill(head_dim, page, causal):
  """Chunked prefill over a page pool: whole tiles of q rows per sequence after a history, an
  empty sequence, q longer than its keys, key counts that end mid-page and mid-tile (the tail
  of the last page, NaN in the pool, zeroed before P V), TMA page boxes (pages of 16, 64, 128)
  and the producer's gather (1, 5)."""
  _need(head_dim)
  operands, descales, dequantized, arrays = _paged_case(
      100 + page, [200, 0, 300, 457], [530, 17, 129, 1100], page, head_dim, 8, 2)
  _hold(*operands, dequantized, descales, True, {"causal": causal}, arrays)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("page", (1, 16, 64))
def test_paged_mixed_batch(head_dim, page):
  """Decode rows beside prefill chunks in one call: few q rows per sequence on average, so the
  tiles pack the GQA group's heads (PackGQA: Q loaded, O stored row by row)."""
  _need(head_dim)
  operands, descales, dequantized, arrays = _paged_case(
      200 + page, [1, 37, 1, 64, 5, 1], [700, 300, 33, 517, 96, 1], page, head_dim, 16, 4)
  _hold(*operands, dequantized, descales, True, {"causal": True}, arrays)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("page", (1, 16))
def test_paged_verify_key_split(head_dim, page):
  """Speculative verify: 8 dense q rows per sequence over a long history, few tiles for the SMs,
  so the persistent head dims run each tile as key shares merged by the split-KV combine."""
  _need(head_dim)
  operands, descales, dequantized, arrays = _paged_case(
      300 + page, [8] * 2, [5000, 4321], page, head_dim, 16, 4, dense_q=True)
  _hold(*operands, dequantized, descales, False, {"causal": True}, arrays)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
def test_paged_masks(head_dim, mask):
  _need(head_dim)
  operands, descales, dequantized, arrays = _paged_case(
      400, [200, 0, 300, 457], [530, 17, 129, 1100], 16, head_dim, 8, 2)
  _hold(*operands, dequantized, descales, True, MASKS[mask], arrays)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_paged_sinks(head_dim):
  _need(head_dim)
  operands, descales, dequantized, arrays = _paged_case(
      500, [1, 37, 64, 130], [300, 95, 517, 130], 16, head_dim, 8, 2)
  arrays["sinks"] = np.random.default_rng(5).standard_normal(8).astype(np.float32)
  _hold(*operands, dequantized, descales, True, {"causal": True}, arrays)


def test_paged_deterministic():
  """Two runs of one paged call give the same bits (no atomics in the forward's reduction)."""
  _need(128)
  operands, descales, _, arrays = _paged_case(600, [200, 0, 300, 457], [530, 17, 129, 1100],
                                              16, 128, 8, 2)
  kwargs = dict(descales, causal=True, **arrays)
  first = [np.asarray(x) for x in run_attention_on(_gpu(), *operands, kwargs)]
  second = [np.asarray(x) for x in run_attention_on(_gpu(), *operands, kwargs)]
  for a, b in zip(first, second):
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
