"""Gradients of jax_sgl.attention (custom_vjp + the CPU backward kernel) against jax.grad of the
pure-JAX reference, on fresh random inputs: dense and varlen layouts, causal/window/softcap,
GQA/MQA, float32/float16/bfloat16, awkward sizes; numerical checks; jit, vmap; the backward does
not re-run the forward; paged KV and fp8 refuse to differentiate."""

import dataclasses
import functools
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_sgl
from attention_cases import reference_attention


# Max abs error of a gradient, relative to the largest reference gradient entry: about 4x what
# the kernel shows (float32 ~1e-6 from summation order; float16 ~5e-4 and bfloat16 ~4e-3 from
# rounding out/dout and the gradients to 11 and 8 bits).
TOL = {jnp.float32: 1e-5, jnp.float16: 2e-3, jnp.bfloat16: 1.5e-2}


def _rand(rng, shape, dtype):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


# (out, lse) of the float32 reference, with the public function's argument conventions.
_reference = functools.partial(reference_attention, return_lse=True)


def _loss(attn, w_out, w_lse=None):
  """A scalar loss whose gradient has random dout (and dlse when w_lse is given)."""
  def loss(q, k, v):
    res = attn(q, k, v)
    out, lse = res if isinstance(res, tuple) else (res, None)
    total = jnp.sum(out.astype(jnp.float32) * w_out)
    if w_lse is not None:   # fully masked rows have lse = -inf: leave them out of the loss
      total += jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)
    return total
  return loss


def _compare(q, k, v, kw, *, with_lse=False, seed=1):
  rng = np.random.default_rng(seed)
  out_shape = q.shape[:-1] + (v.shape[-1],)
  w_out = _rand(rng, out_shape, jnp.float32)
  lse_shape = jax.eval_shape(lambda: _reference(q, k, v, **kw))[1].shape
  w_lse = _rand(rng, lse_shape, jnp.float32) if with_lse else None

  ours = jax.grad(_loss(lambda q, k, v: jax_sgl.attention(q, k, v, return_lse=with_lse, **kw),
                        w_out, w_lse), argnums=(0, 1, 2))(q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  ref = jax.grad(_loss(lambda q, k, v: _reference(q, k, v, **kw) if with_lse
                       else _reference(q, k, v, **kw)[0], w_out, w_lse),
                 argnums=(0, 1, 2))(*f32)
  tol = TOL[q.dtype.type]
  for name, x, g, r in zip("qkv", (q, k, v), ours, ref):
    assert g.shape == x.shape and g.dtype == x.dtype, name
    g = np.asarray(g.astype(jnp.float32))
    r = np.asarray(r)
    assert np.all(np.isfinite(g)), f"d{name} has non-finite entries"
    scale = max(float(np.max(np.abs(r))), 1e-6)
    err = float(np.max(np.abs(g - r))) / scale
    assert err <= tol, f"d{name}: relative error {err:.3g} > {tol:g}"


def _dense(rng, b, sq, sk, h, hkv, d, dv=None, dtype=jnp.float32):
  dv = d if dv is None else dv
  return (_rand(rng, (b, sq, h, d), dtype), _rand(rng, (b, sk, hkv, d), dtype),
          _rand(rng, (b, sk, hkv, dv), dtype))


FLAGS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window=(7, 2)),
    "causal_window": dict(causal=True, window=(5, 0)),
    "softcap": dict(softcap=5.0),
    "causal_softcap": dict(causal=True, softcap=3.0),
}


@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("shape", [
    (2, 19, 33, 4, 2, 64, 64),      # GQA, odd lengths
    (1, 33, 19, 3, 1, 80, 80),      # MQA, more queries than keys: causal masks whole rows
    (3, 1, 19, 2, 2, 128, 64),      # decode row, head_dim_v != head_dim
])
def test_dense_float32(shape, flags):
  b, sq, sk, h, hkv, d, dv = shape
  q, k, v = _dense(np.random.default_rng(0), b, sq, sk, h, hkv, d, dv)
  _compare(q, k, v, FLAGS[flags])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("flags", ["plain", "causal_softcap", "causal_window"])
def test_dense_low_precision(dtype, flags):
  q, k, v = _dense(np.random.default_rng(2), 2, 33, 40, 4, 2, 64, dtype=dtype)
  _compare(q, k, v, FLAGS[flags])


def test_seqused_k_dense():
  q, k, v = _dense(np.random.default_rng(3), 3, 9, 19, 2, 1, 64)
  seqused_k = jnp.array([19, 4, 0], jnp.int32)   # a sequence with no keys has no gradient
  _compare(q, k, v, dict(causal=True, seqused_k=seqused_k))


