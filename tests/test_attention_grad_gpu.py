"""Gradients of jax_sgl.attention through the CUDA backward kernel (the default on CUDA) against
jax.grad of the pure-JAX reference (float32 oracle) on fresh random inputs.

The matrix: layout (dense with seqused_k, varlen with uncovered rows) x mask (none, causal,
window, softcap) x head dim (64, 96, 128) x dtype (bfloat16, float16), with the GQA ratio varying
with the mask and ragged lengths that span several 128-key blocks, an empty sequence and KV
shorter than q. Then: other head dims (zero-padded onto a capacity, d_v != d), a loss on lse,
long sequences, determinism (bitwise-equal gradients from two runs), that the native kernel is
what actually runs, and that unsupported head dims fall back to the reference lowering.

Every test runs twice, once per CUDA backward: "sm80" (JAX_SGL_DISABLE=sm90_bwd: the portable
mma.sync kernels) and "sm90" (the default: the Hopper wgmma + TMA kernel wherever it covers the call,
i.e. dense layouts (seqused_k, causal, sliding windows and softcap included) at head dims 64, 96
and 128 with head_dim == head_dim_v, and varlen there on the kernel's varlen instantiation;
every other case checks the explicit fallback to the sm80 kernels). The sm90 runs are skipped off
compute capability 9.0. test_dense (below) adds dense shapes, mostly without seqused_k, and runs
the sm90 backward's deterministic dQ kernel (deterministic=True) too.

Every gradient is taken under a fresh jax.jit, so the JAX_SGL_DISABLE setting (read when the
backward is lowered) applies to it. Gradient buffers are poisoned (NaN left in the allocator) before each call,
so an element the kernels forget to write shows up as NaN.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from attention_cases import (DENSE_SHAPES, is_sm90_device, matrix_case, padded_dense_case,
                             parametrize_matrix, poison_allocator, random_normal,
                             reference_attention, turn_off_xla_autotuning)

pytestmark = pytest.mark.gpu

turn_off_xla_autotuning()

LAYOUTS = ("dense", "varlen")
HEAD_DIMS = (64, 96, 128)
DTYPES = (jnp.bfloat16, jnp.float16)
MASK_KW = {"none": {}, "causal": {"causal": True}, "window": {"window": (37, 4)},
           "softcap": {"softcap": 5.0, "causal": True}}
# Max abs error of a gradient relative to the largest reference entry. Beyond the rounding of
# out, dout and the gradients (the CPU backward's budget: 2e-3 / 1.5e-2), the kernel rounds P and
# dS to the input dtype for the tensor cores, as FlashAttention does.
TOL = {jnp.dtype(jnp.bfloat16): 3e-2, jnp.dtype(jnp.float16): 5e-3}

# Ragged batch: an empty sequence, KV shorter than q (rows that see no key), and a sequence of
# more than two 128-key blocks.
Q_LENS = (5, 0, 150, 19)
K_LENS = (70, 9, 140, 300)


@pytest.fixture(autouse=True, params=["sm80", "sm90"])
def bwd_kernel(request, monkeypatch):
  """Which CUDA backward serves the covered calls of the test (see the module docstring):
  "sm80" or "sm90"."""
  sm90 = request.param == "sm90"
  if sm90:
    if not is_sm90_device():
      pytest.skip("the sm90 backward needs a compute capability 9.0 device")
    if not _sm90_bwd_built(128, jnp.bfloat16):
      pytest.skip("this build has no sm90 backward (JAX_SGL_SM90_HEAD_DIMS)")
    monkeypatch.delenv("JAX_SGL_DISABLE", raising=False)
  else:
    monkeypatch.setenv("JAX_SGL_DISABLE", "sm90_bwd")
  return "sm90" if sm90 else "sm80"


def _sm90_bwd_built(head_dim, dtype):
  built = jax_sgl.attention_backend_info()["kernels"].get("sm90_bwd", {})
  return head_dim in built.get("head_dims", ()) and jnp.dtype(dtype).name in built.get("dtypes", ())


def _need_sm90_bwd(bwd_kernel, head_dim, dtype):
  """Skips an sm90 run whose (head dim, dtype) this build left out: it would test sm80 again."""
  if bwd_kernel == "sm90" and not _sm90_bwd_built(head_dim, dtype):
    pytest.skip(f"sm90 backward hdim{head_dim} {jnp.dtype(dtype).name} not in this build")


def _deterministic(bwd_kernel, dq):
  """The `deterministic` argument of a dq = "atomic" / "det" run; "det" only changes sm90."""
  if dq == "det" and bwd_kernel == "sm80":
    pytest.skip("deterministic=True only changes the sm90 backward")
  return dq == "det"


def _make_case(layout, head_dim, head_dim_v, heads, dtype, seed, q_lens=Q_LENS, k_lens=K_LENS):
  """Returns (q, k, v, kwargs) for one layout over the ragged batch."""
  num_heads, num_kv_heads = heads
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  if layout == "dense":
    return padded_dense_case(keys, q_lens, k_lens, heads, head_dim, head_dim_v, dtype)
  # Packed q and k/v with 3 trailing rows no sequence covers (their gradients must be 0).
  cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
  q = random_normal(keys[0], (int(cu_q[-1]) + 3, num_heads, head_dim), dtype)
  k = random_normal(keys[1], (int(cu_k[-1]) + 3, num_kv_heads, head_dim), dtype)
  v = random_normal(keys[2], (int(cu_k[-1]) + 3, num_kv_heads, head_dim_v), dtype)
  return q, k, v, {"cu_seqlens_q": jnp.asarray(cu_q), "cu_seqlens_k": jnp.asarray(cu_k)}


# (out, lse) of the float32 reference, with the public function's argument conventions.
_reference = functools.partial(reference_attention, return_lse=True)


def _loss(attn, w_out, w_lse=None):
  """A scalar loss whose gradient has random dout (and dlse when w_lse is given)."""
  def loss(q, k, v):
    out, lse = attn(q, k, v)
    total = jnp.sum(out.astype(jnp.float32) * w_out)
    if w_lse is not None:   # fully masked rows have lse = -inf: leave them out of the loss
      total += jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)
    return total
  return loss


def _grads(q, k, v, kw, w_out, w_lse=None, deterministic=False):
  """Our gradients, under a fresh jit (so the backward is lowered with the current env)."""
  fn = _loss(lambda q, k, v: jax_sgl.attention(q, k, v, return_lse=True,
                                               deterministic=deterministic, **kw), w_out, w_lse)
  return jax.jit(jax.grad(fn, argnums=(0, 1, 2)))(q, k, v)


def _check(q, k, v, kw, *, with_lse=False, deterministic=False):
  rng = np.random.default_rng(1)
  w_out = jnp.asarray(rng.standard_normal(q.shape[:-1] + (v.shape[-1],)), jnp.float32)
  w_lse = None
  if with_lse:
    lse_shape = jax.eval_shape(lambda: _reference(q, k, v, **kw)[1]).shape
    w_lse = jnp.asarray(rng.standard_normal(lse_shape), jnp.float32)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  with jax.default_matmul_precision("highest"):   # a float32 oracle, not TF32
    want = jax.jit(jax.grad(_loss(lambda q, k, v: _reference(q, k, v, **kw), w_out, w_lse),
                            argnums=(0, 1, 2)))(*f32)
  poison_allocator(sum(x.size * x.dtype.itemsize for x in (q, k, v)))
  got = _grads(q, k, v, kw, w_out, w_lse, deterministic)
  tol = TOL[jnp.dtype(q.dtype)]
  for name, x, g, r in zip("qkv", (q, k, v), got, want):
    assert g.shape == x.shape and g.dtype == x.dtype, name
    g = np.asarray(g.astype(jnp.float32))
    r = np.asarray(r)
    assert np.isfinite(g).all(), f"d{name}: unwritten (NaN) or non-finite elements"
    scale = max(float(np.max(np.abs(r))), 1e-6)
    err = float(np.max(np.abs(g - r))) / scale
    assert err <= tol, f"d{name}: relative error {err:.3g} > {tol:g}"


BWD_CALL = "custom_call @jax_sgl_attention_bwd"  # how StableHLO prints the native backward


def _lowered_text(q, k, v, kw):
  w_out = jnp.ones(q.shape[:-1] + (v.shape[-1],), jnp.float32)
  fn = _loss(lambda q, k, v: jax_sgl.attention(q, k, v, return_lse=True, **kw), w_out)
  return jax.jit(jax.grad(fn, argnums=(0, 1, 2))).lower(q, k, v).as_text()


def test_native_kernel_is_used_unless_opted_out(monkeypatch):
  """The matrix below tests the kernel, not the reference lowering: by default the backward
  lowers to the jax_sgl_attention_bwd custom call, with JAX_SGL_DISABLE=cuda_bwd to the
  reference."""
  assert "jax_sgl_attention_bwd" in jax_sgl.CUDA_TARGETS
  q, k, v, kw = _make_case("dense", 64, 64, (4, 2), jnp.bfloat16, 0)
  assert BWD_CALL in _lowered_text(q, k, v, kw)
  monkeypatch.setenv("JAX_SGL_DISABLE", "cuda_bwd")
  assert BWD_CALL not in _lowered_text(q, k, v, kw)


@parametrize_matrix(LAYOUTS, HEAD_DIMS)
def test_matrix(layout, mask, head_dim, dtype):
  q, k, v, kw = matrix_case(_make_case, layout, mask, head_dim, dtype)
  _check(q, k, v, {**kw, **MASK_KW[mask]})


@pytest.mark.parametrize("head_dim,head_dim_v", [(80, 80), (40, 24), (64, 128), (128, 96)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_other_head_dims(layout, head_dim, head_dim_v):
  """Head dims without their own kernel run zero-padded on the next capacity; d_v != d too."""
  q, k, v, kw = _make_case(layout, head_dim, head_dim_v, (4, 2), jnp.bfloat16, head_dim)
  _check(q, k, v, {**kw, "causal": True})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", ["causal", "softcap"])
def test_lse_cotangent(layout, mask):
  """A loss on lse as well as out: dlse enters through D = rowsum(dO * O) - dlse."""
  q, k, v, kw = _make_case(layout, 128, 128, (4, 1), jnp.float16, 7)
  _check(q, k, v, {**kw, **MASK_KW[mask]}, with_lse=True)


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_long_sequences(mask):
  """Many key blocks per q row and many q steps per key block, KV longer than q."""
  keys = jax.random.split(jax.random.PRNGKey(3), 3)
  q = random_normal(keys[0], (2, 1029, 4, 128), jnp.bfloat16)
  k = random_normal(keys[1], (2, 1100, 2, 128), jnp.bfloat16)
  v = random_normal(keys[2], (2, 1100, 2, 128), jnp.bfloat16)
  _check(q, k, v, {"none": {}, "causal": {"causal": True},
                   "window": {"window": (300, 17)}}[mask])


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dq_many_steps(causal, head_dim):
  """dQ summed over 16 key blocks, each CTA running 4 q heads x up to 32 row blocks: every
  step adds a dQ part into the float32 accumulator, so a lost or doubled part, or a step-order
  slip, shows up here as a wrong dQ (or a hang)."""
  keys = jax.random.split(jax.random.PRNGKey(5 + head_dim), 3)
  q = random_normal(keys[0], (1, 2048, 4, head_dim), jnp.bfloat16)
  k = random_normal(keys[1], (1, 2048, 1, head_dim), jnp.bfloat16)
  v = random_normal(keys[2], (1, 2048, 1, head_dim), jnp.bfloat16)
  _check(q, k, v, {"causal": causal})


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "default"])
def test_deterministic(bwd_kernel, deterministic):
  """Two runs give bitwise-equal gradients: always on sm80 (no atomics anywhere), on sm90 with
  deterministic=True (dQ by the atomic-free sm90 dQ kernel), whose dQ agrees with the default's
  within tolerance. The sm90 default adds dQ with float atomics: dK and dV stay bitwise equal, dQ
  only close."""
  if deterministic and bwd_kernel == "sm80":
    pytest.skip("deterministic=True only changes the sm90 backward")
  exact_dq = deterministic or bwd_kernel == "sm80"
  keys = jax.random.split(jax.random.PRNGKey(5), 4)
  q = random_normal(keys[0], (2, 700, 8, 128), jnp.bfloat16)
  k = random_normal(keys[1], (2, 700, 2, 128), jnp.bfloat16)
  v = random_normal(keys[2], (2, 700, 2, 128), jnp.bfloat16)
  w = jax.random.normal(keys[3], q.shape, jnp.float32)

  def grad_fn(det):
    return jax.jit(jax.grad(_loss(lambda q, k, v: jax_sgl.attention(
        q, k, v, return_lse=True, causal=True, deterministic=det), w), argnums=(0, 1, 2)))

  fn = grad_fn(deterministic)
  first = [np.asarray(x) for x in fn(q, k, v)]
  second = [np.asarray(x) for x in fn(q, k, v)]
  for name, a, b in zip("qkv", first, second):
    if name == "q" and not exact_dq:
      a, b = a.astype(np.float32), b.astype(np.float32)
      assert np.max(np.abs(a - b)) <= 1e-2 * np.max(np.abs(a)), "dq differs between runs"
    else:
      np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=f"d{name}")
  if deterministic:
    default = [np.asarray(x).astype(np.float32) for x in grad_fn(False)(q, k, v)]
    for name, a, b in zip("qkv", first, default):
      a = a.astype(np.float32)
      err = np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-6)
      assert err <= TOL[jnp.dtype(jnp.bfloat16)], f"d{name}: deterministic vs default {err:.3g}"


def test_head_dim_160_lowering(bwd_kernel):
  """Head dims above 128 other than 192 / 256: the sm90 wide backward serves them zero-padded
  (test_attention_grad_wide_gpu.py checks its gradients at every such dim); without it (the sm80
  run) they lower to the reference, still correct."""
  q, k, v, kw = _make_case("dense", 160, 160, (4, 2), jnp.bfloat16, 11, q_lens=(9, 20),
                           k_lens=(30, 17))
  native = bwd_kernel == "sm90" and _sm90_bwd_built(192, jnp.bfloat16)
  assert (BWD_CALL in _lowered_text(q, k, v, kw)) == native
  _check(q, k, v, {**kw, "causal": True})


# Dense calls, mostly without seqused_k (the common training layout): attention_cases'
# DENSE_SHAPES, then MQA with a single query row, and seqused_k.
SHAPES = {
    **DENSE_SHAPES,
    "one_row": (4, 1, 257, 8, 1),
    "seqused": (3, 150, 300, 8, 2),
}
# seqused_k of the shapes that pass one: keys past it are masked (rows that see no key included).
SEQUSED_K = {"seqused": (70, 9, 261)}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dq", ["atomic", "det"])
def test_dense(bwd_kernel, dq, shape, causal, head_dim, dtype):
  """dq: the sm90 backward's dQ by float32 reductions (default) or by its deterministic dQ
  kernel (deterministic=True)."""
  _need_sm90_bwd(bwd_kernel, head_dim, dtype)
  deterministic = _deterministic(bwd_kernel, dq)
  batch, sq, sk, h, hkv = SHAPES[shape]
  keys = jax.random.split(jax.random.PRNGKey(zlib.crc32(shape.encode()) % 1000), 3)
  q = random_normal(keys[0], (batch, sq, h, head_dim), dtype)
  k = random_normal(keys[1], (batch, sk, hkv, head_dim), dtype)
  v = random_normal(keys[2], (batch, sk, hkv, head_dim), dtype)
  kw = {"causal": causal}
  if shape in SEQUSED_K:
    kw["seqused_k"] = jnp.asarray(SEQUSED_K[shape], jnp.int32)
  _check(q, k, v, kw, deterministic=deterministic)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dq", ["atomic", "det"])
def test_dense_lse_cotangent(bwd_kernel, dq, causal):
  """dlse through the sm90 kernels' D values (padded row blocks: seqlen_q = 200)."""
  deterministic = _deterministic(bwd_kernel, dq)
  keys = jax.random.split(jax.random.PRNGKey(8), 3)
  q = random_normal(keys[0], (2, 200, 8, 128), jnp.bfloat16)
  k = random_normal(keys[1], (2, 260, 2, 128), jnp.bfloat16)
  v = random_normal(keys[2], (2, 260, 2, 128), jnp.bfloat16)
  _check(q, k, v, {"causal": causal}, with_lse=True, deterministic=deterministic)


