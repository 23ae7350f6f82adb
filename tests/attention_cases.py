"""Random attention problems in every layout, shared by the CPU, GPU and gradient tests.

`make_case` returns the public-API arguments of jax_sgl.attention; `reference_attention` runs the
float32 reference on the same arguments (normalizing them the way the public function does).
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import jax_sgl
from jax_sgl import reference
from jax_sgl._checks import KV_PAGED, check_attention

LAYOUTS = ("dense", "varlen", "paged_tokens", "paged_pages")
MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window": dict(window=(3, 2)),
    "causal_window": dict(causal=True, window=(5, -1)),
    "softcap": dict(softcap=3.0, causal=True),
}
TOL = {jnp.float32: 2e-5, jnp.float16: 2e-3, jnp.bfloat16: 2e-2}


def _normal(rng, shape, dtype, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def random_page_table(rng, k_lens, page_size, extra_pages, *, min_columns=0, bad_entries=False,
                      runs=False):
  """A page table giving each sequence's keys distinct shuffled pages, then -1 (padding), and the
  pool's page count (extra_pages more than the sequences use). With bad_entries, the columns past
  the padding hold entries beyond the pool (num_pages + 3, 2**30), and sequence 0, where it uses
  more than two pages, has two bad entries among them (num_pages, -5): those keys are masked,
  never read. At least min_columns + 1 columns. With runs, the pages come in runs of 1-9
  consecutive pages, the runs shuffled (as an allocator's sorted free list hands them out), so
  runs start and end at any column."""
  need = [-(-kl // page_size) for kl in k_lens]
  num_pages = sum(need) + extra_pages
  columns = max(need + [1, min_columns]) + (3 if bad_entries else 1)
  if runs:
    cuts = np.cumsum(rng.integers(1, 10, size=num_pages))
    pieces = np.split(np.arange(num_pages), cuts[cuts < num_pages])
    perm = np.concatenate([pieces[i] for i in rng.permutation(len(pieces))])
  else:
    perm = rng.permutation(num_pages)
  table = np.full((len(k_lens), columns), -1, np.int32)
  used = 0
  for b, n in enumerate(need):
    table[b, :n] = perm[used:used + n]
    used += n
    if bad_entries:
      table[b, n + 1:] = num_pages + 3 if b % 2 else 2**30
  if bad_entries and need[0] > 2:
    table[0, 1] = num_pages
    table[0, need[0] // 2] = -5
  return table, num_pages


def random_normal(key, shape, dtype):
  """Standard normal values (jax.random) drawn in float32 and rounded to dtype."""
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def random_paged_kv(rng, keys, k_lens, page_size, kv_heads, head_dim, head_dim_v, dtype):
  """k and v in a page pool (page size 1: the token pool [pages, heads, dim]) with 5 pages nobody
  reads, drawn from keys[1] and keys[2], and their page_table (random_page_table with bad
  entries) and seqused_k arguments."""
  table, num_pages = random_page_table(rng, k_lens, page_size, 5, bad_entries=True)
  pool = (num_pages,) if page_size == 1 else (num_pages, page_size)
  k = random_normal(keys[1], pool + (kv_heads, head_dim), dtype)
  v = random_normal(keys[2], pool + (kv_heads, head_dim_v), dtype)
  return k, v, {"page_table": jnp.asarray(table), "seqused_k": jnp.asarray(k_lens, jnp.int32)}


def padded_dense_case(keys, q_lens, k_lens, heads, head_dim, head_dim_v, dtype):
  """(q, k, v, kwargs) of the sequences (q_lens, k_lens) as a dense batch padded to the longest q
  and k, q / k / v drawn from keys[0] / keys[1] / keys[2]; seqused_k = k_lens masks the padded
  keys. heads is (num_heads, num_kv_heads)."""
  num_heads, num_kv_heads = heads
  batch, sq, sk = len(q_lens), max(q_lens), max(k_lens)
  q = random_normal(keys[0], (batch, sq, num_heads, head_dim), dtype)
  k = random_normal(keys[1], (batch, sk, num_kv_heads, head_dim), dtype)
  v = random_normal(keys[2], (batch, sk, num_kv_heads, head_dim_v), dtype)
  return q, k, v, {"seqused_k": jnp.asarray(k_lens, jnp.int32)}


def make_case(layout, *, seed=0, batch=3, q_lens=None, k_lens=None, num_heads=4, num_kv_heads=2,
              head_dim=64, head_dim_v=None, dtype=jnp.bfloat16, page_size=4, extra_pages=3):
  """Returns (q, k, v, kwargs) for jax_sgl.attention. Dense uses max(q_lens) / max(k_lens)."""
  rng = np.random.default_rng(seed)
  head_dim_v = head_dim if head_dim_v is None else head_dim_v
  q_lens = list(rng.integers(1, 12, batch)) if q_lens is None else list(q_lens)
  k_lens = [ql + int(rng.integers(0, 9)) for ql in q_lens] if k_lens is None else list(k_lens)
  batch = len(q_lens)
  h, hkv, d, dv = num_heads, num_kv_heads, head_dim, head_dim_v
  kwargs = {}
  if layout == "dense":
    sq, sk = max(q_lens), max(k_lens)
    q = _normal(rng, (batch, sq, h, d), dtype)
    k = _normal(rng, (batch, sk, hkv, d), dtype)
    v = _normal(rng, (batch, sk, hkv, dv), dtype)
    return q, k, v, kwargs
  cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = _normal(rng, (int(cu_q[-1]), h, d), dtype)
  kwargs["cu_seqlens_q"] = jnp.asarray(cu_q)
  if layout == "varlen":
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    k = _normal(rng, (int(cu_k[-1]), hkv, d), dtype)
    v = _normal(rng, (int(cu_k[-1]), hkv, dv), dtype)
    kwargs["cu_seqlens_k"] = jnp.asarray(cu_k)
    return q, k, v, kwargs
  ps = 1 if layout == "paged_tokens" else page_size
  table, num_pages = random_page_table(rng, k_lens, ps, extra_pages)
  shape = (num_pages, hkv, d) if ps == 1 else (num_pages, ps, hkv, d)
  k = _normal(rng, shape, dtype)
  v = _normal(rng, shape[:-1] + (dv,), dtype)
  kwargs["page_table"] = jnp.asarray(table)
  kwargs["seqused_k"] = jnp.asarray(np.array(k_lens, np.int32))
  return q, k, v, kwargs


def reference_attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1),
                        softcap=0.0, return_lse=False, **arrays):
  """The float32 reference on public-API arguments."""
  names = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table", "q_descale", "k_descale",
           "v_descale", "sinks")
  full = {n: arrays.get(n) for n in names}
  spec = check_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                         softcap=softcap, **full)
  if spec.kv_layout == KV_PAGED and k.ndim == 3:
    k, v = k[:, None], v[:, None]
    if spec.qk_blockscaled:   # k's block scales share its token-pool layout
      full["k_descale"] = full["k_descale"][:, None]
  out, lse = reference.attention(
      q, k, v, kv_layout=spec.kv_layout, varlen_q=spec.varlen_q, batch=spec.batch,
      softmax_scale=spec.softmax_scale, softcap=spec.softcap, causal=spec.causal,
      window_left=spec.window_left, window_right=spec.window_right, out_dtype=spec.out_dtype,
      **{n: x for n, x in full.items() if x is not None})
  return (out, lse) if return_lse else out


def naive_attention(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, sinks=None,
                    return_lse=False, softmax_scale=None, p_round=None, **arrays):
  """A per-sequence, per-head NumPy loop in float64: an oracle independent of reference.py.
  With `sinks` each head's logit joins the denominator; `return_lse` adds lse per (row, head)
  in q's row layout ([B, Sq, H] or [total_q, H]; rows of no sequence are left out). `p_round`
  rounds the unnormalized probabilities (relative to the row max) before P V, the denominator
  staying unrounded: a kernel's P precision (the fp8 kernels' e4m3 P)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  cu_q, cu_k = arrays.get("cu_seqlens_q"), arrays.get("cu_seqlens_k")
  table, used = arrays.get("page_table"), arrays.get("seqused_k")
  if cu_q is None:
    batch = q.shape[0]
    qs = [q[b] for b in range(batch)]
  else:
    cu_q = np.asarray(cu_q)
    batch = len(cu_q) - 1
    qs = [q[cu_q[b]:cu_q[b + 1]] for b in range(batch)]
  if table is not None:
    pool_k = k.reshape((-1,) + k.shape[-2:])
    pool_v = v.reshape((-1,) + v.shape[-2:])
    ps = 1 if k.ndim == 3 else k.shape[1]
    num_pages = k.shape[0]
    ks, vs, oks = [], [], []
    for b in range(batch):
      n = int(np.asarray(used)[b])
      rows, ok = [], []
      for j in range(n):
        page = int(np.asarray(table)[b, j // ps])
        ok.append(0 <= page < num_pages)
        rows.append(max(0, min(page, num_pages - 1)) * ps + j % ps)
      ks.append(pool_k[rows]), vs.append(pool_v[rows]), oks.append(np.array(ok, bool))
  elif cu_k is not None:
    cu_k = np.asarray(cu_k)
    ks = [k[cu_k[b]:cu_k[b + 1]] for b in range(batch)]
    vs = [v[cu_k[b]:cu_k[b + 1]] for b in range(batch)]
    oks = [np.ones(len(x), bool) for x in ks]
  else:
    ks, vs = [k[b] for b in range(batch)], [v[b] for b in range(batch)]
    oks = [np.ones(len(x), bool) for x in ks]
  if table is None and used is not None:   # seqused_k limits dense and varlen keys too
    n = [max(0, int(u)) for u in np.asarray(used)]
    ks, vs, oks = ([x[:n[b]] for b, x in enumerate(xs)] for xs in (ks, vs, oks))
  h, d = q.shape[-2:]
  group = h // k.shape[-2]
  scale = 1 / np.sqrt(d) if softmax_scale is None else softmax_scale
  outs, lses = [], []
  for b in range(batch):
    qb, kb, vb, ok = qs[b], ks[b], vs[b], oks[b]
    lq, lk = len(qb), len(kb)
    o = np.zeros((lq, h, v.shape[-1]))
    lse = np.full((lq, h), -np.inf)
    for hh in range(h):
      for i in range(lq):
        diag = i + lk - lq
        s = kb[:, hh // group] @ qb[i, hh] * scale
        if softcap:
          s = softcap * np.tanh(s / softcap)
        j = np.arange(lk)
        m = ok.copy()
        if window[0] >= 0:
          m &= j >= diag - window[0]
        if causal:
          m &= j <= diag
        elif window[1] >= 0:
          m &= j <= diag + window[1]
        sink = -np.inf if sinks is None else np.float64(np.asarray(sinks)[hh])
        if not m.any():
          lse[i, hh] = sink
          continue
        top = max(s[m].max(), sink)
        p = np.exp(s[m] - top)
        denom = p.sum() + np.exp(sink - top)
        o[i, hh] = ((p if p_round is None else p_round(p)) @ vb[m, hh // group]) / denom
        lse[i, hh] = top + np.log(denom)
    outs.append(o)
    lses.append(lse)
  join = np.concatenate if cu_q is not None else np.stack
  return (join(outs), join(lses)) if return_lse else join(outs)


# Call options of jax_sgl.attention that are Python values (static), not operands.
STATIC_OPTIONS = ("causal", "softcap", "window", "softmax_scale")


def run_attention_on(device, q, k, v, kwargs):
  """(out, lse) of jax_sgl.attention with every operand placed on `device` (so that the call
  lowers for, and runs on, its platform): the GPU tests' way to run the CPU kernel beside it."""
  static = {n: x for n, x in kwargs.items() if n in STATIC_OPTIONS}
  put = lambda x: jax.device_put(np.asarray(x), device)
  operands = {n: put(x) for n, x in kwargs.items() if n not in STATIC_OPTIONS}
  f = jax.jit(lambda q, k, v, a: jax_sgl.attention(q, k, v, return_lse=True, **static, **a))
  return f(put(q), put(k), put(v), operands)


def planned_kernels(q, k, v, kwargs, compute_capability=(9, 0)):
  """[(direction, kernel)] this build's CUDA dispatch plans for the call run_attention_on makes
  (jax_sgl._plan; needs the CUDA build)."""
  from jax_sgl._plan import cuda_attention_kernels
  static = {n: x for n, x in kwargs.items() if n in STATIC_OPTIONS}
  operands = {n: np.asarray(x) for n, x in kwargs.items() if n not in STATIC_OPTIONS}
  return cuda_attention_kernels(lambda q, k, v, a: jax_sgl.attention(q, k, v, **static, **a),
                                q, k, v, operands, compute_capability=compute_capability)


def is_sm90_device():
  """The default backend is a GPU of compute capability 9.0, the only one sm_90a kernels run on."""
  devices = jax.devices("cuda") if jax.default_backend() == "gpu" else []
  return bool(devices) and getattr(devices[0], "compute_capability", "") == "9.0"


def require_sm90(monkeypatch, what):
  """Skips the test off a compute capability 9.0 device (`what`, an sm_90a kernel, runs on no
  other); there, clears JAX_SGL_DISABLE for it, so that its calls take the sm90 kernels."""
  if not is_sm90_device():
    pytest.skip(f"{what} needs a compute capability 9.0 device")
  monkeypatch.delenv("JAX_SGL_DISABLE", raising=False)


def turn_off_xla_autotuning():
  """Sets --xla_gpu_autotune_level=0 in XLA_FLAGS unless a level is set there already: every GPU
  case has new shapes, each costing XLA's GEMM autotuner seconds per oracle einsum, and the
  oracle needs no tuned GEMM. Only read when the GPU backend starts, so a test module calls it at
  import (collection imports every module before any test runs)."""
  if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_gpu_autotune_level=0").strip()


# (batch, seqlen_q, seqlen_k, num_heads, num_kv_heads) of dense calls on the sm90 kernels' tiles:
# whole tiles, odd lengths that end mid-tile, GQA, q much shorter than k, q longer than k (causal
# rows that see no key).
DENSE_SHAPES = {
    "aligned": (1, 256, 384, 2, 2),
    "square": (2, 333, 333, 8, 2),
    "q_short": (3, 19, 989, 4, 4),
    "k_short": (2, 300, 129, 6, 2),
}

# The GPU test matrices' masks (each test file has its own call arguments for them), with the
# (num_heads, num_kv_heads) each runs at: MHA, GQA 4, GQA 3 (odd group), MQA 8.
MATRIX_HEADS = {"none": (2, 2), "causal": (8, 2), "window": (6, 2), "softcap": (8, 1)}


def parametrize_matrix(layouts, head_dims):
  """The parametrization of a GPU test matrix(layout, mask, head_dim, dtype): layouts x the masks
  of MATRIX_HEADS x head_dims x (bfloat16, float16), test ids layout-mask-head_dim-dtype."""
  def parametrize(test):
    test = pytest.mark.parametrize("layout", layouts)(test)
    test = pytest.mark.parametrize("mask", tuple(MATRIX_HEADS))(test)
    test = pytest.mark.parametrize("head_dim", head_dims)(test)
    return pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float16),
                                   ids=lambda d: jnp.dtype(d).name)(test)
  return parametrize


def matrix_case(build, layout, mask, head_dim, dtype):
  """build(layout, head_dim, head_dim_v, heads, dtype, seed) of a GPU test matrix's case: d_v = d,
  the mask's MATRIX_HEADS, and a seed that differs between cases and stays the same across runs."""
  seed = zlib.crc32(f"{layout}{mask}{head_dim}".encode()) % 1000
  return build(layout, head_dim, head_dim, MATRIX_HEADS[mask], dtype, seed)


def poison_allocator(nbytes):
  """Leaves a NaN-filled block in the device allocator, so the next outputs likely land on it and
  an element a kernel forgets to write shows up as NaN."""
  x = jnp.full((max(nbytes // 4, 1),), jnp.nan, jnp.float32)
  x.block_until_ready()
  del x


def check_kernel_output(run, want_out, want_lse, dtype, tol):
  """Runs `run()` -> (out, lse) of jax_sgl.attention right after poisoning the allocator, and
  checks it against the reference's (want_out, want_lse): dtype and shape, every output element
  written and finite, within `tol`; lse -inf exactly where the reference's is (rows with no key),
  close elsewhere, never NaN."""
  poison_allocator(want_out.size * want_out.dtype.itemsize + want_lse.size * 4)
  out, lse = run()
  assert out.dtype == dtype and out.shape == want_out.shape
  out_np = np.asarray(out.astype(jnp.float32))
  assert np.isfinite(out_np).all(), "unwritten (NaN) or non-finite output elements"
  np.testing.assert_allclose(out_np, np.asarray(want_out.astype(jnp.float32)), atol=tol, rtol=tol)
  lse_np, want_lse_np = np.asarray(lse), np.asarray(want_lse)
  np.testing.assert_array_equal(np.isneginf(lse_np), np.isneginf(want_lse_np))
  fin = np.isfinite(want_lse_np)
  np.testing.assert_allclose(lse_np[fin], want_lse_np[fin], atol=2e-3, rtol=1e-3)
  assert not np.isnan(lse_np).any()


def climbing(q, k, per_128, q0):
  """q, k (float64 arrays, dequantized values) with feature 0 replaced so that scores climb
  toward the first key, where the kernel's walk over key tiles ends (it starts at the last): by
  `per_128` log2 units of the softmax per 128 keys in every third row, per_128 / 8 in the next,
  not at all in the third. So in one warp some rows move their running max (and rescale O) by
  large factors every step, some by small ones and some never. q's feature 0 is q0 (or a
  fraction of it); k's grows by the step that gives the climb."""
  d, sk = q.shape[-1], k.shape[1]
  step = per_128 / 128 / np.log2(np.e) * np.sqrt(d) / q0
  q, k = np.array(q, np.float64), np.array(k, np.float64)
  q[..., 0] = q0 * np.array([1.0, 1 / 8, 0.0])[np.arange(q.shape[1]) % 3][None, :, None]
  k[..., 0] = step * (sk - np.arange(sk))[None, :, None]
  return q, k
