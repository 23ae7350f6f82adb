"""Gradients on a Hopper GPU at head dims 96, 192 and 256, and varlen at every head dim: the sm90
backward's wide kernel (ffi/cuda/attention/sm90/bwd/wide_kernel.cuh: 64-key CTAs whose two
consumer warpgroups split the head dim) at 192 / 256, config.h's kernel (128-key CTAs) at 64 / 96
/ 128 (at 96 with 64- / 32-byte swizzle atoms), each with its varlen instantiation, and with deterministic=True the atomic-free dQ kernel (32-key tiles
above 128), checked by FlashAttention's rule against a float64 oracle (tests/grad_rule.py), with
NaN-poisoned gradient buffers. Skipped off compute capability 9.0 and where the build left the
(head dim, dtype) out.

Shapes are ragged: tails of the 64-row steps and 64- / 128-key blocks, keys shorter than queries (causal
rows that see no key), seqused_k, GQA groups of 1, 3, 4 and 8; masks: none, causal, sliding
window, softcap. Varlen (the kernel's kVarlen instantiation): packed q and k / v with rows
no sequence covers, sequences without queries or keys, lengths off the row / key block grid,
seqused_k, checked sequence by sequence against the oracle (grad_rule.check_varlen_grads), with
the reduced dQ and with deterministic=True (the dQ kernel's varlen instantiation: one CTA per
128-row block of all sequences, dQ stored row by row). Head dims above 128 that the wide kernel
does not serve as they are (160, 224, head_dim != head_dim_v) run it zero-padded, checked here
too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from attention_cases import require_sm90, turn_off_xla_autotuning
from grad_rule import bwd_kernel, check_grads, check_varlen_grads, dense_inputs, varlen_inputs

pytestmark = pytest.mark.gpu

turn_off_xla_autotuning()

HEAD_DIMS = (192, 256)
DENSE_HEAD_DIMS = (96,) + HEAD_DIMS
# Varlen: config.h's kernel's varlen instantiation at 64 / 96 / 128, the wide kernel's above.
VARLEN_HEAD_DIMS = (64, 96, 128) + HEAD_DIMS
DTYPES = (jnp.bfloat16, jnp.float16)
# (batch, seqlen_q, seqlen_k, num_heads, num_kv_heads): one row, ragged step / block tails, keys
# shorter than queries, several 64-key blocks and q steps per CTA.
SHAPES = [(3, 1, 300, 8, 1), (2, 19, 77, 6, 2), (1, 150, 130, 8, 2), (2, 333, 400, 4, 4)]
MASKS = {"none": {}, "causal": {"causal": True}, "window": {"window": (37, 4)},
         "softcap": {"softcap": 5.0, "causal": True}}


def _built(head_dim, dtype):
  built = jax_sgl.attention_backend_info()["kernels"].get("sm90_bwd", {})
  return head_dim in built.get("head_dims", ()) and jnp.dtype(dtype).name in built.get("dtypes", ())


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
  require_sm90(monkeypatch, "the wide sm90 backward")


def _need(head_dim, dtype):
  if not _built(head_dim, dtype):
    pytest.skip(f"sm90 backward hdim{head_dim} {jnp.dtype(dtype).name} not in this build")


@pytest.mark.parametrize("deterministic", [False, True], ids=["reduced_dq", "det_dq"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", DENSE_HEAD_DIMS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dense(shape, mask, head_dim, dtype, deterministic):
  _need(head_dim, dtype)
  q, k, v = dense_inputs(shape, head_dim, dtype, seed=head_dim + 3 * shape[1] + len(mask))
  kw = MASKS[mask]
  want = "sm90_bwd_dq_kernel" if deterministic else "sm90_bwd"
  assert bwd_kernel(q, k, v, {**kw, "deterministic": deterministic}) == ("bwd", want)
  check_grads(q, k, v, kw, deterministic=deterministic)


@pytest.mark.parametrize("deterministic", [False, True], ids=["reduced_dq", "det_dq"])
@pytest.mark.parametrize("head_dim", DENSE_HEAD_DIMS)
def test_seqused_k_and_lse_cotangent(head_dim, deterministic):
  """Ragged used keys (one empty sequence, one shorter than a key block) and a loss on lse."""
  _need(head_dim, jnp.bfloat16)
  q, k, v = dense_inputs((4, 150, 300, 8, 2), head_dim, jnp.bfloat16, seed=head_dim + 1)
  used = jnp.asarray([300, 0, 45, 211], jnp.int32)
  check_grads(q, k, v, {"seqused_k": used, "causal": True}, with_lse=True,
              deterministic=deterministic)
  check_grads(q, k, v, {"seqused_k": used, "window": (100, 20)}, deterministic=deterministic)


@pytest.mark.parametrize("head_dim", DENSE_HEAD_DIMS)
def test_sinks(head_dim):
  _need(head_dim, jnp.bfloat16)
  q, k, v = dense_inputs((2, 19, 300, 6, 2), head_dim, jnp.bfloat16, seed=head_dim + 2)
  sinks = jax.random.normal(jax.random.PRNGKey(5), (6,), jnp.float32)
  check_grads(q, k, v, {"causal": True, "sinks": sinks})


# Ragged sequences: one row, an empty q, a sequence without keys (its rows see none), tails of the
# 64- / 128-row steps and 64- / 128-key blocks, keys shorter than queries, exact multiples of 64.
Q_LENS = (1, 150, 0, 333, 64, 19)
K_LENS = (300, 130, 45, 400, 0, 77)


@pytest.mark.parametrize("deterministic", [False, True], ids=["reduced_dq", "det_dq"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", VARLEN_HEAD_DIMS)
@pytest.mark.parametrize("mask", MASKS)
def test_varlen(mask, head_dim, dtype, deterministic):
  _need(head_dim, dtype)
  q, k, v, kw = varlen_inputs(Q_LENS, K_LENS, (8, 2), head_dim, dtype, seed=head_dim + len(mask))
  kw = {**kw, **MASKS[mask]}
  want = "sm90_bwd_dq_kernel" if deterministic else "sm90_bwd"
  assert bwd_kernel(q, k, v, {**kw, "deterministic": deterministic}) == ("bwd", want)
  check_varlen_grads(q, k, v, kw, deterministic=deterministic)


@pytest.mark.parametrize("deterministic", [False, True], ids=["reduced_dq", "det_dq"])
@pytest.mark.parametrize("head_dim", VARLEN_HEAD_DIMS)
def test_varlen_seqused_k_sinks_and_lse_cotangent(head_dim, deterministic):
  _need(head_dim, jnp.bfloat16)
  q, k, v, kw = varlen_inputs(Q_LENS, K_LENS, (8, 1), head_dim, jnp.bfloat16, seed=head_dim + 5)
  used = jnp.asarray([250, 130, 45, 7, 0, 64], jnp.int32)
  check_varlen_grads(q, k, v, {**kw, "seqused_k": used, "causal": True}, with_lse=True,
                     deterministic=deterministic)
  sinks = jax.random.normal(jax.random.PRNGKey(6), (8,), jnp.float32)
  check_varlen_grads(q, k, v, {**kw, "sinks": sinks, "window": (100, 20)},
                     deterministic=deterministic)


@pytest.mark.parametrize("head_dim", (128, 256))
def test_varlen_many_sequences(head_dim):
  """Many sequences (the key-block scan over cu_seqlens_k, the convert's search over the padded
  workspace) and long ones (dq_accum sums over many key blocks), on both kernels."""
  _need(head_dim, jnp.bfloat16)
  rng = np.random.default_rng(3)
  q_lens = tuple(int(x) for x in rng.integers(0, 300, 40)) + (1500,)
  k_lens = tuple(int(x) for x in rng.integers(1, 300, 40)) + (1700,)
  q, k, v, kw = varlen_inputs(q_lens, k_lens, (4, 2), head_dim, jnp.bfloat16, seed=21)
  # Both dQ modes; deterministic=True: the dQ kernel's scan over cu_seqlens_q (row blocks of 128,
  # most sequences one partial block; the long one many).
  check_varlen_grads(q, k, v, {**kw, "causal": True}, deterministic=(False, True))


def test_long_sequence():
  """Many q steps per key block and many key blocks: dq_accum sums from every CTA."""
  _need(256, jnp.bfloat16)
  q, k, v = dense_inputs((1, 2048, 2048, 8, 2), 256, jnp.bfloat16, seed=9)
  check_grads(q, k, v, {"causal": True})


def test_dk_dv_are_bitwise_reproducible():
  """dK and dV are stored once per CTA, GQA heads summed in order: two runs agree bitwise (dQ
  comes from float reductions: close only)."""
  _need(256, jnp.bfloat16)
  q, k, v = dense_inputs((2, 700, 700, 8, 2), 256, jnp.bfloat16, seed=4)
  fn = jax.jit(jax.grad(lambda q, k, v: jax_sgl.attention(q, k, v, causal=True)
                        .astype(jnp.float32).sum(), argnums=(0, 1, 2)))
  first, second = [[np.asarray(x) for x in fn(q, k, v)] for _ in range(2)]
  for name, a, b in zip("kv", first[1:], second[1:]):
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=f"d{name}")
  a, b = first[0].astype(np.float32), second[0].astype(np.float32)
  assert np.max(np.abs(a - b)) <= 1e-2 * np.max(np.abs(a)), "dq differs between runs"


def _assert_bitwise_reproducible(fn, *args):
  first, second = [[np.asarray(x) for x in fn(*args)] for _ in range(2)]
  for name, a, b in zip("qkv", first, second):
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=f"d{name}")


@pytest.mark.parametrize("head_dim", DENSE_HEAD_DIMS)
def test_deterministic_dq_is_bitwise_reproducible(head_dim):
  """deterministic=True: dQ from the atomic-free dQ kernel, one CTA per row block summing its key
  tiles in order: two runs agree bitwise in all three gradients."""
  _need(head_dim, jnp.bfloat16)
  q, k, v = dense_inputs((2, 700, 900, 8, 2), head_dim, jnp.bfloat16, seed=head_dim + 11)
  fn = jax.jit(jax.grad(lambda q, k, v: jax_sgl.attention(q, k, v, causal=True,
                                                          deterministic=True)
                        .astype(jnp.float32).sum(), argnums=(0, 1, 2)))
  _assert_bitwise_reproducible(fn, q, k, v)


@pytest.mark.parametrize("head_dim", VARLEN_HEAD_DIMS)
def test_varlen_deterministic_dq_is_bitwise_reproducible(head_dim):
  """The same with varlen: the dQ kernel's varlen instantiation."""
  _need(head_dim, jnp.bfloat16)
  q, k, v, kw = varlen_inputs((700, 0, 129, 1, 450), (900, 33, 0, 300, 450), (8, 2), head_dim,
                              jnp.bfloat16, seed=head_dim + 12)
  fn = jax.jit(jax.grad(lambda q, k, v: jax_sgl.attention(q, k, v, causal=True,
                                                          deterministic=True, **kw)
                        .astype(jnp.float32).sum(), argnums=(0, 1, 2)))
  _assert_bitwise_reproducible(fn, q, k, v)