def _varlen(rng, q_lens, k_lens, h, hkv, d, dtype=jnp.float32, pad=3):
  """Packed q/k/v with `pad` uncovered rows after the last sequence."""
  cu_q = jnp.array(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
  cu_k = jnp.array(np.concatenate([[0], np.cumsum(k_lens)]), jnp.int32)
  q = _rand(rng, (int(cu_q[-1]) + pad, h, d), dtype)
  k = _rand(rng, (int(cu_k[-1]) + pad, hkv, d), dtype)
  v = _rand(rng, (int(cu_k[-1]) + pad, hkv, d), dtype)
  return q, k, v, dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("flags", ["plain", "causal", "window", "causal_softcap"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_varlen(flags, dtype):
  q, k, v, idx = _varlen(np.random.default_rng(4), [1, 19, 33, 0], [7, 19, 40, 5], 4, 2, 64,
                         dtype)
  _compare(q, k, v, {**idx, **FLAGS[flags]})


@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_lse_cotangent(layout):
  """A loss on lse as well as out: the lse cotangent enters the backward exactly."""
  rng = np.random.default_rng(5)
  if layout == "dense":
    q, k, v = _dense(rng, 2, 19, 11, 4, 2, 64)
    kw = dict(causal=True, softcap=4.0)   # 19 > 11 queries: 8 fully masked rows per sequence
  else:
    q, k, v, idx = _varlen(rng, [5, 19], [9, 12], 2, 1, 64)
    kw = dict(idx, causal=True)
  _compare(q, k, v, kw, with_lse=True)


@pytest.mark.parametrize("flags", ["causal_window", "softcap"])
def test_check_grads_numerical(flags):
  """Finite differences of the native forward against the native backward (float32)."""
  q, k, v = _dense(np.random.default_rng(6), 1, 5, 7, 2, 1, 8)
  rng = np.random.default_rng(7)
  w = _rand(rng, (1, 5, 2, 8), jnp.float32)
  f = lambda q, k, v: jnp.sum(jax_sgl.attention(q, k, v, **FLAGS[flags]) * w)
  check_grads(f, (q, k, v), order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


def test_check_grads_varlen_with_lse():
  q, k, v, idx = _varlen(np.random.default_rng(8), [3, 4], [5, 2], 2, 2, 8, pad=0)
  f = lambda q, k, v: jax_sgl.attention(q, k, v, causal=True, return_lse=True, **idx)
  check_grads(f, (q, k, v), order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


def test_grad_under_jit_matches_eager_and_is_deterministic():
  rng = np.random.default_rng(10)
  q, k, v = _dense(rng, 2, 19, 33, 4, 2, 64)
  w = _rand(rng, q.shape, jnp.float32)
  g = jax.grad(lambda q, k, v: jnp.sum(jax_sgl.attention(q, k, v, causal=True) * w),
               argnums=(0, 1, 2))
  eager = g(q, k, v)
  jitted = jax.jit(g)(q, k, v)
  again = jax.jit(g)(q, k, v)
  for a, b, c in zip(eager, jitted, again):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(b), np.asarray(c))


def test_deterministic_changes_nothing_on_cpu():
  """The CPU backward has no atomics: deterministic=True gives the same bits as the default."""
  rng = np.random.default_rng(11)
  q, k, v = _dense(rng, 2, 19, 33, 4, 2, 64)
  w = _rand(rng, q.shape, jnp.float32)
  grads = [jax.jit(jax.grad(
      lambda q, k, v: jnp.sum(jax_sgl.attention(q, k, v, causal=True, deterministic=det) * w),
      argnums=(0, 1, 2)))(q, k, v) for det in (False, True)]
  for a, b in zip(*grads):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, None), (None, 1, 1)])
def test_grad_under_vmap(in_axes):
  rng = np.random.default_rng(11)
  n = 3
  q, k, v = _dense(rng, 2, 17, 21, 4, 2, 64)
  batched = [jnp.stack([x] + [_rand(rng, x.shape, x.dtype) for _ in range(n - 1)], axis=ax)
             if ax is not None else x for x, ax in zip((q, k, v), in_axes)]
  w = _rand(rng, q.shape, jnp.float32)
  g = jax.grad(lambda q, k, v: jnp.sum(jax_sgl.attention(q, k, v, causal=True,
                                                         softcap=6.0) * w), argnums=(0, 1, 2))
  got = jax.jit(jax.vmap(g, in_axes=in_axes))(*batched)
  for i in range(n):
    args = [jnp.take(x, i, axis=ax) if ax is not None else x for x, ax in zip(batched, in_axes)]
    want = g(*args)
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_grad_under_vmap_with_batched_index_arrays():
  """Per-instance cu_seqlens: the batching rule maps over the instances."""
  rng = np.random.default_rng(12)
  q, k, v, _ = _varlen(rng, [6, 10], [8, 8], 2, 1, 64, pad=0)
  cu_q = jnp.array([[0, 6, 16], [0, 11, 16]], jnp.int32)
  cu_k = jnp.array([[0, 8, 16], [0, 3, 16]], jnp.int32)
  w = _rand(rng, q.shape, jnp.float32)

  def g(cu_q, cu_k):
    return jax.grad(lambda q, k, v: jnp.sum(jax_sgl.attention(
        q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k) * w), argnums=(0, 1, 2))(
            q, k, v)
  got = jax.vmap(g)(cu_q, cu_k)
  for i in range(2):
    for a, b in zip(got, g(cu_q[i], cu_k[i])):
      np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), rtol=1e-6, atol=1e-6)


