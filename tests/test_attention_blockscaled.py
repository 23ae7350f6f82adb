"""Block-scaled fp8 q/k (SGLang's qk_blockscaled, the OCP MX format) on the CPU: e4m3 q/k with one
e8m0 (or float32) scale per 32 features of the head dim.

The CPU kernel and the pure-JAX reference are compared with a float64 oracle computed from the
dequantized values x[..., j] * scale[..., j // 32] (numpy), in every layout, with GQA, masks,
softcap, LSE and ragged sizes; the dequantization itself is checked to be exact; bad arguments
raise at trace time, e8m0's NaN encoding at run time, and CUDA lowering with NotImplementedError.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_sgl
from attention_cases import LAYOUTS, make_case, naive_attention, reference_attention
from jax_sgl._checks import check_attention, check_attention_cuda

E4M3, E5M2, E8M0 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e8m0fnu
BF16, F32 = jnp.bfloat16, jnp.float32
BLOCK = 32
# Scale exponents drawn from [-EXP, EXP]: the dynamic range an MX quantizer uses across blocks of
# one tensor, small enough that scores stay where float32's rounding is the only error.
EXP = 4
# bf16 out: the kernel and the oracle differ by the bf16 rounding of out (half an ulp, 2^-9
# relative) plus float32 noise; lse is float32 and carries only the float32 noise of the scores.
OUT_RTOL, OUT_ATOL = 2.0 ** -8, 1e-4
LSE_RTOL, LSE_ATOL = 1e-5, 2e-4


def random_scales(rng, shape, scale_dtype, exp=EXP):
  """e8m0: random exponents 2^[-exp, exp]; float32: random values in [2^-exp, 2^exp) that are
  not powers of two, so the general product (one rounding) is exercised too."""
  e = rng.integers(-exp, exp + 1, shape)
  if scale_dtype == E8M0:
    return jnp.asarray((e + 127).astype(np.uint8)).view(E8M0)
  return jnp.asarray(np.exp2(e + rng.uniform(0.05, 0.95, shape)), F32)


def blockscaled_case(layout, *, seed, scale_dtype=E8M0, v_dtype=BF16, **kw):
  """make_case's problem with q/k quantized to e4m3 and block scales of q's and k's shapes."""
  q, k, v, arrays = make_case(layout, seed=seed, dtype=F32, **kw)
  rng = np.random.default_rng(seed + 1)
  d = q.shape[-1]
  q, k = q.astype(E4M3), k.astype(E4M3)
  arrays = dict(arrays,
                q_descale=random_scales(rng, q.shape[:-1] + (d // BLOCK,), scale_dtype),
                k_descale=random_scales(rng, k.shape[:-1] + (d // BLOCK,), scale_dtype))
  return q, k, v.astype(v_dtype), arrays


def dequantized(x, scale):
  """The oracle's view of a block-scaled operand: numpy float64 x * scale[..., j // 32]."""
  s = np.asarray(jnp.asarray(scale).astype(F32), np.float64)
  return np.asarray(x.astype(F32), np.float64) * np.repeat(s, BLOCK, axis=-1)


def oracle(q, k, v, *, q_descale, k_descale, **kw):
  return naive_attention(dequantized(q, q_descale), dequantized(k, k_descale),
                         np.asarray(v.astype(F32), np.float64), return_lse=True, **kw)


def lse_rows(lse, varlen):
  """lse [B, H, Sq] / [H, total_q] in the oracle's row layout [B, Sq, H] / [total_q, H]."""
  lse = np.asarray(lse, np.float64)
  return lse.T if varlen else np.swapaxes(lse, 1, 2)


def assert_matches(got, want_out, want_lse, varlen):
  out, lse = got
  assert out.dtype == BF16
  np.testing.assert_allclose(np.asarray(out.astype(F32), np.float64), want_out, rtol=OUT_RTOL,
                             atol=OUT_ATOL)
  lse = lse_rows(lse, varlen)
  if varlen:   # rows past cu_seqlens_q[-1] belong to no sequence (none here)
    lse = lse[:want_lse.shape[0]]
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
  fin = np.isfinite(want_lse)
  np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=LSE_RTOL, atol=LSE_ATOL)


FLAGS = [dict(), dict(causal=True), dict(window=(5, 2)), dict(softcap=4.0, causal=True),
         dict(causal=True, window=(9, -1))]


@pytest.mark.parametrize("scale_dtype", [E8M0, F32], ids=["e8m0", "f32"])
@pytest.mark.parametrize("head_dim", [64, 128, 96])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_float64_oracle(layout, head_dim, scale_dtype):
  """Kernel and reference against the oracle: ragged sequences (lengths 1, 19, 7; keys up to 33),
  GQA 4:2, a mask or softcap per case, lse."""
  i = LAYOUTS.index(layout) * 3 + (64, 128, 96).index(head_dim)
  flags = FLAGS[i % len(FLAGS)]
  q, k, v, arrays = blockscaled_case(layout, seed=100 + i, scale_dtype=scale_dtype,
                                     q_lens=[1, 19, 7], k_lens=[5, 23, 33], head_dim=head_dim,
                                     page_size=5)
  want_out, want_lse = oracle(q, k, v, **flags, **arrays)
  varlen = layout != "dense"
  got = jax_sgl.attention(q, k, v, return_lse=True, **flags, **arrays)
  assert_matches(got, want_out, want_lse, varlen)
  assert_matches(reference_attention(q, k, v, return_lse=True, **flags, **arrays), want_out,
                 want_lse, varlen)


def test_mqa_odd_sizes():
  """One kv head for seven q heads, 13 x 29 dense, head dim 32 (one scale per head row)."""
  q, k, v, arrays = blockscaled_case("dense", seed=7, q_lens=[13, 13], k_lens=[29, 29],
                                     num_heads=7, num_kv_heads=1, head_dim=32)
  got = jax_sgl.attention(q, k, v, causal=True, return_lse=True, **arrays)
  assert_matches(got, *oracle(q, k, v, causal=True, **arrays), varlen=False)


def test_fp8_v_with_v_descale():
  """v stays as with per-head descales: e4m3 with v_descale [batch, num_kv_heads]."""
  q, k, v, arrays = blockscaled_case("dense", seed=8, v_dtype=E4M3, q_lens=[11] * 2,
                                     k_lens=[17] * 2, head_dim=64)
  vd = jnp.asarray(np.random.default_rng(9).uniform(0.5, 2.0, (2, 2)), F32)
  got = jax_sgl.attention(q, k, v, v_descale=vd, causal=True, return_lse=True, **arrays)
  v64 = np.asarray(v.astype(F32), np.float64) * np.asarray(vd, np.float64)[:, None, :, None]
  want = naive_attention(dequantized(q, arrays["q_descale"]), dequantized(k, arrays["k_descale"]),
                         v64, causal=True, return_lse=True)
  assert_matches(got, *want, varlen=False)


def test_sinks():
  """Attention sinks join the softmax of block-scaled scores as of any others."""
  q, k, v, arrays = blockscaled_case("varlen", seed=14, q_lens=[3, 8], k_lens=[10, 8],
                                     head_dim=96)
  sinks = jnp.asarray(np.random.default_rng(15).uniform(-1, 2, 4), F32)
  got = jax_sgl.attention(q, k, v, sinks=sinks, causal=True, return_lse=True, **arrays)
  assert_matches(got, *oracle(q, k, v, sinks=sinks, causal=True, **arrays), varlen=True)


def test_dequantization_is_exact():
  """With one visible key, lse is that key's score and out its V row: e4m3 values of exponent 0
  times scales 2^[-1, 1] keep every product and sum exact in float32, so kernel and reference
  must equal the float64 oracle exactly (an extra rounding of the scaled q or k would show)."""
  rng = np.random.default_rng(10)
  d = 64
  mag = lambda shape: (1 + rng.integers(0, 8, shape) / 8) * rng.choice([-1, 1], shape)
  q = jnp.asarray(mag((2, 1, 4, d)), F32).astype(E4M3)
  k = jnp.asarray(mag((2, 1, 2, d)), F32).astype(E4M3)
  v = jnp.asarray(rng.standard_normal((2, 1, 2, d)), BF16)
  sq = random_scales(rng, (2, 1, 4, d // BLOCK), E8M0, exp=1)
  sk = random_scales(rng, (2, 1, 2, d // BLOCK), E8M0, exp=1)
  want_out, want_lse = oracle(q, k, v, q_descale=sq, k_descale=sk)
  for out, lse in (jax_sgl.attention(q, k, v, q_descale=sq, k_descale=sk, return_lse=True),
                   reference_attention(q, k, v, q_descale=sq, k_descale=sk, return_lse=True)):
    np.testing.assert_array_equal(lse_rows(lse, False), want_lse)
    np.testing.assert_array_equal(np.asarray(out.astype(F32)), want_out)


def test_e8m0_equals_its_float32_values():
  """An e8m0 scale and the float32 it encodes give bitwise the same result."""
  q, k, v, arrays = blockscaled_case("varlen", seed=11, q_lens=[6, 9], k_lens=[12, 9])
  as_f32 = {n: arrays[n].astype(F32) for n in ("q_descale", "k_descale")}
  got = jax_sgl.attention(q, k, v, causal=True, return_lse=True, **arrays)
  want = jax_sgl.attention(q, k, v, causal=True, return_lse=True, **{**arrays, **as_f32})
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g.astype(F32)), np.asarray(w.astype(F32)))


def test_scales_are_per_block():
  """Doubling the scale of one block of one q row changes that row alone, as the oracle says."""
  q, k, v, arrays = blockscaled_case("dense", seed=12, q_lens=[5], k_lens=[8], head_dim=96)
  before = jax_sgl.attention(q, k, v, **arrays)
  sq = np.asarray(arrays["q_descale"]).view(np.uint8).copy()
  sq[0, 2, 1, 1] += 1
  arrays = dict(arrays, q_descale=jnp.asarray(sq).view(E8M0))
  after = jax_sgl.attention(q, k, v, **arrays)
  changed = np.any(np.asarray(before != after), axis=-1)
  assert changed[0, 2, 1] and changed.sum() == 1
  assert_matches(jax_sgl.attention(q, k, v, return_lse=True, **arrays), *oracle(q, k, v, **arrays),
                 varlen=False)


def test_kv_buffer():
  """A fused e4m3 K/V buffer: k's block scales are those of its K view [pages, page, Hkv, D/32]."""
  rng = np.random.default_rng(13)
  pages, page, hkv, d = 6, 4, 2, 64
  buf = jnp.asarray(rng.standard_normal((pages, page, 2 * hkv, d)), F32).astype(E4M3)
  q = jnp.asarray(rng.standard_normal((2, 3, 4, d)), F32).astype(E4M3)
  table = jnp.asarray([[3, 0, -1], [5, 1, 2]], jnp.int32)
  used = jnp.asarray([7, 11], jnp.int32)
  sq = random_scales(rng, (2, 3, 4, d // BLOCK), E8M0)
  sk = random_scales(rng, (pages, page, hkv, d // BLOCK), E8M0)
  vd = jnp.asarray(rng.uniform(0.5, 2, (2, hkv)), F32)
  kw = dict(page_table=table, seqused_k=used, q_descale=sq, k_descale=sk, v_descale=vd,
            causal=True, return_lse=True)
  out, lse = jax_sgl.attention(q, kv_buffer=buf, **kw)
  want_out, want_lse = reference_attention(q, buf[:, :, 0::2], buf[:, :, 1::2], **kw)
  # Both round float32 results to bf16: at most one bf16 ulp (2^-7 relative) apart.
  np.testing.assert_allclose(np.asarray(out.astype(F32)), np.asarray(want_out.astype(F32)),
                             rtol=2.0 ** -7, atol=OUT_ATOL)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=LSE_RTOL, atol=LSE_ATOL)


def test_jit_and_vmap():
  """vmap folds the scales into the heads as it folds q and k; jit of the same call agrees."""
  cases = [blockscaled_case("dense", seed=20 + i, q_lens=[4, 4], k_lens=[9, 9]) for i in range(3)]
  q, k, v = (jnp.stack([c[i] for c in cases]) for i in range(3))
  sq, sk = (jnp.stack([c[3][n] for c in cases]) for n in ("q_descale", "k_descale"))
  f = lambda q, k, v, sq, sk: jax_sgl.attention(q, k, v, q_descale=sq, k_descale=sk, causal=True)
  got = jax.jit(jax.vmap(f))(q, k, v, sq, sk)
  for i, (qi, ki, vi, arrays) in enumerate(cases):
    want = jax_sgl.attention(qi, ki, vi, causal=True, **arrays)
    np.testing.assert_array_equal(np.asarray(got[i].astype(F32)), np.asarray(want.astype(F32)))


def test_nan_scale():
  """0xff, e8m0's NaN encoding: the CPU kernel rejects a call that reads one, naming the argument;
  the reference follows the MX spec (the block is NaN, so the rows that read it are)."""
  q, k, v, arrays = blockscaled_case("dense", seed=30, q_lens=[4], k_lens=[6])
  for name in ("q_descale", "k_descale"):
    s = np.asarray(arrays[name]).view(np.uint8).copy()
    s[0, 1, 0, 0] = 0xff
    bad = dict(arrays, **{name: jnp.asarray(s).view(E8M0)})
    with pytest.raises(Exception, match=f"{name} holds 0xff, float8_e8m0fnu's NaN encoding"):
      jax.block_until_ready(jax_sgl.attention(q, k, v, **bad))
    want = np.asarray(reference_attention(q, k, v, **bad).astype(F32))
    assert np.isnan(want).any()
  # A NaN scale in pool rows the call never reads (unused slots) is no error.
  q, k, v, arrays = blockscaled_case("paged_pages", seed=31, q_lens=[3], k_lens=[6], page_size=4)
  s = np.asarray(arrays["k_descale"]).view(np.uint8).copy()
  unused = sorted(set(range(k.shape[0])) - set(np.asarray(arrays["page_table"]).ravel()))
  s[unused] = 0xff
  arrays = dict(arrays, k_descale=jnp.asarray(s).view(E8M0))
  assert_matches(jax_sgl.attention(q, k, v, return_lse=True, **arrays), *oracle(q, k, v, **arrays),
                 varlen=True)


def test_forward_only():
  q, k, v, arrays = blockscaled_case("dense", seed=32, q_lens=[3], k_lens=[5])
  f = lambda q: jnp.sum(jax_sgl.attention(q, k, v, **arrays).astype(F32))
  with pytest.raises(NotImplementedError, match="gradients through fp8 inputs are not supported"):
    jax.grad(f)(q)


# --------------------------------------------------------------------------------------------
# Trace-time errors
# --------------------------------------------------------------------------------------------

S = jax.ShapeDtypeStruct
B, SQ, SK, H, HKV, D = 2, 5, 7, 4, 2, 64


def _sf(shape, dtype=E8M0):
  return S(shape, dtype)


QS, KS = _sf((B, SQ, H, D // BLOCK)), _sf((B, SK, HKV, D // BLOCK))

BAD = [
    # The seed's words (flash_fwd_sm100: sfq and sfk dtypes must match), verbatim.
    (dict(q_descale=QS, k_descale=_sf(KS.shape, F32)), TypeError,
     "Type mismatch: float8_e8m0fnu != float32"),
    (dict(q_descale=_sf(QS.shape, F32), k_descale=KS), TypeError,
     "Type mismatch: float32 != float8_e8m0fnu"),
    # jax_sgl's own rules, each naming the argument.
    (dict(q_descale=QS, k_descale=_sf((B, HKV))), ValueError,   # e8m0 is a block scale
     "k_descale (block scales) must have k's shape with head_dim // 32 last"),
    (dict(q_descale=_sf((B, HKV), F32), k_descale=_sf(KS.shape, F32)), ValueError,
     "q_descale and k_descale must both be block scales"),
    (dict(q_descale=_sf(QS.shape, BF16), k_descale=_sf(KS.shape, BF16)), TypeError,
     "q_descale (block scales) must be float8_e8m0fnu, float32, got bfloat16"),
    (dict(q_descale=_sf((B, SQ, H, D // 16)), k_descale=KS), ValueError,
     "q_descale (block scales) must have q's shape with head_dim // 32 last"),
    (dict(q_descale=QS, k_descale=_sf((B, SK + 1, HKV, D // BLOCK))), ValueError,
     "k_descale (block scales) must have k's shape with head_dim // 32 last, [batch, seqlen_k"),
    (dict(q_descale=QS, k_descale=_sf((B, SK, H, D // BLOCK))), ValueError,
     "k_descale (block scales) must have k's shape"),
    (dict(q_descale=QS, k_descale=KS, v_descale=_sf((B, HKV), F32)), ValueError,
     "v_descale applies to fp8 v only"),
    (dict(q_descale=QS), ValueError, "need q_descale and k_descale"),
]


def _eval(q, k, v, **arrays):
  return jax.eval_shape(lambda q, k, v, a: jax_sgl.attention(q, k, v, **a), q, k, v, arrays)


def _dense(dt=E4M3, d=D, dt_v=BF16):
  return S((B, SQ, H, d), dt), S((B, SK, HKV, d), dt), S((B, SK, HKV, d), dt_v)


@pytest.mark.parametrize("arrays,exc,msg", BAD)
def test_bad_arguments_raise_at_trace_time(arrays, exc, msg):
  with pytest.raises(exc) as info:
    _eval(*_dense(), **arrays)
  text = str(info.value)
  if msg.startswith("Type mismatch: "):
    assert text == msg
  else:
    assert text.startswith("jax_sgl.attention: ") and msg in text, text


def test_bad_operands_raise_at_trace_time():
  with pytest.raises(NotImplementedError, match="float8_e4m3fn q/k only, got float8_e5m2"):
    _eval(*_dense(E5M2), q_descale=QS, k_descale=KS)
  with pytest.raises(ValueError, match="head_dim a multiple of 32 .* got head_dim 72"):
    _eval(*_dense(d=72), q_descale=_sf((B, SQ, H, 2)), k_descale=_sf((B, SK, HKV, 2)))
  with pytest.raises(ValueError, match="apply to fp8 q/k only, got q bfloat16"):
    _eval(*_dense(BF16), q_descale=QS, k_descale=KS)
  with pytest.raises(ValueError, match=r"fp8 v \(float8_e4m3fn\) needs v_descale"):
    _eval(*_dense(dt_v=E4M3), q_descale=QS, k_descale=KS)
  # Paged: the scales are a pool beside K's; a token pool's have its rank.
  q = S((B, 1, H, D), E4M3)
  k = v = S((12, 4, HKV, D), E4M3)
  kw = dict(page_table=S((B, 3), jnp.int32), seqused_k=S((B,), jnp.int32),
            v_descale=S((B, HKV), F32), q_descale=_sf((B, 1, H, 2)))
  assert _eval(q, k, v, k_descale=_sf((12, 4, HKV, 2)), **kw).dtype == BF16
  with pytest.raises(ValueError, match=r"\[num_pages, page_size, num_kv_heads, head_dim // 32\]"):
    _eval(q, k, v, k_descale=_sf((12, HKV, 2)), **kw)
  k = v = S((48, HKV, D), E4M3)
  assert _eval(q, k, v, k_descale=_sf((48, HKV, 2)), **kw).dtype == BF16
  with pytest.raises(ValueError, match=r"\[num_slots, num_kv_heads, head_dim // 32\]"):
    _eval(q, k, v, k_descale=_sf((48, 1, HKV, 2)), **kw)


def test_valid_shapes_trace():
  """Dense and varlen forms trace, with bf16, f32 or fp8 v; out is bfloat16."""
  assert _eval(*_dense(), q_descale=QS, k_descale=KS).dtype == BF16
  assert _eval(*_dense(dt_v=F32), q_descale=QS, k_descale=KS).dtype == BF16
  assert _eval(*_dense(dt_v=E4M3), q_descale=QS, k_descale=KS,
               v_descale=S((B, HKV), F32)).dtype == BF16
  cu = S((B + 1,), jnp.int32)
  q, k = S((11, H, D), E4M3), S((13, HKV, D), E4M3)
  out = _eval(q, k, S((13, HKV, D), BF16), cu_seqlens_q=cu, cu_seqlens_k=cu,
              q_descale=_sf((11, H, 2), F32), k_descale=_sf((13, HKV, 2), F32))
  assert out.shape == (11, H, D) and out.dtype == BF16


def test_cuda_lowering_raises():
  """The lowering check for CUDA names what is missing; with a CUDA build, exporting for CUDA
  (no GPU needed) reaches it."""
  q, k, v = _dense()
  spec = check_attention(q, k, v, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
                         cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, page_table=None,
                         q_descale=QS, k_descale=KS, v_descale=None)
  assert spec.qk_blockscaled
  msg = "block-scaled q/k \\(qk_blockscaled\\) runs on the CPU only: no CUDA kernel applies e8m0"
  with pytest.raises(NotImplementedError, match=msg):
    check_attention_cuda(q.dtype, v.dtype, spec.qk_blockscaled)
  if "jax_sgl_attention_fwd" not in jax_sgl.CUDA_TARGETS:
    return
  arrays = {n: jnp.ones(s.shape, s.dtype) for n, s in (("q_descale", QS), ("k_descale", KS))}
  args = [jnp.ones(x.shape, x.dtype) for x in (q, k, v)]
  with pytest.raises(NotImplementedError, match=msg):
    jax.export.export(jax.jit(lambda q, k, v: jax_sgl.attention(q, k, v, **arrays)),
                      platforms=["cuda"])(*args)


@pytest.mark.parametrize("layout", ["paged_tokens", "paged_pages"])
def test_reference_lowering_elsewhere(layout):
  """On a platform with no kernel (TPU here, exported from the CPU) the call lowers to the
  reference, which reads a token pool's block scales in its layout: no jax_sgl custom call."""
  q, k, v, arrays = blockscaled_case(layout, seed=40, q_lens=[2, 3], k_lens=[5, 9])
  f = lambda q, k, v, a: jax_sgl.attention(q, k, v, causal=True, **a)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)   # the fallback's one-time warning
    module = jax.export.export(jax.jit(f), platforms=["tpu"])(q, k, v, arrays).mlir_module()
  assert "custom_call @jax_sgl" not in module


# --------------------------------------------------------------------------------------------
# Property test
# --------------------------------------------------------------------------------------------

@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(LAYOUTS), q_lens=st.lists(st.integers(0, 17), min_size=1,
                                                         max_size=3),
       extra_k=st.integers(-3, 20), num_kv_heads=st.integers(1, 3), group=st.integers(1, 3),
       blocks=st.integers(1, 8), causal=st.booleans(), left=st.integers(-1, 9),
       softcap=st.sampled_from([0.0, 3.0]), page_size=st.integers(1, 6),
       scale_dtype=st.sampled_from([E8M0, F32]), seed=st.integers(0, 2**31 - 1))
def test_random_problems(layout, q_lens, extra_k, num_kv_heads, group, blocks, causal, left,
                         softcap, page_size, scale_dtype, seed):
  k_lens = [max(0, n + extra_k) for n in q_lens]
  if layout == "dense":
    q_lens, k_lens = [max(q_lens)] * len(q_lens), [max(k_lens)] * len(k_lens)
  q, k, v, arrays = blockscaled_case(layout, seed=seed % 2**30, scale_dtype=scale_dtype,
                                     q_lens=q_lens, k_lens=k_lens,
                                     num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                                     head_dim=BLOCK * blocks, page_size=page_size)
  flags = dict(causal=causal, window=(left, -1), softcap=softcap)
  got = jax_sgl.attention(q, k, v, return_lse=True, **flags, **arrays)
  assert_matches(got, *oracle(q, k, v, **flags, **arrays), varlen=layout != "dense")
