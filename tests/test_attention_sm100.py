"""The Blackwell (sm_100a) flash forward, on CUTLASS's FMHA collectives, against the pure-JAX
reference and a float64 oracle.

Marked `blackwell`: these run on a compute-capability-10 device and are skipped elsewhere (the
kernel was compiled here, never run: benchmarks/notes/NOTES_sm100.md). Every built instantiation
runs by default on compute capability 10.0 (JAX_SGL_DISABLE=sm100 turns it off; every test clears
it through monkeypatch). What the kernel does not cover (sliding window, softcap, seqused_k,
varlen causal, causal with q longer than k) runs on the portable kernel: those cases check that
fallback. Sinks run on it (a pass over the finished rows). Outputs are poisoned beforehand so unwritten elements show up as NaN; besides the
reference's tolerance, the error against the float64 oracle stays within 2x that of the same math
done in the input precision (FlashAttention's rule).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from attention_cases import (check_kernel_output, make_case, naive_attention, reference_attention,
                             turn_off_xla_autotuning)

turn_off_xla_autotuning()

DTYPES = (jnp.bfloat16, jnp.float16)
TOL = {jnp.dtype(jnp.bfloat16): 2.5e-2, jnp.dtype(jnp.float16): 4e-3}
# (q lens, k lens, heads, kv heads): ragged lengths that end mid-tile (the 256-row q and 128-key
# tiles), one-row sequences, GQA and MQA, more tiles than a B200 has SMs.
DENSE = {
    "aligned": ([256], [384], 2, 2),
    "ragged": ([333, 333], [333, 333], 8, 2),
    "q_short": ([19, 19, 19], [989, 989, 989], 4, 4),
    "one_row": ([1], [99], 4, 1),
    "many_tiles": ([2100, 2100], [2200, 2200], 16, 4),
}
VARLEN = {
    "ragged": ([1, 19, 99, 989], [7, 19, 300, 989], 4, 2),
    "long_k": ([256, 17], [1024, 257], 8, 1),
    "empty_k": ([33, 5], [0, 40], 4, 4),
    # Many short sequences: the varlen tile scheduler's walk from tile to (sequence, q tile).
    "many_short": ([1 + (37 * i) % 100 for i in range(24)], [5 + (53 * i) % 150 for i in range(24)],
                   4, 2),
}


def _name(dtype):
  return "bf16" if jnp.dtype(dtype) == jnp.bfloat16 else "fp16"


@pytest.fixture(autouse=True)
def _clear_disable(monkeypatch):
  monkeypatch.delenv("JAX_SGL_DISABLE", raising=False)


def _need(head_dim, dtype):
  """Skips unless the build has the (head dim, dtype) kernel."""
  built = jax_sgl.attention_backend_info()["kernels"].get("sm100_fwd", {})
  if head_dim not in built.get("head_dims", ()) or jnp.dtype(dtype).name not in built["dtypes"]:
    pytest.skip(f"hdim{head_dim}_{_name(dtype)} not in this build (JAX_SGL_SM100_HEAD_DIMS / "
                "JAX_SGL_SM100_DTYPES)")


def _case(layout, lens, head_dim, dtype, seed):
  q_lens, k_lens, h, hkv = lens
  return make_case(layout, seed=seed, q_lens=q_lens, k_lens=k_lens, num_heads=h,
                   num_kv_heads=hkv, head_dim=head_dim, dtype=dtype)


def _sequences(x, cu):
  """Per-sequence views of a dense [B, S, ...] or packed [total, ...] buffer."""
  if cu is None:
    return list(x)
  cu = np.asarray(cu)
  return [x[cu[b]:cu[b + 1]] for b in range(len(cu) - 1)]


def _input_precision_out(q, k, v, arrays, causal):
  """The kernel's math done in the input precision, sequence by sequence: float32 scores, the
  probabilities rounded to q's dtype before P V (as the tensor cores take them), float32 sums, the
  output rounded to q's dtype; rows in q's layout (varlen: the sequences' rows only)."""
  dt = q.dtype
  f32 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32))
  qs = _sequences(f32(q), arrays.get("cu_seqlens_q"))
  ks = _sequences(f32(k), arrays.get("cu_seqlens_k"))
  vs = _sequences(f32(v), arrays.get("cu_seqlens_k"))
  group = q.shape[-2] // k.shape[-2]
  scale = np.float32(1 / np.sqrt(q.shape[-1]))
  outs = []
  for qb, kb, vb in zip(qs, ks, vs):
    kb, vb = np.repeat(kb, group, axis=1), np.repeat(vb, group, axis=1)
    s = np.einsum("qhd,khd->hqk", qb, kb) * scale
    if causal:
      lq, lk = len(qb), len(kb)
      s = np.where(np.arange(lk)[None, :] <= np.arange(lq)[:, None] + lk - lq, s, -np.inf)
    m = s.max(-1, keepdims=True, initial=-np.inf)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = p.sum(-1, keepdims=True)
    p_lp = f32(jnp.asarray(p).astype(dt))
    o = np.einsum("hqk,khd->qhd", p_lp, vb) / np.where(l > 0, l, 1).transpose(1, 0, 2)
    outs.append(f32(jnp.asarray(o).astype(dt)))
  return np.concatenate(outs) if "cu_seqlens_q" in arrays else np.stack(outs)