def _count_eqns(jaxpr, name):
  """Equations of primitive `name` in jaxpr and every jaxpr nested in its equations (jit, ...)."""
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == name
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      n += _count_eqns(sub, name)
  return n


def test_backward_reuses_saved_residuals():
  """jax.grad runs the forward kernel once and the backward kernel once: no recomputation."""
  q, k, v = _dense(np.random.default_rng(13), 1, 9, 9, 2, 1, 64)
  f = lambda q, k, v: jnp.sum(jax_sgl.attention(q, k, v, causal=True) ** 2)
  jaxpr = jax.make_jaxpr(jax.jit(jax.grad(f, argnums=(0, 1, 2))))(q, k, v).jaxpr
  assert _count_eqns(jaxpr, "jax_sgl_attention_fwd") == 1
  assert _count_eqns(jaxpr, "jax_sgl_attention_bwd") == 1


def test_index_arrays_get_no_gradient():
  q, k, v, idx = _varlen(np.random.default_rng(14), [4, 5], [6, 3], 2, 1, 64)
  grads = jax.grad(lambda q, cu_q: jnp.sum(jax_sgl.attention(
      q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=idx["cu_seqlens_k"])), argnums=(0, 1),
      allow_int=True)(q, idx["cu_seqlens_q"])
  assert grads[1].dtype == jax.dtypes.float0


def test_paged_kv_is_forward_only():
  rng = np.random.default_rng(15)
  q = _rand(rng, (2, 1, 4, 64), jnp.float32)
  pool = _rand(rng, (8, 2, 64), jnp.float32)
  page_table = jnp.array([[0, 1, 2], [3, 4, 5]], jnp.int32)
  seqused_k = jnp.array([3, 2], jnp.int32)
  f = lambda q, pool: jnp.sum(jax_sgl.attention(q, pool, pool, page_table=page_table,
                                                seqused_k=seqused_k))
  f(q, pool)   # the forward works
  with pytest.raises(NotImplementedError, match="gradients through paged KV are not supported"):
    jax.eval_shape(jax.grad(f), q, pool)


def test_fp8_is_forward_only():
  rng = np.random.default_rng(16)
  q, k, v = (x.astype(jnp.float8_e4m3fn) for x in _dense(rng, 1, 4, 4, 2, 1, 64))
  scale = jnp.ones((1, 1), jnp.float32)
  f = lambda q: jnp.sum(jax_sgl.attention(q, k, v, q_descale=scale, k_descale=scale,
                                          v_descale=scale).astype(jnp.float32))
  with pytest.raises(NotImplementedError, match="gradients through fp8 inputs are not supported"):
    jax.eval_shape(jax.grad(f), q)


def test_backward_lowers_to_reference_without_native_kernel():
  """On a platform with no native kernel (TPU here, exported from the CPU) the backward lowers to
  the reference's vjp: no jax_sgl custom call is left in the module."""
  q, k, v = _dense(np.random.default_rng(17), 1, 5, 6, 2, 1, 64)
  f = lambda q, k, v: jnp.sum(jax_sgl.attention(q, k, v, causal=True, softcap=2.0))
  with warnings.catch_warnings():
    # The fallback warns once per (target, platform) and process: another test may have seen it.
    warnings.simplefilter("ignore", RuntimeWarning)
    exported = jax.export.export(jax.jit(jax.grad(f, argnums=(0, 1, 2))), platforms=["tpu"])(
        q, k, v)
  # The primitive's name may still appear in debug locations (jax 0.11+); only a custom call counts.
  module = exported.mlir_module()
  assert "stablehlo.dot_general" in module
  assert "custom_call @jax_sgl" not in module


@pytest.mark.skipif("jax_sgl_attention_bwd" not in jax_sgl.CUDA_TARGETS,
                    reason="built without the CUDA backward")
