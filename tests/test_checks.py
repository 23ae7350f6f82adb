"""Every shape/dtype rule raises at trace time: through jax.eval_shape, with no kernel run.

SGLang's messages (shared/seeds) are asserted verbatim; jax_sgl's own by their key phrase.
"""

import re

import jax
import jax.extend
import jax.numpy as jnp
import pytest

import jax_sgl

S = jax.ShapeDtypeStruct
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
I32 = jnp.int32

T, HQ, HKV, D, N = 5, 8, 2, 64, 32


def rope_args(**over):
  args = dict(q=S((T, HQ, D), BF16), k=S((T, HKV, D), BF16), v=S((T, HKV, D), BF16),
              positions=S((T,), I32), slots=S((T,), I32), k_pool=S((N, HKV, D), BF16),
              v_pool=S((N, HKV, D), BF16))
  args.update(over)
  return args


def eval_rope(args, **kwargs):
  names = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool")
  return jax.eval_shape(lambda *a: jax_sgl.rope_pool_fused(*a, **kwargs),
                        *(args[n] for n in names))


ROPE_CASES = [
    # SGLang's eleven messages, verbatim.
    (rope_args(q=S((T, HQ * D), BF16)), {}, ValueError, "rope_pool_fused expects q/k/v to be 3-D"),
    (rope_args(k=S((T, HKV, D, 1), BF16)), {}, ValueError,
     "rope_pool_fused expects q/k/v to be 3-D"),
    (rope_args(v=S((T, HKV), BF16)), {}, ValueError, "rope_pool_fused expects q/k/v to be 3-D"),
    (rope_args(positions=S((T, 1), I32)), {}, ValueError,
     "rope_pool_fused expects positions/slots to be 1-D"),
    (rope_args(slots=S((), I32)), {}, ValueError,
     "rope_pool_fused expects positions/slots to be 1-D"),
    (rope_args(k_pool=S((N, HKV * D), BF16)), {}, ValueError,
     "rope_pool_fused expects pool tensors to be 3-D"),
    (rope_args(v_pool=S((N, 1, HKV, D), BF16)), {}, ValueError,
     "rope_pool_fused expects pool tensors to be 3-D"),
    (rope_args(), dict(head_dim=32), ValueError,
     f"q shape must be [num_tokens, num_qo_heads, head_dim], got {(T, HQ, D)}"),
    (rope_args(), dict(num_qo_heads=4), ValueError,
     f"q shape must be [num_tokens, num_qo_heads, head_dim], got {(T, HQ, D)}"),
    (rope_args(k=S((T + 1, HKV, D), BF16)), {}, ValueError,
     f"k shape must be [num_tokens, num_kv_heads, head_dim], got {(T + 1, HKV, D)}"),
    (rope_args(k=S((T, HKV, 32), BF16)), {}, ValueError,
     f"k shape must be [num_tokens, num_kv_heads, head_dim], got {(T, HKV, 32)}"),
    (rope_args(), dict(num_kv_heads=4), ValueError,
     f"k shape must be [num_tokens, num_kv_heads, head_dim], got {(T, HKV, D)}"),
    (rope_args(v=S((T, HKV + 1, D), BF16)), {}, ValueError,
     f"v shape must match k shape, got {(T, HKV + 1, D)} vs {(T, HKV, D)}"),
    (rope_args(positions=S((T + 1,), I32)), {}, ValueError,
     "positions/slots must have one entry per token"),
    (rope_args(slots=S((T - 1,), I32)), {}, ValueError,
     "positions/slots must have one entry per token"),
    (rope_args(k_pool=S((N, HKV + 1, D), BF16)), {}, ValueError,
     f"k_pool has incompatible shape {(N, HKV + 1, D)}"),
    (rope_args(k_pool=S((N, HKV, 2 * D), BF16)), {}, ValueError,
     f"k_pool has incompatible shape {(N, HKV, 2 * D)}"),
    (rope_args(v_pool=S((N + 1, HKV, D), BF16)), {}, ValueError,
     f"v_pool shape must match k_pool shape, got {(N + 1, HKV, D)} vs {(N, HKV, D)}"),
    (rope_args(q=S((T, HQ, D), F16)), {}, ValueError, "q/k/v dtypes must match"),
    (rope_args(v=S((T, HKV, D), F32)), {}, ValueError, "q/k/v dtypes must match"),
    (rope_args(k_pool=S((N, HKV, D), F32)), {}, ValueError,
     "pool dtypes must match q/k/v dtype"),
    (rope_args(v_pool=S((N, HKV, D), F16)), {}, ValueError,
     "pool dtypes must match q/k/v dtype"),
    # jax_sgl's own rules.
    (rope_args(positions=S((T,), F32)), {}, TypeError,
     "jax_sgl.rope_pool_fused: positions must be int32 or int64, got float32 with shape (5,)"),
    (rope_args(slots=S((T,), jnp.int16)), {}, TypeError,
     "jax_sgl.rope_pool_fused: slots must be int32 or int64, got int16 with shape (5,)"),
    (rope_args(**{n: S(s, E4M3) for n, s in (("q", (T, HQ, D)), ("k", (T, HKV, D)),
                                            ("v", (T, HKV, D)), ("k_pool", (N, HKV, D)),
                                            ("v_pool", (N, HKV, D)))}),
     {}, TypeError, "jax_sgl.rope_pool_fused: q/k/v dtype float8_e4m3fn is not supported"),
    (rope_args(), dict(rotary_dim=63), ValueError, "rotary_dim must be even"),
    (rope_args(), dict(rotary_dim=128), ValueError, "rotary_dim must be even"),
    (rope_args(), dict(rope_base=-1.0), ValueError, "rope_base must be a positive finite float"),
]


