"""Gradients of jax_sgl.attention through the sm_100a backward (CUTLASS's Blackwell FMHA backward
collective, ffi/cuda/attention/sm100/bwd/) on a compute capability 10.x GPU; skipped elsewhere
(the `blackwell` marker, tests/conftest.py). The kernel is compiled and SASS-checked in this
repository but has not yet run on Blackwell: these tests are what its first run on a B200 checks.

FlashAttention's rule on fresh random inputs: each of dQ / dK / dV from the kernel is within 3x
(plus a small floor) of the error that jax.grad of the pure-JAX reference makes in the input
precision, both measured against a float64 oracle (the same reference under x64). Shapes are
ragged (1, 19, 150, 989 rows; keys shorter than queries, so causal rows that see no key), GQA
groups of 1, 3 and 8, causal bottom-right and none, with a loss on the LSE too (dlse) and with
sinks (the saved LSE includes the sink). Calls the sm100 backward does not cover (deterministic,
window, softcap, varlen) run on the portable backward: checked too, so a Blackwell run covers the
whole dispatch. Gradient buffers are poisoned with NaN first, so an unwritten element fails.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from attention_cases import poison_allocator, reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.blackwell]

if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_gpu_autotune_level=0").strip()

DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128)
# (batch, seqlen_q, seqlen_k, num_heads, num_kv_heads): decode-like, ragged tails of the 128-row
# tiles, keys shorter than queries, MQA / GQA 3 / GQA 4 / MHA.
SHAPES = [(3, 1, 300, 8, 1), (2, 19, 77, 6, 2), (1, 150, 130, 8, 2), (2, 989, 1000, 4, 4)]
# The kernel's error may be 3x the reference's in the input precision, plus a floor for entries
# that both round the same way (relative to the largest oracle entry).
FACTOR, FLOOR = 3.0, 2e-3


def _rand(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _inputs(shape, head_dim, dtype, seed):
  b, sq, sk, h, hkv = shape
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (_rand(keys[0], (b, sq, h, head_dim), dtype), _rand(keys[1], (b, sk, hkv, head_dim), dtype),
          _rand(keys[2], (b, sk, hkv, head_dim), dtype))


def _loss(attn, w_out, w_lse):
  def loss(q, k, v):
    out, lse = attn(q, k, v)
    total = jnp.sum(out.astype(w_out.dtype) * w_out)
    if w_lse is not None:   # rows that see no key have lse = -inf: leave them out
      total += jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0).astype(w_lse.dtype) * w_lse)
    return total
  return loss


def _reference_grads(q, k, v, kw, w_out, w_lse):
  fn = _loss(lambda q, k, v: reference_attention(q, k, v, return_lse=True, **kw), w_out, w_lse)
  return jax.jit(jax.grad(fn, argnums=(0, 1, 2)))(q, k, v)


def _oracle_attention(q, k, v, causal, sinks):
  """Dense attention in float64 (bottom-right causal, GQA, sinks joining the denominator
  unscaled), independent of reference.py, which computes in float32. Returns (out, lse [B, H, Sq]);
  a row that sees no key gives out 0 and lse -inf."""
  _, sq, h, d = q.shape
  sk, group = k.shape[1], h // k.shape[2]
  kk, vv = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(d)
  if causal:
    s = jnp.where(jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + sk - sq, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  if sinks is not None:
    m = jnp.maximum(m, sinks[None, :, None, None])
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.exp(s - m)
  z = jnp.sum(e, axis=-1, keepdims=True)
  if sinks is not None:
    z = z + jnp.exp(sinks[None, :, None, None] - m)
  covered = z > 0
  z_safe = jnp.where(covered, z, 1.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", e / z_safe, vv)
  lse = jnp.where(covered, jnp.log(z_safe) + m, -jnp.inf)[..., 0]
  return out, lse


def _oracle_grads(q, k, v, kw, w_out, w_lse):
  with jax.enable_x64(True):
    f64 = [jnp.asarray(np.asarray(x.astype(jnp.float32)), jnp.float64) for x in (q, k, v)]
    sinks = kw.get("sinks")
    sinks = None if sinks is None else jnp.asarray(np.asarray(sinks), jnp.float64)
    attn = lambda q, k, v: _oracle_attention(q, k, v, kw.get("causal", False), sinks)
    w_lse = None if w_lse is None else jnp.asarray(w_lse)
    grads = jax.grad(_loss(attn, jnp.asarray(w_out), w_lse), argnums=(0, 1, 2))(*f64)
    return [np.asarray(g) for g in grads]


def _check(q, k, v, kw, *, with_lse=False, deterministic=False):
  rng = np.random.default_rng(7)
  w_out = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
  w_lse = rng.standard_normal((q.shape[0], q.shape[2], q.shape[1])) if with_lse else None
  oracle_kw = {n: x for n, x in kw.items() if n in ("causal", "sinks")}
  want = _oracle_grads(q, k, v, oracle_kw, w_out, w_lse) if len(oracle_kw) == len(kw) else None
  w_out32 = jnp.asarray(w_out, jnp.float32)
  w_lse32 = None if w_lse is None else jnp.asarray(w_lse, jnp.float32)
  low = _reference_grads(q, k, v, kw, w_out32, w_lse32)   # the same math in the input dtype
  if want is None:   # masks the float64 oracle lacks (window, softcap): the float32 reference
    with jax.default_matmul_precision("highest"):
      want = [np.asarray(g, np.float64) for g in _reference_grads(
          *(x.astype(jnp.float32) for x in (q, k, v)), kw, w_out32, w_lse32)]
  poison_allocator(sum(x.size * x.dtype.itemsize for x in (q, k, v)))
  fn = _loss(lambda q, k, v: jax_sgl.attention(q, k, v, return_lse=True,
                                               deterministic=deterministic, **kw), w_out32, w_lse32)
  got = jax.jit(jax.grad(fn, argnums=(0, 1, 2)))(q, k, v)
  for name, x, g, lo, r in zip("qkv", (q, k, v), got, low, want):
    assert g.shape == x.shape and g.dtype == x.dtype, name
    g = np.asarray(g.astype(jnp.float32), np.float64)
    lo = np.asarray(lo.astype(jnp.float32), np.float64)
    assert np.isfinite(g).all(), f"d{name}: unwritten (NaN) or non-finite elements"
    scale = max(float(np.max(np.abs(r))), 1e-6)
    err = float(np.max(np.abs(g - r))) / scale
    ref_err = float(np.max(np.abs(lo - r))) / scale
    assert err <= FACTOR * ref_err + FLOOR, (
        f"d{name}: error {err:.3g} > {FACTOR:g} x the reference's {ref_err:.3g} + {FLOOR:g}")


def _bwd_kernel(q, k, v, kw):
  """The backward kernel the dispatch picks for this device (jax_sgl/_plan.py)."""
  from jax_sgl._plan import cuda_attention_kernels
  cc = tuple(int(x) for x in jax.devices("cuda")[0].compute_capability.split("."))
  loss = lambda q, k, v: jax_sgl.attention(q, k, v, **kw).astype(jnp.float32).sum()
  return cuda_attention_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, k, v,
                                compute_capability=cc)[-1]


def test_sm100_backward_is_built():
  built = jax_sgl.attention_backend_info()["kernels"].get("sm100_bwd", {})
  assert 128 in built.get("head_dims", ()), f"no sm100 backward in this build: {built}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_dense(shape, causal, head_dim, dtype):
  q, k, v = _inputs(shape, head_dim, dtype, seed=head_dim + 2 * shape[1] + causal)
  built = jax_sgl.attention_backend_info()["kernels"].get("sm100_bwd", {})
  if head_dim in built.get("head_dims", ()) and jnp.dtype(dtype).name in built.get("dtypes", ()):
    # A 10.0 device runs these on the sm100 backward (10.x others: the portable one).
    if jax.devices("cuda")[0].compute_capability == "10.0":
      assert _bwd_kernel(q, k, v, {"causal": causal}) == ("bwd", "sm100_bwd")
  _check(q, k, v, {"causal": causal})


@pytest.mark.parametrize("causal", [False, True])
def test_lse_cotangent(causal):
  q, k, v = _inputs((2, 150, 70, 8, 2), 128, jnp.bfloat16, seed=11)
  _check(q, k, v, {"causal": causal}, with_lse=True)


def test_sinks():
  q, k, v = _inputs((2, 19, 300, 6, 2), 128, jnp.bfloat16, seed=12)
  sinks = jax.random.normal(jax.random.PRNGKey(5), (6,), jnp.float32)
  _check(q, k, v, {"causal": True, "sinks": sinks})


# Calls the sm100 backward leaves to the portable one (Sm100BwdUnsupported): still correct.
@pytest.mark.parametrize("kw", [{"window": (37, 4)}, {"softcap": 5.0, "causal": True},
                                {"deterministic": True}], ids=["window", "softcap", "deterministic"])
def test_fallbacks(kw):
  kw = dict(kw)
  deterministic = kw.pop("deterministic", False)
  q, k, v = _inputs((2, 150, 200, 8, 2), 128, jnp.bfloat16, seed=13)
  assert _bwd_kernel(q, k, v, dict(kw, deterministic=deterministic)) == ("bwd", "portable_bwd")
  _check(q, k, v, kw, deterministic=deterministic)