@pytest.mark.parametrize("opt_out", [False, True])
def test_cuda_backward_lowering(monkeypatch, opt_out):
  """Exported for CUDA (no GPU needed): the backward lowers to the native kernel for a head dim it
  serves unless JAX_SGL_DISABLE names cuda_bwd; otherwise to the reference's vjp."""
  if opt_out:
    monkeypatch.setenv("JAX_SGL_DISABLE", "cuda_bwd")
  else:
    monkeypatch.delenv("JAX_SGL_DISABLE", raising=False)

  def exported_text(d):
    q, k, v = _dense(np.random.default_rng(18), 1, 5, 6, 2, 1, d, dtype=jnp.bfloat16)
    f = lambda q, k, v: jnp.sum(jax_sgl.attention(q, k, v, causal=True).astype(jnp.float32))
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)
      allow = [jax.export.DisabledSafetyCheck.custom_call(t)
               for t in ("jax_sgl_attention_fwd", "jax_sgl_attention_bwd")]
      return jax.export.export(jax.jit(jax.grad(f, argnums=(0, 1, 2))), platforms=["cuda"],
                               disabled_checks=allow)(q, k, v).mlir_module()

  native = "custom_call @jax_sgl_attention_bwd"
  assert (native in exported_text(64)) != opt_out
  # No CUDA backward above head dim 128 but the Hopper-only 192 / 256 (attention.py's gate).
  assert native not in exported_text(160)


def _find_eqn(jaxpr, name="jax_sgl_attention_bwd"):
  """The first equation of primitive `name` in a (nested) jaxpr."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name:
      return eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found = _find_eqn(sub, name)
      if found is not None:
        return found
  return None


def _padding_case(seed, head_dim, head_dim_v):
  """(the jax_sgl.attention module, rng, q, k, v, kw) of the zero-padding tests: GQA 4 / 2, causal
  with softcap, float32 on the CPU kernels."""
  import importlib
  # The module (the package's `attention` is the function).
  attn_mod = importlib.import_module("jax_sgl.attention")
  rng = np.random.default_rng(seed)
  q = _rand(rng, (2, 37, 4, head_dim), jnp.float32)
  k = _rand(rng, (2, 53, 2, head_dim), jnp.float32)
  v = _rand(rng, (2, 53, 2, head_dim_v), jnp.float32)
  return attn_mod, rng, q, k, v, {"causal": True, "softcap": 3.0}


@pytest.mark.parametrize("head_dim,head_dim_v", [(40, 24), (24, 40)])
def test_zero_padded_backward_is_the_backward(head_dim, head_dim_v):
  """attention._attention_bwd_padded (how CUDA runs head dims above 128 that Hopper's wide
  backward does not serve as they are) gives the gradients of the call itself: here on the CPU
  kernels, padding to 64 features."""
  attn_mod, rng, q, k, v, kw = _padding_case(5, head_dim, head_dim_v)
  loss = lambda q, k, v: jax_sgl.attention(q, k, v, **kw).sum()
  eqn = _find_eqn(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr)
  spec, present = eqn.params["spec"], eqn.params["present"]
  optional = [jnp.zeros(x.aval.shape, x.aval.dtype) for x in eqn.invars[3:-4]]
  out, lse = jax_sgl.attention(q, k, v, return_lse=True, **kw)
  dout, dlse = _rand(rng, out.shape, jnp.float32), _rand(rng, lse.shape, jnp.float32)
  args = (q, k, v, *optional, out, lse, dout, dlse)
  plain = jax.jit(lambda *a: attn_mod._attention_bwd_p.bind(*a, spec=spec, present=present))
  padded = dataclasses.replace(spec, head_dim=64, head_dim_v=64)
  via_pad = jax.jit(lambda *a: attn_mod._attention_bwd_padded(*a, spec=spec, present=present,
                                                              padded=padded))
  for name, a, b in zip("qkv", plain(*args), via_pad(*args)):
    assert a.shape == b.shape, name
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("head_dim,head_dim_v", [(40, 24), (24, 40)])
def test_zero_padded_forward_is_the_forward(head_dim, head_dim_v):
  """attention._attention_fwd_padded (how CUDA may run a prefill at head dims the sm90 forward
  lacks) gives the call's own out and lse: here on the CPU kernels, padding to 64 features."""
  attn_mod, _, q, k, v, kw = _padding_case(6, head_dim, head_dim_v)
  eqn = _find_eqn(jax.make_jaxpr(lambda q, k, v: jax_sgl.attention(q, k, v, **kw))(q, k, v).jaxpr,
                  "jax_sgl_attention_fwd")
  spec, present = eqn.params["spec"], eqn.params["present"]
  optional = [jnp.zeros(x.aval.shape, x.aval.dtype) for x in eqn.invars[3:]]
  want = jax_sgl.attention(q, k, v, return_lse=True, **kw)
  padded = dataclasses.replace(spec, head_dim=64, head_dim_v=64)
  got = jax.jit(lambda *a: attn_mod._attention_fwd_padded(*a, spec=spec, present=present,
                                                          padded=padded))(q, k, v, *optional)
  for name, a, b in zip(("out", "lse"), want, got):
    assert a.shape == b.shape, name
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-6, err_msg=name)
