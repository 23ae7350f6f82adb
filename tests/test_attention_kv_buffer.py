"""attention over a serving engine's fused K/V buffer (`kv_buffer=`, sglang-jax's pool layout) on
the default backend: against the reference on K/V sliced out of the buffer and a float64 oracle,
with NaN wherever a correct kernel never reads (padding features, unnamed pages, page tails); page
sizes 1, 5, 16; ragged lengths, packed q of 1..64 rows per sequence and decode-shaped dense q; GQA,
masks, softcap, sinks; the 5-D, 4-D and 3-D forms; head dims 64 and 128 under pads of 128 and 256;
jit, vmap; the trace-time errors; and the compiled HLO, which must hand the buffer to the custom
call with no copy of the pool in between."""

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from attention_cases import reference_attention
from kv_buffer_cases import check_buffer_case, make_buffer_case

TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 2e-3}
MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window": dict(causal=True, window=(7, 0)),
    "softcap": dict(causal=True, softcap=5.0),
}


def _seed(*parts):
  return zlib.crc32(repr(parts).encode())


def _check(q, buf, k, v, arrays, **flags):
  return check_buffer_case(q, buf, k, v, arrays, tol=TOL[jnp.dtype(q.dtype)], **flags)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("page_size,form", [(1, "3d"), (1, "4d"), (5, "4d"), (16, "5d")])