@pytest.mark.parametrize("args,kwargs,exc,msg", ROPE_CASES)
def test_rope_pool_checks(args, kwargs, exc, msg):
  with pytest.raises(exc) as info:
    eval_rope(args, **kwargs)
  text = str(info.value)
  if text.startswith("jax_sgl."):   # our own rules name the function, then the problem
    assert text.startswith("jax_sgl.rope_pool_fused: ") and msg in text
  else:                             # SGLang's messages are the whole message
    assert text == msg


B, SQ, SK, H = 2, 7, 11, 8


def eval_attn(q, k, v, **kwargs):
  arrays = {n: kwargs.pop(n) for n in list(kwargs) if isinstance(kwargs[n], S)}
  return jax.eval_shape(lambda q, k, v, arrays: jax_sgl.attention(q, k, v, **kwargs, **arrays),
                        q, k, v, arrays)


def dense(dt_q=BF16, dt_k=BF16, dt_v=BF16, d=D, dv=D, hkv=HKV):
  return S((B, SQ, H, d), dt_q), S((B, SK, hkv, d), dt_k), S((B, SK, hkv, dv), dt_v)


DESC = S((B, HKV), F32)

ATTN_CASES = [
    # SGLang's TypeErrors, verbatim (dtype names as jax prints them).
    (dense(dt_k=F16), {}, TypeError, "Type mismatch: bfloat16 != float16"),
    (dense(dt_q=F32, dt_k=BF16, dt_v=F32), {}, TypeError, "Type mismatch: float32 != bfloat16"),
    (dense(dt_v=F16), {}, TypeError, "Type mismatch: bfloat16 != float16"),
    (dense(dt_v=E4M3), {}, TypeError, "Type mismatch: bfloat16 != float8_e4m3fn"),
    (dense(E4M3, E5M2, E4M3), dict(q_descale=DESC, k_descale=DESC), TypeError,
     "Type mismatch: float8_e4m3fn != float8_e5m2"),
    (dense(E4M3, E4M3, E4M3), dict(q_descale=DESC, k_descale=S((B, HKV), BF16),
                                   v_descale=DESC), TypeError,
     "Type mismatch: float32 != bfloat16"),
    # jax_sgl's own rules.
    (dense(E4M3, E4M3, E4M3), dict(k_descale=DESC, v_descale=DESC), ValueError,
     "need q_descale and k_descale"),
    (dense(E4M3, E4M3, E4M3), dict(q_descale=DESC, k_descale=DESC), ValueError,
     "fp8 v (float8_e4m3fn) needs v_descale"),
    (dense(E4M3, E4M3, E4M3), dict(q_descale=S((B, H), F32), k_descale=S((B, H), F32),
                                   v_descale=DESC), ValueError,
     "q_descale must have shape [batch, num_kv_heads]"),
    (dense(), dict(q_descale=DESC, k_descale=DESC), ValueError, "apply to fp8 q/k only"),
    (dense(), dict(sinks=S((H,), BF16)), TypeError,
     "sinks must be float32, got bfloat16 with shape (8,)"),
    (dense(), dict(sinks=S((HKV,), F32)), ValueError,
     "sinks must have shape [num_heads] = (8,), got (2,)"),
    (dense(), dict(sinks=S((B, H), F32)), ValueError,
     "sinks must have shape [num_heads] = (8,), got (2, 8)"),
    (dense(jnp.int8, jnp.int8, jnp.int8), {}, TypeError, "q dtype int8 is not supported"),
    (dense(d=100, dv=100), {}, NotImplementedError, "head_dim 100 is not supported"),
    (dense(d=264, dv=264), {}, NotImplementedError, "head_dim 264 is not supported"),
    (dense(dv=12), {}, NotImplementedError, "head_dim_v 12 is not supported"),
    (dense(hkv=3), {}, ValueError, "num_heads (8) must be a multiple of num_kv_heads (3)"),
    ((S((B, SQ, H, D), BF16), S((B, SK, HKV, 32), BF16), S((B, SK, HKV, D), BF16)), {},
     ValueError, "q and k head_dim differ"),
    ((S((B, SQ, H, D), BF16), S((B + 1, SK, HKV, D), BF16), S((B + 1, SK, HKV, D), BF16)), {},
     ValueError, "q and k batch sizes differ"),
    ((S((B, SQ, H, D), BF16), S((B, SK, HKV, D), BF16), S((B, SK + 1, HKV, D), BF16)), {},
     ValueError, "v must match k in every dimension but head_dim"),
    ((S((SQ, H, D), BF16), S((B, SK, HKV, D), BF16), S((B, SK, HKV, D), BF16)), {},
     ValueError, "q must be [batch, seqlen_q, num_heads, head_dim], got shape (7, 8, 64)"),
    (dense(), dict(window=(-2, 0)), ValueError, "window sizes must be >= 0, or -1"),
    (dense(), dict(window=(4, 3), causal=True), ValueError, "causal=True allows no keys right"),
    (dense(), dict(window=4), TypeError, "window must be a pair of Python ints"),
    (dense(), dict(softcap=-1.0), ValueError, "softcap must be >= 0"),
    (dense(), dict(deterministic=1), TypeError, "deterministic must be a Python bool, got 1 (int)"),
    (dense(), dict(deterministic=jnp.bool_(True)), TypeError,
     "deterministic must be a Python bool, got"),
    (dense(), dict(cu_seqlens_k=S((B + 1,), I32)), ValueError, "cu_seqlens_k needs cu_seqlens_q"),
    ((S((20, H, D), BF16), S((30, HKV, D), BF16), S((30, HKV, D), BF16)),
     dict(cu_seqlens_q=S((B + 1,), I32)), ValueError, "cu_seqlens_q needs cu_seqlens_k"),
    ((S((20, H, D), BF16), S((30, HKV, D), BF16), S((30, HKV, D), BF16)),
     dict(cu_seqlens_q=S((B + 1,), F32), cu_seqlens_k=S((B + 1,), I32)), TypeError,
     "cu_seqlens_q must be int32 or int64, got float32 with shape (3,)"),
    ((S((20, H, D), BF16), S((30, HKV, D), BF16), S((30, HKV, D), BF16)),
     dict(cu_seqlens_q=S((B + 1,), I32), cu_seqlens_k=S((B + 2,), I32)), ValueError,
     "cu_seqlens_k must have batch + 1 = 3 entries like cu_seqlens_q, got shape (4,)"),
    ((S((20, H, D), BF16), S((B, 30, HKV, D), BF16), S((B, 30, HKV, D), BF16)),
     dict(cu_seqlens_q=S((B + 1,), I32), cu_seqlens_k=S((B + 1,), I32)), ValueError,
     "k must be [total_k, num_kv_heads, head_dim] with cu_seqlens_k"),
    (dense(), dict(page_table=S((B, 4), I32)), ValueError, "needs seqused_k [batch]"),
    (dense(), dict(page_table=S((B, 4), I32), seqused_k=S((B,), I32),
                   cu_seqlens_k=S((B + 1,), I32)), ValueError, "takes seqused_k, not cu_seqlens_k"),
    ((S((B, 1, H, D), BF16), S((64, HKV, D), BF16), S((64, HKV, D), BF16)),
     dict(page_table=S((B + 1, 4), I32), seqused_k=S((B,), I32)), ValueError,
     "page_table must be [batch=2, max_pages], got shape (3, 4)"),
    ((S((B, 1, H, D), BF16), S((64, HKV, D), BF16), S((64, HKV, D), BF16)),
     dict(page_table=S((B * 4,), I32), seqused_k=S((B,), I32)), ValueError,
     "page_table must be 2-D, got shape (8,)"),
    ((S((B, 1, H, D), BF16), S((64, HKV, D), BF16), S((64, HKV, D), BF16)),
     dict(page_table=S((B, 4), I32), seqused_k=S((B + 1,), I32)), ValueError,
     "seqused_k must be [batch=2], got shape (3,)"),
    ((S((B, 1, H, D), BF16), S((64, HKV, D), BF16), S((64, HKV, D), BF16)),
     dict(page_table=S((B, 4), jnp.uint32), seqused_k=S((B,), I32)), TypeError,
     "page_table must be int32 or int64, got uint32"),
    ((S((B, 1, H, D), BF16), S((8, 16, 4, HKV, D), BF16), S((8, 16, 4, HKV, D), BF16)),
     dict(page_table=S((B, 4), I32), seqused_k=S((B,), I32)), ValueError,
     "paged k must be a token pool"),
]


