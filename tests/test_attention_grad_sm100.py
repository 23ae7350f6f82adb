"""Gradients of jax_sgl.attention through the sm_100a backward (CUTLASS's Blackwell FMHA backward
collective, ffi/cuda/attention/sm100/bwd/) on a compute capability 10.x GPU; skipped elsewhere
(the `blackwell` marker, tests/conftest.py). The kernel is compiled and SASS-checked in this
repository but has not yet run on Blackwell: these tests are what its first run on a B200 checks.

FlashAttention's rule on fresh random inputs (tests/grad_rule.py): each of dQ / dK / dV from the
kernel is within 3x (plus a small floor) of the error that jax.grad of the pure-JAX reference
makes in the input precision, both measured against a float64 oracle. Shapes are
ragged (1, 19, 150, 989 rows; keys shorter than queries, so causal rows that see no key), GQA
groups of 1, 3 and 8, causal bottom-right and none, with a loss on the LSE too (dlse) and with
sinks (the saved LSE includes the sink). Calls the sm100 backward does not cover (deterministic,
window, softcap, varlen) run on the portable backward: checked too, so a Blackwell run covers the
whole dispatch. Gradient buffers are poisoned with NaN first, so an unwritten element fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jax_sgl
from attention_cases import turn_off_xla_autotuning
from grad_rule import bwd_kernel as _bwd_kernel
from grad_rule import check_grads as _check
from grad_rule import dense_inputs as _inputs

pytestmark = [pytest.mark.gpu, pytest.mark.blackwell]

turn_off_xla_autotuning()

DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128)
# (batch, seqlen_q, seqlen_k, num_heads, num_kv_heads): decode-like, ragged tails of the 128-row
# tiles, keys shorter than queries, MQA / GQA 3 / GQA 4 / MHA.
SHAPES = [(3, 1, 300, 8, 1), (2, 19, 77, 6, 2), (1, 150, 130, 8, 2), (2, 989, 1000, 4, 4)]


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