@pytest.mark.parametrize("group", [1, 4])
def test_page_sizes_forms_masks(page_size, form, mask, group):
  q, buf, k, v, arrays = make_buffer_case(
      seed=_seed(page_size, form, mask, group), q_lens=[1, 19, 64, 3], k_lens=[40, 19, 99, 1],
      num_heads=8, num_kv_heads=8 // group, page_size=page_size, form=form)
  _check(q, buf, k, v, arrays, **MASKS[mask])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim,head_dim_pad", [(64, 128), (128, 128), (128, 256)])
def test_head_dims_and_pads(head_dim, head_dim_pad, dtype):
  q, buf, k, v, arrays = make_buffer_case(
      seed=_seed(head_dim, head_dim_pad), q_lens=[5, 1, 33], k_lens=[5, 70, 40],
      head_dim=head_dim, head_dim_pad=head_dim_pad, page_size=16, dtype=dtype, form="5d")
  _check(q, buf, k, v, arrays, causal=True)


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_decode_shape(page_size):
  """One q row per sequence, dense q [batch, 1, H, D]: the serving loop's decode step."""
  q, buf, k, v, arrays = make_buffer_case(
      seed=_seed("decode", page_size), q_lens=[1] * 5, k_lens=[1, 17, 80, 5, 33], num_heads=8,
      num_kv_heads=2, page_size=page_size, dense_q=True, form="3d" if page_size == 1 else "5d")
  _check(q, buf, k, v, arrays, causal=True)


def test_sinks_and_window():
  q, buf, k, v, arrays = make_buffer_case(seed=_seed("sinks"), q_lens=[7, 1, 20],
                                          k_lens=[30, 9, 20], num_heads=4, num_kv_heads=1,
                                          page_size=5)
  sinks = jnp.asarray(np.random.default_rng(3).uniform(-1, 3, 4), jnp.float32)
  _check(q, buf, k, v, arrays, causal=True, window=(4, 0), sinks=sinks, softmax_scale=0.2)


def test_fully_masked_and_empty_sequences():
  """KV shorter than q under causal and an empty KV sequence: 0 output, -inf lse."""
  q, buf, k, v, arrays = make_buffer_case(seed=_seed("empty"), q_lens=[9, 3], k_lens=[4, 0],
                                          page_size=5, dtype=jnp.float32)
  out, lse = _check(q, buf, k, v, arrays, causal=True)
  assert not np.asarray(out)[np.r_[0:5, 9:12]].any()
  assert np.isneginf(np.asarray(lse)[:, np.r_[0:5, 9:12]]).all()


def test_fp8_buffer_with_descales():
  """An e4m3 pool (CPU): q and the buffer e4m3 with per (sequence, kv head) descales, bf16 out."""
  q, buf, k, v, arrays = make_buffer_case(seed=_seed("fp8"), q_lens=[3, 1, 9], k_lens=[20, 7, 9],
                                          num_heads=4, num_kv_heads=2, page_size=5,
                                          dtype=jnp.float8_e4m3fn, form="5d")
  rng = np.random.default_rng(4)
  scales = {n: jnp.asarray(rng.uniform(0.5, 2.0, (3, 2)), jnp.float32)
            for n in ("q_descale", "k_descale", "v_descale")}
  out = jax_sgl.attention(q, None, None, kv_buffer=buf, causal=True, **scales, **arrays)
  want = reference_attention(q, k, v, causal=True, **scales, **arrays)
  assert out.dtype == jnp.bfloat16
  got = np.asarray(out, np.float32)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def test_jit_and_vmap():
  """vmap over stacked buffers (one per instance, e.g. per layer) with shared page tables."""
  cases = [make_buffer_case(seed=s, q_lens=[3, 8], k_lens=[20, 11], page_size=5, form="5d",
                            table_seed=0) for s in (1, 2)]
  q = jnp.stack([c[0] for c in cases])
  buf = jnp.stack([c[1] for c in cases])
  arrays = cases[0][4]
  assert all((np.asarray(c[4]["page_table"]) == np.asarray(arrays["page_table"])).all()
             for c in cases)
  f = jax.jit(jax.vmap(lambda q, b: jax_sgl.attention(q, None, None, kv_buffer=b, causal=True,
                                                      **arrays)))
  got = f(q, buf)
  for i, (qi, bi, ki, vi, _) in enumerate(cases):
    want = jax_sgl.attention(qi, ki, vi, causal=True, **arrays)
    np.testing.assert_allclose(np.asarray(got[i], np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_grad_raises():
  q, buf, _, _, arrays = make_buffer_case(seed=5, q_lens=[2], k_lens=[4], page_size=5)
  loss = lambda q: jax_sgl.attention(q, None, None, kv_buffer=buf, **arrays).astype(
      jnp.float32).sum()
  with pytest.raises(NotImplementedError, match="kv_buffer"):
    jax.grad(loss)(q)


def _copies_of(hlo: str, shape: tuple[int, ...]) -> list[str]:
  """HLO instructions that slice, gather, copy, transpose or concatenate an array of `shape`."""
  dims = ",".join(str(d) for d in shape)
  ops = ("slice", "dynamic-slice", "gather", "copy", "transpose", "concatenate", "pad")
  hits = []
  for line in hlo.splitlines():
    m = re.search(r"=\s*\S+\s+(" + "|".join(ops) + r")\(", line)
    if m and f"[{dims}]" in line.split("=", 1)[1]:
      hits.append(line.strip())
  return hits


@pytest.mark.parametrize("form,page_size", [("5d", 16), ("3d", 1)])
def test_compiled_hlo_reads_the_pool_in_place(form, page_size):
  """The buffer reaches the custom call as a bitcast at most: no slice / gather / copy of it."""
  q, buf, _, _, arrays = make_buffer_case(seed=6, q_lens=[4, 1], k_lens=[30, 7],
                                          page_size=page_size, form=form)
  f = lambda q, buf, pt, su, cu: jax_sgl.attention(q, None, None, kv_buffer=buf, page_table=pt,
                                                   seqused_k=su, cu_seqlens_q=cu, causal=True)
  hlo = jax.jit(f).lower(q, buf, arrays["page_table"], arrays["seqused_k"],
                         arrays["cu_seqlens_q"]).compile().as_text()
  assert "jax_sgl_attention_fwd" in hlo
  pages, rest = buf.shape[0], buf.shape[1:]
  flat = (pages, page_size) + (int(np.prod(rest)) // page_size // buf.shape[-1], buf.shape[-1])
  for shape in {tuple(buf.shape), flat}:
    assert not _copies_of(hlo, shape), _copies_of(hlo, shape)
  # Nor anything of the K or V view's shape (a sliced-out half of the pool).
  hkv = flat[2] // 2
  for d in (q.shape[-1], buf.shape[-1]):
    for shape in ((pages, page_size, hkv, d), (pages * page_size, hkv, d), (pages, hkv, d)):
      assert f"[{','.join(map(str, shape))}]" not in hlo, shape


def test_compiled_hlo_passes_a_plain_token_pool_in_place():
  """Separate k/v token pools [slots, Hkv, D] keep their rank down to the custom call (a unit
  page axis added in JAX made jax 0.10's XLA copy both pools)."""
  q, _, k, v, arrays = make_buffer_case(seed=7, q_lens=[4, 1], k_lens=[30, 7], page_size=1,
                                        form="3d")
  f = lambda q, k, v, pt, su, cu: jax_sgl.attention(q, k, v, page_table=pt, seqused_k=su,
                                                    cu_seqlens_q=cu, causal=True)
  hlo = jax.jit(f).lower(q, k, v, arrays["page_table"], arrays["seqused_k"],
                         arrays["cu_seqlens_q"]).compile().as_text()
  assert "jax_sgl_attention_fwd" in hlo
  assert not [l for l in hlo.splitlines() if re.search(r"\bcopy\(", l)]


# --------------------------------------------------------------------------------------------
# trace-time errors
# --------------------------------------------------------------------------------------------

def _args(**over):
  q, buf, k, v, arrays = make_buffer_case(seed=9, q_lens=[2, 3], k_lens=[5, 6], page_size=5)
  kw = dict(kv_buffer=buf, **arrays)
  kw.update(over)
  return q, kw, k, v


def _raises(exc, match, q, k, v, **kw):
  with pytest.raises(exc, match=match):
    jax.eval_shape(lambda q: jax_sgl.attention(q, k, v, **kw), q)


def test_error_k_or_v_with_kv_buffer():
  q, kw, k, v = _args()
  _raises(ValueError, r"kv_buffer \(\d+, 5, 4, 128\) holds K and V; pass k=None", q, k, None,
          **kw)
  _raises(ValueError, r"pass k=None and v=None .* v \(", q, None, v, **kw)


@pytest.mark.parametrize("missing,match", [
    ("kv_buffer", "k and v are required unless kv_buffer"),
    ("page_table", r"kv_buffer .* needs page_table"),
    ("seqused_k", "needs seqused_k"),
])
def test_error_missing_argument(missing, match):
  q, kw, _, _ = _args()
  del kw[missing]
  _raises(ValueError, match, q, None, None, **kw)


def test_error_cu_seqlens_k_with_kv_buffer():
  q, kw, _, _ = _args(cu_seqlens_k=jnp.array([0, 5, 11], jnp.int32))
  _raises(ValueError, "takes seqused_k, not cu_seqlens_k", q, None, None, **kw)


def test_error_head_dim_too_large():
  q, kw, _, _ = _args()
  q = jnp.zeros(q.shape[:-1] + (136,), q.dtype)
  _raises(ValueError, r"q's head_dim 136 .* exceeds kv_buffer's padded head dim 128", q, None,
          None, **kw)


def test_error_dtype_mismatch():
  q, kw, _, _ = _args()
  _raises(TypeError, r"Type mismatch: float16 != bfloat16 \(jax_sgl.attention: kv_buffer",
          q.astype(jnp.float16), None, None, **kw)


@pytest.mark.parametrize("shape,match", [
    ((4, 5, 3, 128), "must be even"),
    ((4, 5, 128), None),        # a 3-D token pool [slots, 5, 128]: odd head axis
    ((4, 5, 2, 2, 2, 128), r"kv_buffer must be \[num_pages"),
    ((4, 5, 4, 100), "multiple of 8"),
])
def test_error_bad_buffer_shape(shape, match):
  q, kw, _, _ = _args()
  kw["kv_buffer"] = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  _raises(ValueError, match or "must be even", q, None, None, **kw)


def test_error_integer_buffer():
  q, kw, _, _ = _args()
  kw["kv_buffer"] = jax.ShapeDtypeStruct((4, 5, 4, 128), jnp.int32)
  _raises(TypeError, r"kv_buffer must be one of .* got int32 with shape \(4, 5, 4, 128\)", q,
          None, None, **kw)


def test_error_gqa_mismatch():
  q, kw, _, _ = _args()
  kw["kv_buffer"] = jax.ShapeDtypeStruct((4, 5, 6, 128), jnp.bfloat16)   # Hkv = 3, H = 4
  _raises(ValueError, r"multiple of num_kv_heads \(3\)", q, None, None, **kw)