# Sliding windows (left, right) on the sm90 kernels' geometry: left only, both sides, causal with a
# left bound, a window wider than the keys.
WINDOWS = {"left": ((50, -1), False), "both": ((37, 4), False), "causal_left": ((100, 0), True),
           "wide": ((5000, 3000), False)}


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("shape", ["square", "q_short", "k_short"])
@pytest.mark.parametrize("dq", ["atomic", "det"])
def test_dense_window(bwd_kernel, dq, shape, window):
  deterministic = _deterministic(bwd_kernel, dq)
  batch, sq, sk, h, hkv = SHAPES[shape]
  keys = jax.random.split(jax.random.PRNGKey(zlib.crc32((shape + window).encode()) % 1000), 3)
  q = random_normal(keys[0], (batch, sq, h, 128), jnp.bfloat16)
  k = random_normal(keys[1], (batch, sk, hkv, 128), jnp.bfloat16)
  v = random_normal(keys[2], (batch, sk, hkv, 128), jnp.bfloat16)
  win, causal = WINDOWS[window]
  _check(q, k, v, {"window": win, "causal": causal}, deterministic=deterministic)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", ["square", "k_short"])
@pytest.mark.parametrize("dq", ["atomic", "det"])
def test_dense_softcap(bwd_kernel, dq, shape, causal):
  """Softcap on the sm90 kernels: P and dS from one pass with the tanh derivative."""
  deterministic = _deterministic(bwd_kernel, dq)
  batch, sq, sk, h, hkv = SHAPES[shape]
  keys = jax.random.split(jax.random.PRNGKey(zlib.crc32(shape.encode()) % 1000 + 1), 3)
  q = random_normal(keys[0], (batch, sq, h, 128), jnp.bfloat16)
  k = random_normal(keys[1], (batch, sk, hkv, 128), jnp.bfloat16)
  v = random_normal(keys[2], (batch, sk, hkv, 128), jnp.bfloat16)
  _check(q, k, v, {"softcap": 5.0, "causal": causal}, deterministic=deterministic)


