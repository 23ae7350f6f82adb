"""Attention sinks (`sinks=`, float32 [num_heads]) on the default backend: against the pure-JAX
reference and an independent float64 oracle (FlashAttention's rule: the kernel's error at most a
small multiple of the reference's error computed in the input precision), every layout x mask x
GQA, dtypes and head dims, page size 1 and odd page sizes, fully masked rows (0 output, lse =
sink), jit and vmap, gradients (d sinks included) and the trace-time checks."""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_sgl
from attention_cases import LAYOUTS, MASKS, TOL, make_case, naive_attention, reference_attention

_reference = functools.partial(reference_attention, return_lse=True)


def make_sinks(num_heads, seed):
  """Fresh random sinks of the size of a row's log-sum-exp (a few keys of N(0, 1) scores), so the
  sink changes every output noticeably; never zeros."""
  rng = np.random.default_rng(seed + 1000)
  return jnp.asarray(rng.uniform(-1.0, 4.0, num_heads), jnp.float32)


def _oracle_lse(oracle_lse, q, lse, varlen):
  """The oracle's [rows, H] lse in the kernel's lse layout."""
  return oracle_lse.T if varlen else np.swapaxes(oracle_lse, 1, 2)


def check_sinks(q, k, v, sinks, **kw):
  """Kernel vs reference (out, lse) and both vs the float64 oracle; returns (out, lse)."""
  dtype = q.dtype.type
  out, lse = jax_sgl.attention(q, k, v, sinks=sinks, return_lse=True, **kw)
  ref_out, ref_lse = _reference(q, k, v, sinks=sinks, **kw)
  assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
  assert lse.shape == ref_lse.shape and lse.dtype == jnp.float32
  got, want = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype])
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  fin = np.isfinite(np.asarray(ref_lse))
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], rtol=1e-4, atol=1e-4)

  # FlashAttention's rule against the float64 oracle: the reference in q's dtype (float32 math,
  # output rounded to q's dtype) sets the error budget.
  arrays = {n: kw[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "page_table", "seqused_k")
            if n in kw}
  flags = {n: kw[n] for n in ("causal", "window", "softcap", "softmax_scale") if n in kw}
  o64, l64 = naive_attention(q, k, v, sinks=sinks, return_lse=True, **arrays, **flags)
  varlen = "cu_seqlens_q" in kw
  rows = slice(0, o64.shape[0])   # varlen: rows past the last sequence are not the oracle's
  err = np.abs(got[rows] - o64).max(initial=0.0)
  ref_err = np.abs(want[rows] - o64).max(initial=0.0)
  assert err <= 2 * ref_err + 1e-5, f"error {err:.3g} vs the reference's {ref_err:.3g}"
  l_got = np.asarray(lse)[:, rows] if varlen else np.asarray(lse)
  l64 = _oracle_lse(l64, q, lse, varlen)
  np.testing.assert_array_equal(np.isneginf(l_got), np.isneginf(l64))
  fin = np.isfinite(l64)
  np.testing.assert_allclose(l_got[fin], l64[fin], rtol=1e-5, atol=1e-4)
  return out, lse


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("group", [1, 4])
def test_layout_mask_gqa(layout, mask, group):
  seed = zlib.crc32(f"sinks{layout}{mask}{group}".encode())
  q, k, v, arrays = make_case(layout, seed=seed, num_heads=4, num_kv_heads=4 // group)
  check_sinks(q, k, v, make_sinks(4, seed), **arrays, **MASKS[mask])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("head_dim", [80, 256])
@pytest.mark.parametrize("layout", ["varlen", "paged_pages"])
def test_dtypes_and_head_dims(dtype, head_dim, layout):
  q, k, v, arrays = make_case(layout, seed=head_dim, head_dim=head_dim, dtype=dtype,
                              q_lens=[1, 19, 7], k_lens=[33, 19, 40], page_size=16)
  check_sinks(q, k, v, make_sinks(4, head_dim), causal=True, **arrays)


@pytest.mark.parametrize("page_size", [1, 3, 5, 16])
def test_odd_page_sizes(page_size):
  layout = "paged_tokens" if page_size == 1 else "paged_pages"
  q, k, v, arrays = make_case(layout, seed=page_size, page_size=page_size, num_heads=6,
                              num_kv_heads=2, q_lens=[1, 19, 4, 1], k_lens=[99, 19, 13, 1])
  check_sinks(q, k, v, make_sinks(6, page_size), causal=True, **arrays)


def test_long_sequence_many_blocks():
  q, k, v, arrays = make_case("varlen", seed=7, q_lens=[99, 1], k_lens=[989, 200],
                              dtype=jnp.float32)
  check_sinks(q, k, v, make_sinks(4, 7), causal=True, **arrays)


@pytest.mark.parametrize("layout", ["dense", "varlen", "paged_pages"])
def test_fully_masked_rows_give_zero_and_lse_sink(layout):
  """KV shorter than q under causal: the leading rows see no key; an empty KV sequence too."""
  q, k, v, arrays = make_case(layout, seed=11, q_lens=[9, 3], k_lens=[4, 0], dtype=jnp.float32)
  if layout == "dense":   # dense k has max(k_lens) keys per sequence: seqused_k says how many
    arrays["seqused_k"] = jnp.array([4, 0], jnp.int32)
  sinks = make_sinks(4, 11)
  out, lse = check_sinks(q, k, v, sinks, causal=True, **arrays)
  out, lse = np.asarray(out), np.asarray(lse)
  s = np.asarray(sinks)
  if layout == "dense":    # q [2, 9, H, D]: sequence 0 rows 0-4 and all of sequence 1 see nothing
    assert not out[0, :5].any() and not out[1].any()
    np.testing.assert_array_equal(lse[0, :, :5], np.broadcast_to(s[:, None], (4, 5)))
    np.testing.assert_array_equal(lse[1], np.broadcast_to(s[:, None], (4, 9)))
    assert np.all(np.abs(out[0, 5:]).max(axis=-1) > 0)
  else:                    # q [12, H, D]: rows 0-4 and 9-11 see nothing
    dead = np.r_[0:5, 9:12]
    assert not out[dead].any()
    np.testing.assert_array_equal(lse[:, dead], np.broadcast_to(s[:, None], (4, len(dead))))


def test_rows_past_cu_seqlens_stay_zero_and_neg_inf():
  """Varlen rows that no sequence covers are not attention rows: 0 and -inf, sink or not."""
  q, k, v, arrays = make_case("varlen", seed=12, q_lens=[3, 4], k_lens=[5, 6], dtype=jnp.float32)
  q = jnp.concatenate([q, q[:2]])   # two rows past cu_seqlens_q[-1]
  out, lse = jax_sgl.attention(q, k, v, sinks=make_sinks(4, 12), return_lse=True, **arrays)
  assert not np.asarray(out)[7:].any()
  assert np.isneginf(np.asarray(lse)[:, 7:]).all()


def test_neg_inf_sinks_are_no_sinks():
  q, k, v, arrays = make_case("paged_pages", seed=13, num_heads=4, num_kv_heads=2)
  plain = jax_sgl.attention(q, k, v, return_lse=True, causal=True, **arrays)
  sunk = jax_sgl.attention(q, k, v, return_lse=True, causal=True,
                           sinks=jnp.full((4,), -jnp.inf, jnp.float32), **arrays)
  for a, b in zip(plain, sunk):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_sinks_are_not_scaled_by_softmax_scale():
  q, k, v, arrays = make_case("dense", seed=14, dtype=jnp.float32)
  check_sinks(q, k, v, make_sinks(4, 14), softmax_scale=0.3, **arrays)


def test_fp8_with_descales():
  q, k, v, _ = make_case("dense", seed=16, q_lens=[5, 5], k_lens=[9, 9], dtype=jnp.float32)
  rng = np.random.default_rng(16)
  qd, kd, vd = (jnp.asarray(rng.uniform(0.5, 2.0, (2, 2)), jnp.float32) for _ in range(3))
  q8, k8, v8 = (x.astype(jnp.float8_e4m3fn) for x in (q, k, v))
  kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=True, sinks=make_sinks(4, 16))
  out, lse = jax_sgl.attention(q8, k8, v8, return_lse=True, **kw)
  want_out, want_lse = _reference(q8, k8, v8, **kw)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32),
                             rtol=TOL[jnp.bfloat16], atol=TOL[jnp.bfloat16])
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-4, atol=1e-4)