@pytest.mark.parametrize("qkv,kwargs,exc,msg", ATTN_CASES)
def test_attention_checks(qkv, kwargs, exc, msg):
  with pytest.raises(exc) as info:
    eval_attn(*qkv, **dict(kwargs))
  text = str(info.value)
  if re.match(r"Type mismatch: ", msg):
    assert text == msg
  else:
    assert text.startswith("jax_sgl.attention: ") and msg in text


def test_case_count():
  assert len(ROPE_CASES) + len(ATTN_CASES) >= 40


def test_checks_run_without_kernels():
  # A valid call traces to exactly one custom-call primitive and its shapes come out right.
  q, k, v = dense()
  out = eval_attn(q, k, v, causal=True)
  assert out.shape == (B, SQ, H, D) and out.dtype == BF16
  jaxpr = jax.make_jaxpr(lambda q, k, v: jax_sgl.attention(q, k, v, return_lse=True))(q, k, v)

  def names(jaxpr):   # the forward sits inside the custom_vjp that makes it differentiable
    for e in jaxpr.eqns:
      yield e.primitive.name
      for sub in jax.extend.core.jaxprs_in_params(e.params):
        yield from names(sub)
  assert list(names(jaxpr.jaxpr)).count("jax_sgl_attention_fwd") == 1
  out, lse = jax.eval_shape(lambda q, k, v: jax_sgl.attention(q, k, v, return_lse=True), q, k, v)
  assert lse.shape == (B, H, SQ) and lse.dtype == F32
  fp8 = eval_attn(*dense(E4M3, E4M3, E4M3), q_descale=DESC, k_descale=DESC, v_descale=DESC)
  assert fp8.dtype == BF16
  dequant = eval_attn(*dense(BF16, BF16, E4M3), v_descale=DESC)
  assert dequant.dtype == BF16
