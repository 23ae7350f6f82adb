"""rope_pool_fused on the default backend vs the float32 reference: dtypes, index types, rotation
styles, partial rotary dims, odd token counts, padding / out-of-range slots, jit, vmap, donation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from jax_sgl import reference

TOL = {jnp.float32: 2e-5, jnp.float16: 2e-3, jnp.bfloat16: 1.6e-2}


def assert_matches_reference(got, want, err_msg=""):
  """Ours against the pure-JAX reference's values (rotations, pools): bit for bit in float16 /
  bfloat16, where rounding to the input dtype absorbs the float32 math; within TOL in float32.
  XLA's CPU cos / sin were glibc's cosf / sinf through jax 0.12.0 (one ulp off the correctly
  rounded value for ~1.3% of angles) and are correctly rounded from 0.12.1, so a float32
  rotation matches one of them bit for bit, not both (the float64 oracle judges accuracy)."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype, err_msg
  if got.dtype == np.float32:
    np.testing.assert_allclose(got, want, rtol=TOL[jnp.float32], atol=TOL[jnp.float32],
                               err_msg=err_msg)
  else:
    np.testing.assert_array_equal(got.view(f"u{got.dtype.itemsize}"),
                                  want.view(f"u{want.dtype.itemsize}"), err_msg=err_msg)


def make_inputs(seed, num_tokens, hq, hkv, d, num_slots, dtype, index_dtype=jnp.int32,
                max_pos=4096):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(dtype)
  q, k, v = f(num_tokens, hq, d), f(num_tokens, hkv, d), f(num_tokens, hkv, d)
  positions = jnp.asarray(rng.integers(0, max_pos, num_tokens), index_dtype)
  # Distinct slots (duplicate slots race, as in any scatter), plus padding and out-of-range ones.
  slots = rng.permutation(num_slots + num_tokens)[:num_tokens] - num_tokens // 4
  slots = jnp.asarray(slots, index_dtype)
  k_pool, v_pool = f(num_slots, hkv, d), f(num_slots, hkv, d)
  return q, k, v, positions, slots, k_pool, v_pool


def assert_close(got, want, dtype):
  tol = TOL[dtype]
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=tol, atol=tol)


def check_against_reference(args, **kwargs):
  got = jax_sgl.rope_pool_fused(*args, **kwargs)
  want = reference.rope_pool_fused(*args, **kwargs)
  dtype = args[0].dtype.type
  for g, w, name in zip(got, want, ("q_rot", "k_rot", "k_pool", "v_pool")):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    assert_close(g, w, dtype)
  return got


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 33, 1000])
def test_matches_reference(dtype, num_tokens):
  args = make_inputs(num_tokens, num_tokens, 8, 2, 64, num_slots=1500, dtype=dtype)
  check_against_reference(args)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, None), (80, 80), (128, 64), (256, 32),
                                                 (96, 2)])
def test_rotation_styles(is_neox, head_dim, rotary_dim):
  args = make_inputs(3, 19, 4, 4, head_dim, num_slots=40, dtype=jnp.bfloat16)
  check_against_reference(args, is_neox=is_neox, rotary_dim=rotary_dim, rope_base=500000.0)


def test_rotation_by_hand():
  # One token, one head, position 1, base 1: every pair rotates by exactly 1 radian.
  x = jnp.arange(1, 9, dtype=jnp.float32).reshape(1, 1, 8)
  pool = jnp.zeros((2, 1, 8), jnp.float32)
  pos, slot = jnp.array([1], jnp.int32), jnp.array([1], jnp.int32)
  q_rot, *_ = jax_sgl.rope_pool_fused(x, x, x, pos, slot, pool, pool, rope_base=1.0)
  c, s = np.cos(1.0), np.sin(1.0)
  a, b = np.arange(1, 5.0), np.arange(5, 9.0)   # NeoX halves
  np.testing.assert_allclose(q_rot[0, 0], np.concatenate([a * c - b * s, b * c + a * s]),
                             rtol=1e-6)
  q_rot, *_ = jax_sgl.rope_pool_fused(x, x, x, pos, slot, pool, pool, rope_base=1.0,
                                      is_neox=False)
  a, b = np.arange(1, 9.0, 2), np.arange(2, 9.0, 2)   # interleaved pairs
  want = np.stack([a * c - b * s, b * c + a * s], -1).reshape(8)
  np.testing.assert_allclose(q_rot[0, 0], want, rtol=1e-6)


@pytest.mark.parametrize("index_dtype", [jnp.int32, jnp.int64])
def test_index_dtypes(index_dtype):
  with jax.enable_x64(True):
    args = make_inputs(5, 33, 8, 8, 64, num_slots=64, dtype=jnp.bfloat16,
                       index_dtype=index_dtype)
    assert args[4].dtype == index_dtype
    check_against_reference(args)


def test_int64_slot_beyond_int32_is_not_written():
  # 2**32 + 3 would alias slot 3 if the kernel truncated int64 slots to int32.
  with jax.enable_x64(True):
    q, k, v, pos, _, k_pool, v_pool = make_inputs(6, 2, 2, 2, 64, num_slots=8,
                                                  dtype=jnp.float32, index_dtype=jnp.int64)
    slots = jnp.array([2**32 + 3, 5], jnp.int64)
    _, k_rot, k_out, v_out = jax_sgl.rope_pool_fused(q, k, v, pos, slots, k_pool, v_pool)
  untouched = np.array([i for i in range(8) if i != 5])
  np.testing.assert_array_equal(k_out[untouched], k_pool[untouched])
  np.testing.assert_array_equal(v_out[untouched], v_pool[untouched])
  np.testing.assert_array_equal(k_out[5], k_rot[1])