def test_jit():
  q, k, v, arrays = make_case("varlen", seed=15)
  sinks = make_sinks(4, 15)
  f = jax.jit(lambda q, k, v, s, a: jax_sgl.attention(q, k, v, sinks=s, causal=True, **a))
  want = jax_sgl.attention(q, k, v, sinks=sinks, causal=True, **arrays)
  np.testing.assert_array_equal(np.asarray(f(q, k, v, sinks, arrays), np.float32),
                                np.asarray(want, np.float32))


def _stacked(n, seed, sinks_axis):
  """n dense float32 cases stacked on a leading axis, and their sinks: per instance (stacked too)
  when sinks_axis is 0, else one set shared by all."""
  cases = [make_case("dense", seed=seed + i, q_lens=[5, 7], k_lens=[9, 7], dtype=jnp.float32)
           for i in range(n)]
  q, k, v = (jnp.stack([c[j] for c in cases]) for j in range(3))
  sinks = (jnp.stack([make_sinks(4, seed + i) for i in range(n)]) if sinks_axis == 0
           else make_sinks(4, seed))
  return q, k, v, sinks


@pytest.mark.parametrize("sinks_axis", [None, 0])
def test_vmap(sinks_axis):
  """Shared sinks (broadcast to every instance) and per-instance sinks."""
  q, k, v, sinks = _stacked(3, 20, sinks_axis)
  f = lambda q, k, v, s: jax_sgl.attention(q, k, v, sinks=s, causal=True, return_lse=True)
  got = jax.vmap(f, in_axes=(0, 0, 0, sinks_axis))(q, k, v, sinks)
  for i in range(q.shape[0]):
    want = f(q[i], k[i], v[i], sinks[i] if sinks_axis == 0 else sinks)
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------