@pytest.mark.parametrize("head_dim,head_dim_v,padded",
                         [(160, 160, 192), (192, 128, 192), (224, 224, 256), (256, 128, 256)])
def test_other_head_dims_run_zero_padded(head_dim, head_dim_v, padded):
  """Head dims above 128 the wide kernel does not serve as they are (between its head dims, or
  head_dim != head_dim_v) run it zero-padded to `padded` (attention.padded_wide_bwd_spec):
  native, and right by the rule, dense and varlen, with the reduced and the deterministic dQ."""
  _need(padded, jnp.bfloat16)
  q, k, v = dense_inputs((2, 150, 200, 8, 2), head_dim, jnp.bfloat16, seed=head_dim + 13)
  v = dense_inputs((2, 150, 200, 8, 2), head_dim_v, jnp.bfloat16, seed=head_dim_v + 14)[2]
  for kw in ({"causal": True}, {"window": (37, 4), "deterministic": True}):
    det = kw.pop("deterministic", False)
    want = "sm90_bwd_dq_kernel" if det else "sm90_bwd"
    assert bwd_kernel(q, k, v, {**kw, "deterministic": det}) == ("bwd", want)
    check_grads(q, k, v, kw, deterministic=det)
  q, k, _, kw = varlen_inputs(Q_LENS, K_LENS, (8, 2), head_dim, jnp.bfloat16, seed=head_dim + 15)
  v = varlen_inputs(Q_LENS, K_LENS, (8, 2), head_dim_v, jnp.bfloat16, seed=head_dim + 16)[2]
  check_varlen_grads(q, k, v, {**kw, "causal": True})