def test_padding_and_out_of_range_slots_leave_pool_untouched():
  q, k, v, pos, _, k_pool, v_pool = make_inputs(7, 6, 4, 2, 64, num_slots=10, dtype=jnp.bfloat16)
  slots = jnp.array([-1, 3, 10, -7, 9, 1000], jnp.int32)
  _, k_rot, k_out, v_out = jax_sgl.rope_pool_fused(q, k, v, pos, slots, k_pool, v_pool)
  written = {3: 1, 9: 4}
  for row in range(10):
    if row in written:
      np.testing.assert_array_equal(k_out[row], k_rot[written[row]])
      np.testing.assert_array_equal(v_out[row], v[written[row]])
    else:
      np.testing.assert_array_equal(k_out[row], k_pool[row])
      np.testing.assert_array_equal(v_out[row], v_pool[row])


def test_check_slots_reports_out_of_range():
  args = list(make_inputs(8, 4, 2, 2, 64, num_slots=10, dtype=jnp.float32))
  args[4] = jnp.array([0, -1, 12, 3], jnp.int32)
  with pytest.raises(Exception, match=r"1 slot\(s\) are >= num_slots \(10\), first at token 2"):
    jax.block_until_ready(jax_sgl.rope_pool_fused(*args, check_slots=True))
  args[4] = jnp.array([0, -1, 9, 3], jnp.int32)
  jax.block_until_ready(jax_sgl.rope_pool_fused(*args, check_slots=True))


def test_jit_and_explicit_head_counts():
  args = make_inputs(9, 33, 8, 2, 128, num_slots=64, dtype=jnp.float16)
  f = jax.jit(functools.partial(jax_sgl.rope_pool_fused, head_dim=128, num_qo_heads=8,
                                num_kv_heads=2))
  want = reference.rope_pool_fused(*args)
  for g, w in zip(f(*args), want):
    assert_close(g, w, jnp.float16)


def test_donated_pools_are_written_in_place():
  q, k, v, pos, slots, k_pool, v_pool = make_inputs(10, 33, 8, 2, 64, num_slots=256,
                                                    dtype=jnp.bfloat16)
  # Copies made by XLA: a NumPy view of a CPU buffer would pin it and block donation.
  k_before, v_before = jnp.copy(k_pool), jnp.copy(v_pool)
  k_ptr = k_pool.unsafe_buffer_pointer()
  f = jax.jit(jax_sgl.rope_pool_fused, donate_argnums=(5, 6))
  _, k_rot, k_out, v_out = f(q, k, v, pos, slots, k_pool, v_pool)
  assert k_pool.is_deleted() and v_pool.is_deleted()
  assert k_out.unsafe_buffer_pointer() == k_ptr
  s = np.asarray(slots)
  valid = (s >= 0) & (s < 256)
  untouched = np.setdiff1d(np.arange(256), s[valid])
  np.testing.assert_array_equal(np.asarray(k_out)[untouched], np.asarray(k_before)[untouched])
  np.testing.assert_array_equal(np.asarray(v_out)[untouched], np.asarray(v_before)[untouched])
  np.testing.assert_array_equal(np.asarray(k_out)[s[valid]], np.asarray(k_rot)[valid])
  np.testing.assert_array_equal(np.asarray(v_out)[s[valid]], np.asarray(v)[valid])


def test_vmap_each_instance_owns_its_pool():
  batch = [make_inputs(20 + i, 7, 4, 2, 64, num_slots=12, dtype=jnp.float32) for i in range(3)]
  stacked = [jnp.stack(xs) for xs in zip(*batch)]
  got = jax.vmap(jax_sgl.rope_pool_fused)(*stacked)
  for i, args in enumerate(batch):
    want = reference.rope_pool_fused(*args)
    for g, w in zip(got, want):
      assert_close(g[i], w, jnp.float32)


def test_vmap_shared_pool_is_broadcast():
  q, k, v, pos, slots, k_pool, v_pool = make_inputs(30, 5, 2, 2, 64, num_slots=9,
                                                    dtype=jnp.float32)
  qs = jnp.stack([q, 2 * q])
  got = jax.vmap(jax_sgl.rope_pool_fused, in_axes=(0, None, None, None, None, None, None))(
      qs, k, v, pos, slots, k_pool, v_pool)
  for i in range(2):
    want = reference.rope_pool_fused(qs[i], k, v, pos, slots, k_pool, v_pool)
    for g, w in zip(got, want):
      assert_close(g[i], w, jnp.float32)


def test_eval_shape_runs_no_kernel():
  args = make_inputs(40, 7, 4, 2, 64, num_slots=12, dtype=jnp.bfloat16)
  shapes = jax.eval_shape(jax_sgl.rope_pool_fused, *args)
  assert [s.shape for s in shapes] == [(7, 4, 64), (7, 2, 64), (12, 2, 64), (12, 2, 64)]