# As tests/test_attention_grad.py: max abs error relative to the largest reference entry.
GRAD_TOL = {jnp.float32: 1e-5, jnp.float16: 2e-3, jnp.bfloat16: 1.5e-2}


def _grad_compare(q, k, v, sinks, kw, *, with_lse, seed=1):
  rng = np.random.default_rng(seed)
  ref_out, ref_lse = _reference(q, k, v, sinks=sinks, **kw)
  w_out = jnp.asarray(rng.standard_normal(ref_out.shape), jnp.float32)
  w_lse = jnp.asarray(rng.standard_normal(ref_lse.shape), jnp.float32)

  def loss(attn):
    def f(q, k, v, s):
      out, lse = attn(q, k, v, s)
      total = jnp.sum(out.astype(jnp.float32) * w_out)
      if with_lse:   # rows no sequence covers have lse = -inf: leave them out
        total += jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)
      return total
    return f

  ours = jax.grad(loss(lambda q, k, v, s: jax_sgl.attention(q, k, v, sinks=s, return_lse=True,
                                                            **kw)), argnums=(0, 1, 2, 3))
  ref = jax.grad(loss(lambda q, k, v, s: _reference(q, k, v, sinks=s, **kw)),
                 argnums=(0, 1, 2, 3))
  got = ours(q, k, v, sinks)
  want = ref(*(x.astype(jnp.float32) for x in (q, k, v)), sinks)
  tol = GRAD_TOL[q.dtype.type]
  for name, x, g, r in zip(("q", "k", "v", "sinks"), (q, k, v, sinks), got, want):
    assert g.shape == x.shape and g.dtype == x.dtype, name
    g, r = np.asarray(g, np.float32), np.asarray(r)
    assert np.isfinite(g).all(), f"d{name} has non-finite entries"
    err = float(np.max(np.abs(g - r))) / max(float(np.max(np.abs(r))), 1e-6)
    assert err <= tol, f"d{name}: relative error {err:.3g} > {tol:g}"


