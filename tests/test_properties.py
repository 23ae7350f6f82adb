"""Hypothesis property tests: random shapes, layouts and flags agree with the reference."""

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_sgl
from attention_cases import LAYOUTS, TOL, make_case, reference_attention
from jax_sgl import reference

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
DTYPES = st.sampled_from([jnp.float32, jnp.float16, jnp.bfloat16])


@SETTINGS
@given(num_tokens=st.integers(1, 70), num_kv_heads=st.integers(1, 4), group=st.integers(1, 3),
       half_dim=st.integers(1, 80), rotary_frac=st.floats(0.05, 1.0), is_neox=st.booleans(),
       num_slots=st.integers(1, 100), dtype=DTYPES, seed=st.integers(0, 2**31 - 1))
def test_rope_pool_random(num_tokens, num_kv_heads, group, half_dim, rotary_frac, is_neox,
                          num_slots, dtype, seed):
  rng = np.random.default_rng(seed)
  d = 2 * half_dim
  rotary_dim = max(2, 2 * int(half_dim * rotary_frac))
  f = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(dtype)
  q, k, v = f(num_tokens, group * num_kv_heads, d), f(num_tokens, num_kv_heads, d), \
      f(num_tokens, num_kv_heads, d)
  positions = jnp.asarray(rng.integers(0, 10**5, num_tokens), jnp.int32)
  slots = jnp.asarray(rng.permutation(2 * num_slots + num_tokens)[:num_tokens] - num_slots // 2,
                      jnp.int32)
  k_pool, v_pool = f(num_slots, num_kv_heads, d), f(num_slots, num_kv_heads, d)
  args = (q, k, v, positions, slots, k_pool, v_pool)
  got = jax_sgl.rope_pool_fused(*args, rotary_dim=rotary_dim, is_neox=is_neox)
  want = reference.rope_pool_fused(*args, rotary_dim=rotary_dim, is_neox=is_neox)
  # Angles up to 1e5 rad: a one-ulp difference in sin/cos implementations shows up at ~1e-5.
  tol = max(TOL[dtype], 1e-4)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol,
                               atol=tol)


@SETTINGS
@given(layout=st.sampled_from(LAYOUTS), q_lens=st.lists(st.integers(0, 20), min_size=1,
                                                         max_size=4),
       extra_k=st.integers(-5, 30), num_kv_heads=st.integers(1, 3), group=st.integers(1, 3),
       head_dim=st.sampled_from([8, 16, 40, 64, 72, 136, 256]), causal=st.booleans(),
       left=st.integers(-1, 12), right=st.integers(-1, 4), softcap=st.sampled_from([0.0, 2.5]),
       page_size=st.integers(1, 9), dtype=DTYPES, seed=st.integers(0, 2**31 - 1))
def test_attention_random(layout, q_lens, extra_k, num_kv_heads, group, head_dim, causal, left,
                          right, softcap, page_size, dtype, seed):
  k_lens = [max(0, n + extra_k) for n in q_lens]
  if layout == "dense":
    q_lens, k_lens = [max(q_lens)] * len(q_lens), [max(k_lens)] * len(k_lens)
  q, k, v, arrays = make_case(layout, seed=seed, q_lens=q_lens, k_lens=k_lens,
                              num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, dtype=dtype, page_size=page_size)
  flags = dict(causal=causal, window=(left, 0 if causal else right), softcap=softcap)
  got = jax_sgl.attention(q, k, v, **flags, **arrays)
  want = reference_attention(q, k, v, **flags, **arrays)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=TOL[dtype], atol=TOL[dtype])