def _check(q, k, v, arrays, causal=False, window=(-1, -1), softcap=0.0):
  """The kernel against the reference (tolerance, every element written, lse -inf exactly where
  the reference's is), then against the float64 oracle: FlashAttention's rule, the error at most
  2x that of the same math done in the input precision (calls with a window, softcap, seqused_k or
  sinks are held to the reference's budget, float32 math with the output rounded)."""
  kw = dict(causal=causal, window=window, softcap=softcap)
  want_out, want_lse = reference_attention(q, k, v, return_lse=True, **kw, **arrays)
  run = lambda: jax_sgl.attention(q, k, v, return_lse=True, **kw, **arrays)
  check_kernel_output(run, want_out, want_lse, q.dtype, TOL[jnp.dtype(q.dtype)])
  oracle = naive_attention(q, k, v, **kw, **{n: np.asarray(x) for n, x in arrays.items()})
  out = np.asarray(run()[0].astype(jnp.float32), np.float64)[:len(oracle)]
  if window == (-1, -1) and not softcap and not {"seqused_k", "sinks"} & set(arrays):
    budget = np.asarray(_input_precision_out(q, k, v, arrays, causal), np.float64)
  else:
    budget = np.asarray(want_out.astype(jnp.float32), np.float64)[:len(oracle)]
  ref_err = np.abs(budget - oracle).max(initial=0.0)
  err = np.abs(out - oracle).max(initial=0.0)
  assert err <= 2 * ref_err + 1e-5, f"error {err:.3g} vs the input-precision math's {ref_err:.3g}"


@pytest.mark.parametrize("shape", DENSE, ids=str)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.gpu
@pytest.mark.blackwell
def test_dense_matches_reference(dtype, head_dim, causal, shape):
  _need(head_dim, dtype)
  q, k, v, arrays = _case("dense", DENSE[shape], head_dim, dtype, seed=list(DENSE).index(shape))
  _check(q, k, v, arrays, causal=causal)


@pytest.mark.parametrize("case", VARLEN, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.gpu
@pytest.mark.blackwell
def test_varlen_matches_reference(dtype, head_dim, case):
  _need(head_dim, dtype)
  q, k, v, arrays = _case("varlen", VARLEN[case], head_dim, dtype, seed=7 + list(VARLEN).index(case))
  _check(q, k, v, arrays)


@pytest.mark.parametrize("layout", ("dense", "varlen"))
@pytest.mark.gpu
@pytest.mark.blackwell
def test_sinks_match_reference(layout):
  """Sinks fold into the finished rows in a second pass (sm100/fwd/sinks.cuh)."""
  _need(128, jnp.bfloat16)
  lens = VARLEN["ragged"] if layout == "varlen" else DENSE["ragged"]
  q, k, v, arrays = _case(layout, lens, 128, jnp.bfloat16, seed=13)
  sinks = jnp.asarray(np.random.default_rng(2).normal(size=lens[2]).astype(np.float32) * 2)
  _check(q, k, v, dict(arrays, sinks=sinks), causal=layout == "dense")


# Calls the kernel leaves to the portable one: the answer must not change.
FALLBACK = {
    "window": dict(window=(64, 0), causal=True),
    "window_both": dict(window=(100, 37)),
    "softcap": dict(softcap=30.0),
    "causal_q_long": dict(causal=True),
}


@pytest.mark.parametrize("case", FALLBACK, ids=str)
@pytest.mark.gpu
@pytest.mark.blackwell
def test_fallbacks_match_reference(case):
  _need(128, jnp.bfloat16)
  lens = ([700, 700], [200, 200], 8, 2) if case == "causal_q_long" else DENSE["ragged"]
  q, k, v, arrays = _case("dense", lens, 128, jnp.bfloat16, seed=3)
  _check(q, k, v, arrays, **FALLBACK[case])


@pytest.mark.gpu
@pytest.mark.blackwell
def test_varlen_causal_and_seqused_fall_back():
  _need(128, jnp.bfloat16)
  q, k, v, arrays = _case("varlen", VARLEN["ragged"], 128, jnp.bfloat16, seed=5)
  _check(q, k, v, arrays, causal=True)
  used = jnp.asarray(np.array([3, 19, 150, 989], np.int32))
  _check(q, k, v, dict(arrays, seqused_k=used))


@pytest.mark.parametrize("layout", ("dense", "varlen"))
@pytest.mark.gpu
@pytest.mark.blackwell
def test_runs_the_sm100_kernel(monkeypatch, layout):
  """On a 10.0 device the call runs on the sm100 kernel (its result differs bitwise somewhere
  from the portable kernel's, both match the reference above); JAX_SGL_DISABLE=sm100 keeps it on
  the portable kernel (each run lowers a fresh jit)."""
  if jax.devices("cuda")[0].compute_capability != "10.0":
    pytest.skip("sm_100a code runs on compute capability 10.0 only")
  _need(128, jnp.bfloat16)
  lens = VARLEN["ragged"] if layout == "varlen" else DENSE["ragged"]
  q, k, v, arrays = _case(layout, lens, 128, jnp.bfloat16, seed=11)
  run = lambda: np.asarray(jax.jit(lambda q, k, v: jax_sgl.attention(q, k, v, **arrays))(
      q, k, v)).view(np.uint16)
  sm100 = run()
  monkeypatch.setenv("JAX_SGL_DISABLE", "sm100")
  jax.clear_caches()
  portable = run()
  assert not np.array_equal(sm100, portable)


def test_backend_info_lists_sm100_fwd(monkeypatch):
  """attention_backend_info() names the family in every CUDA build (empty where not compiled),
  and JAX_SGL_DISABLE accepts its name."""
  info = jax_sgl.attention_backend_info()
  if info["cuda"]:
    assert "sm100_fwd" in info["kernels"]
  monkeypatch.setenv("JAX_SGL_DISABLE", "sm100")
  assert jax_sgl.attention_backend_info()["disabled"] == ["sm100"]