@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("flags", ["none", "causal", "window", "softcap"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grad_dense(flags, dtype, with_lse):
  # 19 queries over 11-17 keys: causal leaves fully masked rows (they still feed d sinks via lse).
  q, k, v, arrays = make_case("dense", seed=30, q_lens=[19, 5], k_lens=[11, 17], dtype=dtype,
                              head_dim=64)
  _grad_compare(q, k, v, make_sinks(4, 30), {**arrays, **MASKS[flags]}, with_lse=with_lse)


@pytest.mark.parametrize("with_lse", [False, True])
def test_grad_varlen_with_uncovered_rows(with_lse):
  q, k, v, arrays = make_case("varlen", seed=31, q_lens=[1, 19, 0, 7], k_lens=[7, 19, 5, 3],
                              dtype=jnp.float32, num_heads=6, num_kv_heads=3)
  q = jnp.concatenate([q, q[:3]])   # rows past cu_seqlens_q[-1]
  _grad_compare(q, k, v, make_sinks(6, 31), dict(arrays, causal=True), with_lse=with_lse)


def test_check_grads_numerical():
  """Finite differences of the native forward against the custom vjp, sinks included."""
  q, k, v, arrays = make_case("dense", seed=32, q_lens=[5], k_lens=[7], num_heads=2,
                              num_kv_heads=1, head_dim=8, dtype=jnp.float32)
  w = jnp.asarray(np.random.default_rng(33).standard_normal((1, 5, 2, 8)), jnp.float32)
  f = lambda q, k, v, s: jnp.sum(jax_sgl.attention(q, k, v, sinks=s, causal=True) * w)
  check_grads(f, (q, k, v, make_sinks(2, 32)), order=1, modes=["rev"], eps=1e-2, atol=2e-2,
              rtol=2e-2)
  g = lambda q, k, v, s: jax_sgl.attention(q, k, v, sinks=s, window=(2, 1), return_lse=True)
  check_grads(g, (q, k, v, make_sinks(2, 34)), order=1, modes=["rev"], eps=1e-2, atol=2e-2,
              rtol=2e-2)


@pytest.mark.parametrize("sinks_axis", [None, 0])
def test_grad_under_vmap(sinks_axis):
  q, k, v, sinks = _stacked(2, 40, sinks_axis)
  w = jnp.asarray(np.random.default_rng(41).standard_normal(q.shape[1:]), jnp.float32)
  g = jax.grad(lambda q, k, v, s: jnp.sum(jax_sgl.attention(q, k, v, sinks=s, causal=True) * w),
               argnums=(0, 1, 2, 3))
  got = jax.vmap(g, in_axes=(0, 0, 0, sinks_axis))(q, k, v, sinks)
  for i in range(q.shape[0]):
    want = g(q[i], k[i], v[i], sinks[i] if sinks_axis == 0 else sinks)
    for a, b in zip(got, want):   # every gradient is per instance, d sinks too
      np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Trace-time checks
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sinks, exc, match", [
    (jnp.zeros((4,), jnp.bfloat16), TypeError, r"sinks must be float32, got bfloat16"),
    (jnp.zeros((4,), jnp.int32), TypeError, r"sinks must be float32, got int32"),
    (jnp.zeros((2,), jnp.float32), ValueError, r"sinks must have shape \[num_heads\] = \(4,\)"),
    (jnp.zeros((1, 4), jnp.float32), ValueError, r"sinks must have shape .*got \(1, 4\)"),
    (jnp.zeros((), jnp.float32), ValueError, r"sinks must have shape .*got \(\)"),
])
def test_bad_sinks_raise_at_trace_time(sinks, exc, match):
  q, k, v, arrays = make_case("dense", seed=50)
  with pytest.raises(exc, match=r"jax_sgl.attention: " + match):
    jax.eval_shape(lambda: jax_sgl.attention(q, k, v, sinks=sinks, **arrays))
