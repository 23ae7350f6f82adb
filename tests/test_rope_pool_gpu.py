"""rope_pool_fused on the CUDA backend vs the float32 reference: dtypes, index types, NeoX and
interleaved pairs, partial rotary dims and the unvectorized layouts, odd token counts, padding and
out-of-range slots, poisoned pools (every row not written must stay bit-identical), donation.

Every test runs on the first CUDA device and first asserts that the native CUDA kernel (not the
reference fallback) is what the op lowers to."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from jax_sgl import reference

pytestmark = pytest.mark.gpu

TARGET = "jax_sgl_rope_pool_fwd"
TOL = {jnp.float32: 2e-5, jnp.float16: 2e-3, jnp.bfloat16: 1.6e-2}
UINT = {jnp.float32: jnp.uint32, jnp.float16: jnp.uint16, jnp.bfloat16: jnp.uint16}


@pytest.fixture(scope="module")
def gpu():
  return jax.devices("cuda")[0]


def poison(rng, shape, dtype):
  """Random bit patterns (NaNs and infs included): rows the kernel must not touch stay
  distinguishable from anything it could write, and are compared bit for bit."""
  bits = rng.integers(0, np.iinfo(np.dtype(UINT[dtype])).max, shape, dtype=np.uint64)
  return jax.lax.bitcast_convert_type(jnp.asarray(bits.astype(np.dtype(UINT[dtype]))), dtype)


def make_inputs(gpu, seed, num_tokens, hq, hkv, d, num_slots, dtype, index_dtype=jnp.int32,
                max_pos=32768, bad_slots=True):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(dtype)
  q, k, v = f(num_tokens, hq, d), f(num_tokens, hkv, d), f(num_tokens, hkv, d)
  positions = rng.integers(0, max_pos, num_tokens)
  # Distinct slots (duplicates race, as in any scatter); with bad_slots about a quarter are padding
  # (negative) and some are >= num_slots.
  shift = num_tokens // 4 if bad_slots else 0
  extra = num_tokens if bad_slots else 0
  slots = rng.permutation(num_slots + extra)[:num_tokens] - shift
  k_pool, v_pool = poison(rng, (num_slots, hkv, d), dtype), poison(rng, (num_slots, hkv, d), dtype)
  args = (q, k, v, jnp.asarray(positions, index_dtype), jnp.asarray(slots, index_dtype),
          k_pool, v_pool)
  return tuple(jax.device_put(a, gpu) for a in args)


def bits(x):
  return np.asarray(jax.lax.bitcast_convert_type(x, UINT[x.dtype.type]))


def check(args, **kwargs):
  """Native result vs reference; pool rows bit-exact: written rows hold exactly k_rot / v, every
  other row is the poisoned input."""
  fn = jax.jit(functools.partial(jax_sgl.rope_pool_fused, **kwargs))
  assert TARGET in fn.lower(*args).as_text(), "did not lower to the native CUDA kernel"
  got = fn(*args)
  want = reference.rope_pool_fused(*args, **kwargs)
  dtype = args[0].dtype.type
  for g, w, name in zip(got[:2], want[:2], ("q_rot", "k_rot")):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=TOL[dtype], atol=TOL[dtype], err_msg=name)
  _, k_rot, k_out, v_out = got
  v, slots, k_pool, v_pool = args[2], np.asarray(args[4]), args[5], args[6]
  num_slots = k_pool.shape[0]
  valid = (slots >= 0) & (slots < num_slots)
  rows = slots[valid]
  untouched = np.setdiff1d(np.arange(num_slots), rows)
  np.testing.assert_array_equal(bits(k_out)[untouched], bits(k_pool)[untouched])
  np.testing.assert_array_equal(bits(v_out)[untouched], bits(v_pool)[untouched])
  np.testing.assert_array_equal(bits(k_out)[rows], bits(k_rot)[valid])
  np.testing.assert_array_equal(bits(v_out)[rows], bits(v)[valid])
  return got


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 33, 1000])
def test_matches_reference(gpu, dtype, num_tokens):
  check(make_inputs(gpu, num_tokens, num_tokens, 32, 8, 128, num_slots=3000, dtype=dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("index_dtype", [jnp.int32, jnp.int64])
@pytest.mark.parametrize("is_neox", [True, False])
def test_index_dtypes_and_styles(gpu, dtype, index_dtype, is_neox):
  with jax.enable_x64(True):
    args = make_inputs(gpu, 2, 99, 8, 2, 128, num_slots=200, dtype=dtype,
                       index_dtype=index_dtype)
    assert args[4].dtype == index_dtype
    check(args, is_neox=is_neox)


# Vectorized (16-byte) layouts, a tail of an odd number of vectors, and the scalar fallback
# (head_dim or rotary_dim not a multiple of the vector width).
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 64), (136, 128), (80, 80), (256, 32),
                                                 (96, 2), (72, 24), (66, 34)])
def test_rotary_dims_and_layouts(gpu, dtype, is_neox, head_dim, rotary_dim):
  args = make_inputs(gpu, 3, 19, 4, 2, head_dim, num_slots=40, dtype=dtype)
  check(args, is_neox=is_neox, rotary_dim=rotary_dim, rope_base=500000.0)


def test_only_bad_slots_write_nothing(gpu):
  q, k, v, pos, _, k_pool, v_pool = make_inputs(gpu, 4, 6, 4, 2, 64, num_slots=10,
                                                dtype=jnp.bfloat16)
  slots = jax.device_put(jnp.array([-1, 10, -7, 11, 1000, -2**31], jnp.int32), gpu)
  _, _, k_out, v_out = check((q, k, v, pos, slots, k_pool, v_pool))
  np.testing.assert_array_equal(bits(k_out), bits(k_pool))
  np.testing.assert_array_equal(bits(v_out), bits(v_pool))


def test_int64_slot_beyond_int32_is_not_written(gpu):
  # 2**32 + 3 would alias slot 3 if the kernel truncated int64 slots to int32.
  with jax.enable_x64(True):
    q, k, v, pos, _, k_pool, v_pool = make_inputs(gpu, 5, 2, 2, 2, 64, num_slots=8,
                                                  dtype=jnp.float32, index_dtype=jnp.int64)
    slots = jax.device_put(jnp.array([2**32 + 3, 5], jnp.int64), gpu)
    check((q, k, v, pos, slots, k_pool, v_pool))


def test_large_positions(gpu):
  # Angles past float32 sincos's fast range reduction (|x| > 1e5) still match the reference.
  check(make_inputs(gpu, 6, 33, 8, 2, 128, num_slots=64, dtype=jnp.bfloat16, max_pos=1 << 22))


def test_donated_pools_are_written_in_place(gpu):
  args = make_inputs(gpu, 7, 1000, 32, 8, 128, num_slots=4096, dtype=jnp.bfloat16)
  q, k, v, pos, slots, k_pool, v_pool = args
  k_before, v_before = bits(k_pool), bits(v_pool)
  want = reference.rope_pool_fused(*args)
  k_ptr, v_ptr = k_pool.unsafe_buffer_pointer(), v_pool.unsafe_buffer_pointer()
  f = jax.jit(jax_sgl.rope_pool_fused, donate_argnums=(5, 6))
  _, k_rot, k_out, v_out = f(*args)
  assert k_pool.is_deleted() and v_pool.is_deleted()
  assert k_out.unsafe_buffer_pointer() == k_ptr and v_out.unsafe_buffer_pointer() == v_ptr
  s = np.asarray(slots)
  valid = (s >= 0) & (s < 4096)
  untouched = np.setdiff1d(np.arange(4096), s[valid])
  np.testing.assert_array_equal(bits(k_out)[untouched], k_before[untouched])
  np.testing.assert_array_equal(bits(v_out)[untouched], v_before[untouched])
  np.testing.assert_array_equal(bits(k_out)[s[valid]], bits(k_rot)[valid])
  np.testing.assert_array_equal(bits(v_out)[s[valid]], bits(v)[valid])
  np.testing.assert_allclose(np.asarray(k_rot, np.float32), np.asarray(want[1], np.float32),
                             rtol=TOL[jnp.bfloat16], atol=TOL[jnp.bfloat16])


def test_without_donation_inputs_survive(gpu):
  args = make_inputs(gpu, 8, 33, 8, 2, 128, num_slots=64, dtype=jnp.float16)
  k_before, v_before = bits(args[5]), bits(args[6])
  check(args)
  np.testing.assert_array_equal(bits(args[5]), k_before)
  np.testing.assert_array_equal(bits(args[6]), v_before)


def test_repeated_calls_in_one_jit(gpu):
  """Two calls chained through the pools in one executable (the serving loop's shape; XLA may
  capture the custom calls in a command buffer, which the handler allows)."""
  a = make_inputs(gpu, 9, 33, 8, 2, 128, num_slots=128, dtype=jnp.bfloat16, bad_slots=False)
  b = make_inputs(gpu, 10, 33, 8, 2, 128, num_slots=128, dtype=jnp.bfloat16, bad_slots=False)
  b = b[:4] + (jax.device_put(jnp.asarray((np.asarray(a[4]) + 40) % 128, jnp.int32), gpu),)

  def two_steps(q1, k1, v1, p1, s1, q2, k2, v2, p2, s2, k_pool, v_pool):
    _, _, k_pool, v_pool = jax_sgl.rope_pool_fused(q1, k1, v1, p1, s1, k_pool, v_pool)
    return jax_sgl.rope_pool_fused(q2, k2, v2, p2, s2, k_pool, v_pool)

  got = jax.jit(two_steps, donate_argnums=(10, 11))(*a[:5], *b, jnp.copy(a[5]), jnp.copy(a[6]))
  _, _, k_ref, v_ref = reference.rope_pool_fused(*a)
  want = reference.rope_pool_fused(*b, k_ref, v_ref)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=TOL[jnp.bfloat16], atol=TOL[jnp.bfloat16])