def _bwd_tail_shape(case):
  """(batch, seqlen_q, seqlen_k, heads, kv heads) whose 128-key blocks number just past a whole
  wave of the device's SMs, so that the sm90 backward's tail split runs: 'few' leaves 1-2 blocks
  over, 'many' up to 8; 'short' is 16 blocks in all, every one split. Each block has 6-24 steps
  (q heads of its group x row blocks of 128 rows at hd64, 64 at hd128)."""
  sms = getattr(jax.devices()[0], "core_count", None) or 132
  if case == "short":
    return (1, 700, 2000, 8, 1)
  if case == "few":
    blocks = -(-(sms + 1) // 2)  # x 2 kv heads
    return (1, 300, 128 * blocks - 40, 4, 2)
  blocks = -(-(sms + 1) // 8)  # x 4 kv heads x 2 sequences
  return (2, 700, 128 * blocks - 5, 8, 4)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", ["few", "many", "short"])
@pytest.mark.parametrize("dq", ["atomic", "det"])
def test_tail_split(bwd_kernel, dq, case, head_dim):
  """The tail split (calls without mask, window, seqused_k or softcap): the key blocks of the
  last partial wave run as shares of their steps on all SMs, and a second kernel adds their dK and
  dV. Right against the reference, and dK / dV bitwise repeatable."""
  if bwd_kernel != "sm90":
    pytest.skip("the tail split is the sm90 backward's")
  _need_sm90_bwd(bwd_kernel, head_dim, jnp.bfloat16)
  deterministic = _deterministic(bwd_kernel, dq)
  batch, sq, sk, h, hkv = _bwd_tail_shape(case)
  keys = jax.random.split(jax.random.PRNGKey(31 + head_dim + len(case)), 3)
  q = random_normal(keys[0], (batch, sq, h, head_dim), jnp.bfloat16)
  k = random_normal(keys[1], (batch, sk, hkv, head_dim), jnp.bfloat16)
  v = random_normal(keys[2], (batch, sk, hkv, head_dim), jnp.bfloat16)
  _check(q, k, v, {}, deterministic=deterministic)
  w_out = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)
  first = _grads(q, k, v, {}, w_out, deterministic=deterministic)
  poison_allocator(sum(x.size * x.dtype.itemsize for x in (q, k, v)))
  again = _grads(q, k, v, {}, w_out, deterministic=deterministic)
  for name, a, b in zip("kv", first[1:], again[1:]):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16),
                                  err_msg=f"d{name}")
