"""The Hopper (sm_90a, wgmma + TMA) flash forward against the pure-JAX reference.

Every built instantiation runs by default on compute capability 9.0 (JAX_SGL_DISABLE=sm90, read
when a call is lowered, turns it off: every test here clears it through monkeypatch); on
anything but a compute-capability-9.0 device, or in a build
without the (dtype, head dim) instantiation, the test is skipped rather than silently testing the
portable kernel. Outputs are poisoned beforehand so unwritten elements show up as NaN.
Each head dim runs its one tile choice (ffi/cuda/attention/sm90/fwd/tile_size.h): persistent at
64 and 128, one CTA per tile at 256. Decode-shaped calls (at most 8 q rows) run on the decode
kernels (test_attention_decode_gpu.py), except paged verify of 8 drafts with a GQA group of 4 or
more over a long history, which runs here with the key split (SPLIT below).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from attention_cases import (DENSE_SHAPES, check_kernel_output, climbing, poison_allocator,
                             random_normal, random_page_table, require_sm90,
                             turn_off_xla_autotuning)
from jax_sgl import reference
from jax_sgl._checks import check_attention

pytestmark = pytest.mark.gpu

turn_off_xla_autotuning()

DTYPES = (jnp.bfloat16, jnp.float16)
TOL = {jnp.dtype(jnp.bfloat16): 2.5e-2, jnp.dtype(jnp.float16): 4e-3}


def _name(dtype):
  return "bf16" if jnp.dtype(dtype) == jnp.bfloat16 else "fp16"


@pytest.fixture(autouse=True)
def _sm90(monkeypatch):
  require_sm90(monkeypatch, "the sm90 kernel")


def _need(head_dim, dtype):
  """Skips unless the build has the (head dim, dtype) kernel."""
  built = jax_sgl.attention_backend_info()["kernels"].get("sm90_fwd", {})
  kernel = f"hdim{head_dim}_{_name(dtype)}"
  if head_dim not in built.get("head_dims", ()) or jnp.dtype(dtype).name not in built["dtypes"]:
    pytest.skip(f"{kernel} not in this build (JAX_SGL_SM90_HEAD_DIMS / JAX_SGL_SM90_DTYPES)")


def _inputs(shape, head_dim, dtype, seed):
  batch, sq, sk, h, hkv = shape
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  rand = lambda key, s: random_normal(key, s, dtype)
  return (rand(keys[0], (batch, sq, h, head_dim)), rand(keys[1], (batch, sk, hkv, head_dim)),
          rand(keys[2], (batch, sk, hkv, head_dim)))


def _reference(q, k, v, causal, window=(-1, -1), softcap=0.0):
  spec = check_attention(q, k, v, causal=causal, softmax_scale=None, window=window,
                         softcap=softcap, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
                         page_table=None, q_descale=None, k_descale=None, v_descale=None)
  return jax.jit(lambda q, k, v: reference.attention(
      q, k, v, kv_layout=spec.kv_layout, varlen_q=spec.varlen_q, batch=spec.batch,
      softmax_scale=spec.softmax_scale, softcap=spec.softcap, causal=spec.causal,
      window_left=spec.window_left, window_right=spec.window_right,
      out_dtype=spec.out_dtype))(q, k, v)


def _check(q, k, v, causal, window=(-1, -1), softcap=0.0):
  want_out, want_lse = _reference(q, k, v, causal, window, softcap)
  check_kernel_output(
      lambda: jax_sgl.attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                return_lse=True),
      want_out, want_lse, q.dtype, TOL[jnp.dtype(q.dtype)])


def _check_differs_from_sm80(monkeypatch, q, k, v, **kw):
  """jax_sgl.attention(q, k, v, **kw) on the sm90 kernel against the portable one
  (JAX_SGL_DISABLE=sm90): somewhere different (another summation order), so the sm90 kernel
  really ran, and close."""
  fn = jax.jit(lambda q, k, v: jax_sgl.attention(q, k, v, **kw))
  sm90 = np.asarray(fn(q, k, v).astype(jnp.float32))
  monkeypatch.setenv("JAX_SGL_DISABLE", "sm90")
  jax.clear_caches()   # the switch is read when fn is lowered
  sm80 = np.asarray(fn(q, k, v).astype(jnp.float32))
  assert not np.array_equal(sm90, sm80)
  np.testing.assert_allclose(sm90, sm80, atol=2.5e-2, rtol=2.5e-2)


def test_smoke():
  """One small hd128 bf16 causal call first: a hang or a fault shows up here, before the matrix."""
  _need(128, jnp.bfloat16)
  q, k, v = _inputs((1, 200, 200, 2, 1), 128, jnp.bfloat16, seed=1)
  _check(q, k, v, causal=True)


@pytest.mark.parametrize("shape", DENSE_SHAPES, ids=str)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_matches_reference(dtype, head_dim, causal, shape):
  _need(head_dim, dtype)
  q, k, v = _inputs(DENSE_SHAPES[shape], head_dim, dtype,
                    seed=10 * head_dim + list(DENSE_SHAPES).index(shape))
  _check(q, k, v, causal)


# More work tiles (128 rows of one head) than the H200's 132 SMs, so each persistent CTA loops
# over several: the K/V rings and the Q / O buffers carry across tiles, causal tiles come from the
# atomic counter; "empty_rows" mixes in tiles whose rows see no key (causal, q longer than k).
MANY_TILES = {
    "multi_wave": (2, 2100, 2200, 16, 4),
    "empty_rows": (4, 700, 200, 16, 4),
}


@pytest.mark.parametrize("shape", MANY_TILES, ids=str)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_many_tiles(head_dim, causal, shape):
  """Right, and bitwise the same on a second call (the causal tile counter restarts per call)."""
  _need(head_dim, jnp.bfloat16)
  q, k, v = _inputs(MANY_TILES[shape], head_dim, jnp.bfloat16, seed=7 * head_dim)
  _check(q, k, v, causal)
  fn = jax.jit(lambda q, k, v: jax_sgl.attention(q, k, v, causal=causal))
  first = np.asarray(fn(q, k, v)).view(np.uint16)
  poison_allocator(first.size * 2)
  np.testing.assert_array_equal(first, np.asarray(fn(q, k, v)).view(np.uint16))


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_running_max_climbs(head_dim, causal):
  """The online softmax's O rescale (by large factors every step in some rows of a warp, small
  ones in others, none in the rest) against the reference: 300 rows over 1000 keys whose scores
  climb 24 log2 units per 128 keys (~190 in all, so a max that never moved would overflow
  exp2)."""
  _need(head_dim, jnp.bfloat16)
  q, k, v = _inputs((1, 300, 1000, 4, 2), head_dim, jnp.bfloat16, seed=11 * head_dim)
  q, k = climbing(np.asarray(q.astype(jnp.float32)), np.asarray(k.astype(jnp.float32)), 24.0,
                  16.0)
  _check(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), v, causal)


def _tail_shape(case):
  """(batch, seqlen_q, seqlen_k, heads, kv heads) whose 128-row tiles number just past a whole
  wave of the device's SMs, so that the tail split runs: 'few' leaves 1-4 tiles over and splits
  them 8 ways (8 key tiles); 'many' leaves up to 16 over, with 24 key tiles; 'short' is 32 tiles
  in all (a short prefill: every tile split, into several shares on a 64+ SM device)."""
  sms = getattr(jax.devices()[0], "core_count", None) or 132
  if case == "short":
    return (1, 1000, 3000, 4, 2)
  if case == "few":
    blocks = -(-(sms + 1) // 4)  # x 4 heads
    return (1, 128 * blocks - 50, 1000, 4, 2)
  blocks = -(-(sms + 1) // 16)  # x 8 heads x 2 sequences
  return (2, 128 * blocks - 7, 3000, 8, 2)


@pytest.mark.parametrize("window", ((-1, -1), (300, 100)), ids=("full", "window"))
@pytest.mark.parametrize("case", ("few", "many", "short"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_tail_split(head_dim, case, window):
  """The tail split (dense non-causal calls on the persistent kernels): the last partial wave's
  tiles run as key shares on all CTAs and a second kernel merges them. Right against the
  reference and bitwise repeatable."""
  _need(head_dim, jnp.bfloat16)
  q, k, v = _inputs(_tail_shape(case), head_dim, jnp.bfloat16, seed=3 * head_dim + len(case))
  fn = jax.jit(lambda q, k, v: jax_sgl.attention(q, k, v, window=window, return_lse=True))
  _check(q, k, v, causal=False, window=window)
  out, lse = (np.asarray(x) for x in fn(q, k, v))
  poison_allocator(out.size * 2)
  again_out, again_lse = (np.asarray(x) for x in fn(q, k, v))
  np.testing.assert_array_equal(out.view(np.uint16), again_out.view(np.uint16))
  np.testing.assert_array_equal(lse, again_lse)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_long(causal):
  """Many key tiles per CTA: the K/V rings wrap around many times, masked + unmasked tiles."""
  _need(128, jnp.bfloat16)
  q, k, v = _inputs((1, 2500, 3000, 4, 2), 128, jnp.bfloat16, seed=5)
  _check(q, k, v, causal)


def test_runs_the_sm90_kernel(monkeypatch):
  """The switch changes the kernel: sm90 and sm80 results differ somewhere (other summation
  order), while both match the reference (above)."""
  _need(128, jnp.bfloat16)
  q, k, v = _inputs((2, 512, 512, 4, 4), 128, jnp.bfloat16, seed=9)
  _check_differs_from_sm80(monkeypatch, q, k, v, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_deterministic(dtype):
  """Same inputs, bitwise the same output and LSE (no atomics, fixed reduction order)."""
  _need(128, dtype)
  q, k, v = _inputs((2, 1000, 1000, 8, 2), 128, dtype, seed=13)
  fn = jax.jit(lambda q, k, v: jax_sgl.attention(q, k, v, causal=True, return_lse=True))
  out1, lse1 = fn(q, k, v)
  poison_allocator(out1.size * 2 + lse1.size * 4)
  out2, lse2 = fn(q, k, v)
  np.testing.assert_array_equal(np.asarray(out1).view(np.uint16), np.asarray(out2).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(lse1), np.asarray(lse2))


# Sliding window and softcap: (shape, causal, window (left, right), softcap). Windows narrower
# than a key tile (both edges in one tile), wider ones (masked tiles at both edges, unmasked ones
# between, tiles left of the window skipped), ragged Sq != Sk, GQA, rows that see no key (out 0,
# lse -inf), and more work tiles than SMs (the persistent schedulers).
MASKED = {
    "left": ((2, 333, 333, 8, 2), False, (100, -1), 0.0),
    "right": ((2, 300, 129, 6, 2), False, (-1, 20), 0.0),  # rows < 151 see no key
    "both_narrow": ((1, 300, 420, 4, 4), False, (5, 3), 0.0),
    "causal_left": ((2, 700, 900, 8, 2), True, (150, -1), 0.0),
    "empty_rows": ((2, 300, 129, 6, 2), False, (10, 5), 0.0),  # rows < 166 see no key
    "q_short": ((3, 19, 989, 4, 4), False, (64, 16), 0.0),
    "long": ((1, 2500, 3000, 4, 2), True, (700, -1), 0.0),
    "many_tiles": ((2, 2100, 2200, 16, 4), True, (300, -1), 0.0),
    "softcap": ((2, 333, 333, 8, 2), False, (-1, -1), 1.5),
    "softcap_causal": ((2, 700, 900, 8, 2), True, (-1, -1), 4.0),
    "window_softcap": ((2, 333, 400, 8, 2), False, (70, 30), 2.0),
    "window_softcap_causal": ((1, 1000, 1000, 4, 1), True, (200, -1), 3.0),
}


@pytest.mark.parametrize("case", MASKED, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_window_softcap_matches_reference(head_dim, case):
  _need(head_dim, jnp.bfloat16)
  shape, causal, window, softcap = MASKED[case]
  q, k, v = _inputs(shape, head_dim, jnp.bfloat16, seed=3 * head_dim + list(MASKED).index(case))
  _check(q, k, v, causal, window, softcap)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_window_softcap_fp16(causal):
  _need(128, jnp.float16)
  q, k, v = _inputs((2, 333, 400, 8, 2), 128, jnp.float16, seed=21)
  _check(q, k, v, causal, (90, -1 if causal else 40), 2.0)


@pytest.mark.parametrize("case", ("window_softcap", "causal_left"), ids=str)
def test_window_softcap_runs_the_sm90_kernel(monkeypatch, case):
  """Window / softcap calls really take the sm90 kernel: results differ from the portable one's
  somewhere (other summation order), and are close to it."""
  _need(128, jnp.bfloat16)
  shape, causal, window, softcap = MASKED[case]
  q, k, v = _inputs(shape, 128, jnp.bfloat16, seed=23)
  _check_differs_from_sm80(monkeypatch, q, k, v, causal=causal, window=window, softcap=softcap)


# ---- Varlen (cu_seqlens_q / cu_seqlens_k, seqused_k): the kVarlen instantiation, which runs
# unless JAX_SGL_DISABLE=sm90_varlen keeps varlen on the portable kernel.
# (lens_q, lens_k, heads, kv heads, causal, window, softcap, seqused_k or None). Lengths 0 and 1,
# sequences ending mid-tile (the next sequence's rows sit right behind them), q longer than k.
VARLEN = {
    "ragged": ((0, 1, 130, 257, 64, 3), (5, 1, 300, 257, 0, 200), 8, 2, False, (-1, -1), 0.0, None),
    "ragged_causal": ((0, 1, 130, 257, 64, 300), (5, 1, 300, 257, 7, 200), 8, 2, True, (-1, -1),
                      0.0, None),
    "window_softcap": ((200, 1, 333), (250, 40, 129), 4, 4, False, (70, 9), 30.0, None),
    "causal_window": ((129, 500, 2), (300, 500, 1), 6, 2, True, (100, -1), 0.0, None),
    "seqused": ((64, 200, 3), (300, 256, 10), 4, 1, True, (-1, -1), 0.0, (17, 0, 10)),
    # Used lengths over several key tiles (with fewer than 17 keys per row, as above, both kernels
    # do the same arithmetic and can agree bitwise).
    "seqused_long": ((64, 200, 3), (300, 256, 10), 4, 1, False, (-1, -1), 0.0, (290, 0, 10)),
    # More (sequence, row block, head) tiles than SMs: persistent CTAs loop, causal counter.
    "many": (tuple(range(37, 700, 61)), tuple(range(700, 37, -61)), 8, 2, True, (-1, -1), 0.0,
             None),
}


@pytest.fixture
def _varlen_on(monkeypatch):
  monkeypatch.delenv("JAX_SGL_DISABLE", raising=False)


def _varlen_inputs(case, head_dim, dtype, seed):
  lens_q, lens_k, h, hkv, *_ = VARLEN[case]
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  rand = lambda key, s: random_normal(key, s, dtype)
  cu = lambda lens: jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  q = rand(keys[0], (sum(lens_q), h, head_dim))
  k = rand(keys[1], (sum(lens_k), hkv, head_dim))
  v = rand(keys[2], (sum(lens_k), hkv, head_dim))
  return q, k, v, cu(lens_q), cu(lens_k)


def _indexed_call(q, k, v, index, kw, kernel):
  """jax_sgl.attention (kernel) or the reference, jitted, with the index arrays `index`
  (cu_seqlens_q / cu_seqlens_k / seqused_k / page_table, None where absent) as arguments."""
  names = tuple(index)
  if kernel:
    fn = lambda q, k, v, *a: jax_sgl.attention(q, k, v, return_lse=True, **dict(zip(names, a)),
                                               **kw)
  else:
    kw = dict(kw)
    sinks = {"sinks": kw.pop("sinks")} if "sinks" in kw else {}
    absent = dict.fromkeys(("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table"))
    spec = check_attention(q, k, v, softmax_scale=None, q_descale=None, k_descale=None,
                           v_descale=None, **{**absent, **index}, **kw)
    fn = lambda q, k, v, *a: reference.attention(
        q, k, v, kv_layout=spec.kv_layout, varlen_q=spec.varlen_q, batch=spec.batch,
        softmax_scale=spec.softmax_scale, softcap=spec.softcap, causal=spec.causal,
        window_left=spec.window_left, window_right=spec.window_right, out_dtype=spec.out_dtype,
        **dict(zip(names, a)), **sinks)
  return jax.jit(fn)(q, k, v, *index.values())


def _varlen_call(case, q, k, v, cu_q, cu_k, fn=None):
  *_, causal, window, softcap, seqused = VARLEN[case]
  used = None if seqused is None else jnp.asarray(seqused, jnp.int32)
  return _indexed_call(q, k, v, dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used),
                       dict(causal=causal, window=window, softcap=softcap), kernel=fn is not None)


def _check_varlen(case, head_dim, dtype, seed):
  q, k, v, cu_q, cu_k = _varlen_inputs(case, head_dim, dtype, seed)
  want_out, want_lse = _varlen_call(case, q, k, v, cu_q, cu_k)
  check_kernel_output(lambda: _varlen_call(case, q, k, v, cu_q, cu_k, fn=True), want_out,
                      want_lse, dtype, TOL[jnp.dtype(dtype)])


@pytest.mark.parametrize("case", VARLEN, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_varlen_matches_reference(_varlen_on, head_dim, case):
  _need(head_dim, jnp.bfloat16)
  _check_varlen(case, head_dim, jnp.bfloat16, seed=3 * head_dim + list(VARLEN).index(case))


@pytest.mark.parametrize("case", ("ragged", "ragged_causal"), ids=str)
def test_varlen_fp16(_varlen_on, case):
  _need(128, jnp.float16)
  _check_varlen(case, 128, jnp.float16, seed=21)


@pytest.mark.parametrize("case", ("ragged_causal", "window_softcap", "seqused_long"), ids=str)
def test_varlen_runs_the_sm90_kernel(monkeypatch, case):
  """Varlen runs on the sm90 kernel by default (sm90 and portable results differ somewhere, both
  match the reference above); JAX_SGL_DISABLE=sm90_varlen keeps it on the portable kernel, bitwise
  the same as with JAX_SGL_DISABLE=sm90 (each run lowers a fresh jit)."""
  _need(128, jnp.bfloat16)
  q, k, v, cu_q, cu_k = _varlen_inputs(case, 128, jnp.bfloat16, seed=23)
  run = lambda: np.asarray(_varlen_call(case, q, k, v, cu_q, cu_k, fn=True)[0]).view(np.uint16)
  monkeypatch.delenv("JAX_SGL_DISABLE", raising=False)
  sm90 = run()
  monkeypatch.setenv("JAX_SGL_DISABLE", "sm90")
  portable = run()
  monkeypatch.setenv("JAX_SGL_DISABLE", "sm90_varlen")
  off = run()
  np.testing.assert_array_equal(off, portable)
  assert not np.array_equal(sm90, portable)


# ---- Paged K/V (page_table over a [num_pages, page_size, Hkv, D] pool): the kPaged
# instantiation for page sizes that are multiples of 16 (one TMA box of 16 keys per page run);
# other page sizes stay on the portable kernels. Every case runs on a pool whose unreferenced
# pages and page tails (rows past each sequence's keys) are NaN: a kernel that reads one of them
# into a visible score or into P V returns NaN.
# (lens_q, lens_k, page_size, heads, kv heads, causal, window, softcap, dense q)
PAGED = {
    # Ragged: a decode row, an empty q, a sequence without keys (its rows: 0, lse -inf).
    "p16_ragged": ((300, 129, 1, 0, 77, 64), (1000, 129, 517, 40, 2053, 0), 16, 8, 2, True,
                   (-1, -1), 0.0, False),
    "p48_window_softcap": ((200, 33, 1), (250, 700, 31), 48, 4, 4, False, (70, 9), 30.0, False),
    "p64_full": ((130, 257, 5), (300, 1100, 64), 64, 8, 1, False, (-1, -1), 0.0, False),
    "p128_causal_window": ((129, 500, 2), (300, 4000, 1), 128, 6, 2, True, (100, -1), 0.0, False),
    # Pages longer than any key tile.
    "p256": ((64, 64, 64), (3000, 600, 65), 256, 16, 4, True, (-1, -1), 0.0, False),
    # Speculative verify: dense q, 32 draft rows per sequence over a long history (PackGQA: a
    # tile holds 32 rows x the 4 heads of a kv head).
    "verify": ((32, 32, 32, 32), (1000, 33, 2048, 500), 16, 32, 8, True, (-1, -1), 0.0, True),
    # A mixed batch: decode rows beside chunks (packed q), causal.
    "mixed": ((1, 1, 512, 1, 64, 1, 300), (800, 17, 2000, 4096, 64, 1, 3000), 64, 32, 8, True,
              (-1, -1), 0.0, False),
    # PackGQA with groups that do not divide a 64-row block (tile rows of one q row end in the
    # other consumer's half), q lengths 1-64, sinks (per row: each row has its own head).
    "verify_g5": ((24, 24, 24, 24), (1500, 24, 3000, 700), 16, 40, 8, True, (-1, -1), 0.0, True),
    "mixed_g7": ((1, 64, 1, 300, 9, 1, 33), (900, 64, 1, 2000, 500, 17, 1200), 64, 28, 4, True,
                 (-1, -1), 20.0, False),
    "short_window_g4": ((17, 5, 64, 1), (400, 5, 1000, 3), 32, 16, 4, False, (50, 3), 0.0, False),
    "group8": ((16, 40, 2), (2000, 100, 65), 128, 64, 8, True, (-1, -1), 0.0, False),
    # More tiles than SMs: persistent CTAs loop, causal counter, windows re-filled per sequence.
    "many": (tuple(range(37, 700, 61)), tuple(range(2000, 200, -171)), 64, 8, 2, True, (-1, -1),
             0.0, False),
    # Not a multiple of 16: the gather instantiation (cp.async rows through the page table),
    # packed GQA rows, a token pool, sinks.
    "p5": ((130, 20), (301, 1000), 5, 4, 2, True, (-1, -1), 0.0, False),
    "p1_tokens": ((200, 64, 1, 130), (700, 64, 1, 2000), 1, 8, 2, True, (-1, -1), 0.0, False),
    "p24_window_softcap": ((150, 300), (999, 310), 24, 4, 4, False, (100, 20), 25.0, False),
    "p8_mixed_g5": ((1, 40, 1, 300, 7), (3000, 41, 5, 1000, 200), 8, 20, 4, True, (-1, -1), 0.0,
                    False),
    "p3_many": (tuple(range(37, 700, 61)), tuple(range(2000, 200, -171)), 3, 8, 2, True,
                (-1, -1), 0.0, False),
}


def _spec(case):
  """A paged case (PAGED or SPLIT): its tuple, the least width of its page table in keys (the
  bound on every sequence's keys, which sizes the key split), and whether it passes sinks."""
  if case in SPLIT:
    return SPLIT[case], SPLIT_KEYS, case in SPLIT_SINKS
  return PAGED[case], 0, case in PAGED_SINKS


def _paged_inputs(case, head_dim, dtype, seed, runs=False):
  """q (packed, or dense [B, n, H, D]), the pool with its NaN-poisoned copy, and the index
  arrays: shuffled pages, padding (-1) and entries past the pool after the used ones, and bad
  entries inside the first sequence's used pages (its keys are masked; random_page_table)."""
  spec, min_keys, _ = _spec(case)
  lens_q, lens_k, ps, h, hkv, *_, dense_q = spec
  rng = np.random.default_rng(seed)
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  rand = lambda key, s: random_normal(key, s, dtype)
  table, num_pages = random_page_table(rng, lens_k, ps, 7, min_columns=-(-min_keys // ps),
                                       bad_entries=True, runs=runs)
  valid = np.zeros((num_pages, ps), bool)  # rows a visible key reads
  for b, n in enumerate(lens_k):
    for j in range(n):
      page = table[b, j // ps]
      if 0 <= page < num_pages:
        valid[page, j % ps] = True
  k = rand(keys[1], (num_pages, ps, hkv, head_dim))
  v = rand(keys[2], (num_pages, ps, hkv, head_dim))
  bad = jnp.asarray(~valid)[:, :, None, None]
  kernel_kv = (jnp.where(bad, jnp.nan, k), jnp.where(bad, jnp.nan, v))
  if dense_q:
    q = rand(keys[0], (len(lens_q), lens_q[0], h, head_dim))
    cu_q = None
  else:
    q = rand(keys[0], (sum(lens_q), h, head_dim))
    cu_q = jnp.asarray(np.concatenate([[0], np.cumsum(lens_q)]), jnp.int32)
  return q, k, v, kernel_kv, cu_q, jnp.asarray(table), jnp.asarray(lens_k, jnp.int32)


# Cases that also pass attention sinks (float32 [heads], applied per q head).
PAGED_SINKS = ("verify_g5", "mixed_g7", "p8_mixed_g5")


def _paged_call(case, q, k, v, cu_q, table, used, fn=None):
  spec, _, sinks = _spec(case)
  *_, heads, _kv_heads, causal, window, softcap, _dense = spec
  kw = dict(causal=causal, window=window, softcap=softcap)
  if sinks:
    kw["sinks"] = jnp.asarray(np.random.default_rng(heads).normal(size=heads) * 2, jnp.float32)
  return _indexed_call(q, k, v, dict(cu_seqlens_q=cu_q, seqused_k=used, page_table=table), kw,
                       kernel=fn is not None)


def _check_paged(case, head_dim, dtype, seed, runs=False):
  q, k, v, (kk, vv), cu_q, table, used = _paged_inputs(case, head_dim, dtype, seed, runs)
  want_out, want_lse = _paged_call(case, q, k, v, cu_q, table, used)
  check_kernel_output(lambda: _paged_call(case, q, kk, vv, cu_q, table, used, fn=True), want_out,
                      want_lse, dtype, TOL[jnp.dtype(dtype)])


@pytest.mark.parametrize("case", PAGED, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_paged_matches_reference(head_dim, case):
  _need(head_dim, jnp.bfloat16)
  _check_paged(case, head_dim, jnp.bfloat16, seed=5 * head_dim + list(PAGED).index(case))


@pytest.mark.parametrize("case", ("p16_ragged", "verify", "verify_g5", "short_window_g4",
                                  "p48_window_softcap", "p64_full"), ids=str)
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_paged_page_runs(head_dim, case):
  """Page tables of runs of consecutive pages: narrow boxes (pages of 16 and 32) whose rows follow
  each other load as one wide box, next to chunks that break a run or hold a bad entry."""
  _need(head_dim, jnp.bfloat16)
  _check_paged(case, head_dim, jnp.bfloat16, seed=7 * head_dim + len(case), runs=True)


@pytest.mark.parametrize("case", ("p16_ragged", "mixed", "p5"), ids=str)
def test_paged_fp16(case):
  _need(128, jnp.float16)
  _check_paged(case, 128, jnp.float16, seed=31)


@pytest.mark.parametrize("case", ("p16_ragged", "p64_full", "p128_causal_window", "verify",
                                  "mixed", "verify_g5", "p5", "p1_tokens", "draft8_p16",
                                  "draft8_p1", "draft32_p16", "ragged_p64_window"), ids=str)
def test_paged_runs_the_sm90_kernel(monkeypatch, case):
  """Paged calls with pages of 16k keys and at least 64 tile rows per sequence on average (q
  rows, times the GQA group where the call packs it; 32 with 8 q rows or more: the key split's
  cases below) run on the sm90 kernel by default (its results differ from the other kernel's
  somewhere; both match the reference), bitwise the same on a second call (the key shares'
  counter restarts, the combine sums shares in order); JAX_SGL_DISABLE=sm90_varlen keeps them on
  the kernel JAX_SGL_DISABLE=sm90 gives (portable; block-wide decode for 8 drafts)."""
  _need(128, jnp.bfloat16)
  q, k, v, _, cu_q, table, used = _paged_inputs(case, 128, jnp.bfloat16, seed=41)
  run = lambda: np.asarray(_paged_call(case, q, k, v, cu_q, table, used, fn=True)[0]).view(
      np.uint16)
  monkeypatch.delenv("JAX_SGL_DISABLE", raising=False)
  sm90 = run()
  np.testing.assert_array_equal(sm90, run())
  monkeypatch.setenv("JAX_SGL_DISABLE", "sm90")
  portable = run()
  monkeypatch.setenv("JAX_SGL_DISABLE", "sm90_varlen")
  np.testing.assert_array_equal(run(), portable)
  assert not np.array_equal(sm90, portable)


# ---- The key split of paged calls (Sm90KeySplits): calls whose tiles are too few for the SMs
# run every tile as shares of the key tiles it visits, merged by the split-KV combine. Each case
# has few tiles (24-48: sequences x kv heads x row blocks) and a page table 8k keys wide, so on
# the H200's 132 SMs it splits 3-7 ways at hd128 (3-5 at hd64; Sm90KeySplits); the sequences'
# real histories are ragged, down to fewer keys than one share and none at all, so many shares
# of short sequences are empty. Verify-like q: 8 drafts per sequence (32 packed rows: the
# routing of 8-draft calls away from the block-wide decode kernel), 32 and 64 (packed rows of
# one and two tiles), and packed q of 1, 5, 8, 32 and 64 rows per sequence. Pools NaN-poisoned
# as above; LSE checked.
# (lens_q, lens_k, page_size, heads, kv heads, causal, window, softcap, dense q)
SPLIT_KEYS = 8192
SPLIT = {
    "draft8_p16": ((8,) * 6, (8000, 8, 3000, 100, 5000, 700), 16, 32, 8, True, (-1, -1), 0.0,
                   True),
    "draft8_p1": ((8,) * 5, (6000, 900, 8, 4100, 2), 1, 32, 8, True, (-1, -1), 0.0, True),
    "draft8_p64_full": ((8,) * 4, (7000, 64, 1500, 8100), 64, 32, 8, False, (-1, -1), 0.0, True),
    "draft8_p16_window": ((8,) * 4, (8000, 2500, 300, 6000), 16, 32, 8, True, (700, -1), 0.0,
                          True),
    "draft8_p64_softcap_g8": ((8,) * 3, (5000, 7000, 40), 64, 64, 8, True, (-1, -1), 20.0, True),
    "draft32_p16": ((32,) * 4, (8100, 1000, 32, 5000), 16, 32, 8, True, (-1, -1), 0.0, True),
    "draft64_p64_window": ((64,) * 3, (8000, 3000, 64), 64, 32, 8, True, (2000, -1), 0.0, True),
    "ragged_p16": ((1, 5, 8, 32, 64, 1), (8000, 300, 6000, 5, 4000, 1024), 16, 16, 4, True,
                   (-1, -1), 0.0, False),
    "ragged_p1": ((1, 5, 8, 32, 64), (5000, 8000, 17, 2000, 3000), 1, 16, 4, True, (-1, -1), 0.0,
                  False),
    "ragged_p64_window": ((64, 1, 32, 5, 8), (3000, 7000, 8000, 40, 2100), 64, 16, 4, True,
                          (500, -1), 0.0, False),
}
# Cases that also pass attention sinks (applied once, by the combine, never per share).
SPLIT_SINKS = ("draft8_p64_softcap_g8", "ragged_p16")


@pytest.mark.parametrize("case", SPLIT, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128))
def test_key_split_matches_reference(head_dim, case):
  _need(head_dim, jnp.bfloat16)
  _check_paged(case, head_dim, jnp.bfloat16, seed=3 * head_dim + list(SPLIT).index(case))


@pytest.mark.parametrize("case", ("draft8_p16", "ragged_p1"), ids=str)
def test_key_split_fp16(case):
  _need(128, jnp.float16)
  _check_paged(case, 128, jnp.float16, seed=37)
