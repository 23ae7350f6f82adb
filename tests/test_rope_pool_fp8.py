"""rope_pool_fused into a float8_e4m3fn KV pool (jax_sgl's fp8 KV cache) on the CPU: the stored
bytes against a float64 model of e4m3 rounding (x / scale in float32, round to nearest even,
saturating at +-448, NaN stays NaN), per-tensor and per-KV-head scales, separate pools and the
fused kv_buffer, NaN-poisoned pools (every byte not written stays as it was), the reference
bit for bit, vmap, and every bad-input error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from jax_sgl import reference
from test_rope_pool import assert_matches_reference

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
E4M3_NAN = 0x7f
SEED_POOL_DTYPE = "pool dtypes must match q/k/v dtype"


def e4m3_model(y):
  """float64 model of e4m3fn rounding: nearest of the grid 2^(e - 3) (e >= -6: subnormals share
  2^-9), ties to even (np.round), saturating at 448; NaN stays NaN."""
  y = np.asarray(y, np.float64)
  a = np.abs(y)
  e = np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), -6.0)
  quantum = np.exp2(e - 3)
  with np.errstate(invalid="ignore"):
    r = np.minimum(np.round(a / quantum) * quantum, 448.0)
  r = np.where(np.isinf(a), 448.0, r)
  return np.where(np.isnan(y), np.nan, np.copysign(r, y))


def quantized_model(x, scale):
  """What the pool must hold for rows x [T, Hkv, D] (in the input dtype) and scale ([] or [Hkv]):
  the float32 quotient, then e4m3 rounding in float64."""
  s = np.broadcast_to(np.asarray(scale, np.float32).reshape(-1), (x.shape[1],))
  with np.errstate(over="ignore", invalid="ignore"):   # inf and NaN inputs are meant
    quotient = np.asarray(x, np.float32) / s[None, :, None]   # IEEE float32 division
  return e4m3_model(quotient)


def as_f64(x):
  return np.asarray(x).astype(np.float64)


def nan_pool(shape):
  """A pool of e4m3 NaN bytes: anything written is a number, anything untouched stays 0x7f."""
  return jax.lax.bitcast_convert_type(jnp.full(shape, E4M3_NAN, jnp.uint8), E4M3)


def u8(x):
  return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8))


def make_inputs(seed, *, tokens=13, hq=8, hkv=2, d=64, num_slots=24, dtype=jnp.bfloat16,
                k_mag=8.0, v_mag=8.0):
  """Fresh random q/k/v (never zeros) and slots: distinct, with padding (-1) and some past the
  pool (>= num_slots)."""
  rng = np.random.default_rng(seed)
  f = lambda mag, *s: jnp.asarray(rng.standard_normal(s) * mag, jnp.float32).astype(dtype)
  q, k, v = f(1.0, tokens, hq, d), f(k_mag, tokens, hkv, d), f(v_mag, tokens, hkv, d)
  positions = jnp.asarray(rng.integers(0, 4096, tokens), jnp.int32)
  slots = rng.permutation(num_slots + 6)[:tokens]
  slots[rng.random(tokens) < 0.2] = -1
  return q, k, v, positions, jnp.asarray(slots, jnp.int32)


def check_pool(pool_out, pool_in, rows_want, slots, num_slots):
  """Rows at valid slots hold exactly rows_want (the model's values, NaN where NaN); every other
  row keeps pool_in's bytes."""
  slots = np.asarray(slots)
  valid = (slots >= 0) & (slots < num_slots)
  got = as_f64(pool_out)[slots[valid]]
  np.testing.assert_array_equal(got, rows_want[valid])
  untouched = np.setdiff1d(np.arange(num_slots), slots[valid])
  np.testing.assert_array_equal(u8(pool_out)[untouched], u8(pool_in)[untouched])


SCALES = {
    "tensor_0d": lambda hkv, rng: (np.float32(rng.uniform(0.01, 0.05)),
                                   np.float32(rng.uniform(0.01, 0.05))),
    "tensor_1": lambda hkv, rng: (rng.uniform(0.01, 0.05, 1).astype(np.float32),
                                  rng.uniform(0.01, 0.05, 1).astype(np.float32)),
    "per_head": lambda hkv, rng: (rng.uniform(0.005, 0.05, hkv).astype(np.float32),
                                  rng.uniform(0.005, 0.05, hkv).astype(np.float32)),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("scales", list(SCALES))
@pytest.mark.parametrize("is_neox", [True, False])
def test_separate_pools_quantized_exactly(dtype, scales, is_neox):
  rng = np.random.default_rng(1)
  q, k, v, pos, slots = make_inputs(2, dtype=dtype)
  ks, vs = SCALES[scales](2, rng)
  k_pool, v_pool = nan_pool((24, 2, 64)), nan_pool((24, 2, 64))
  q_rot, k_rot, k_out, v_out = jax_sgl.rope_pool_fused(q, k, v, pos, slots, k_pool, v_pool,
                                                       is_neox=is_neox, k_scale=ks, v_scale=vs)
  assert q_rot.dtype == dtype and k_rot.dtype == dtype
  assert k_out.dtype == E4M3 and v_out.dtype == E4M3
  # k_rot is what the bf16 pool would get; the fp8 pool stores it quantized.
  want = reference.rope_pool_fused(q, k, v, pos, slots, jnp.zeros((24, 2, 64), dtype),
                                   jnp.zeros((24, 2, 64), dtype), is_neox=is_neox)
  assert_matches_reference(k_rot, want[1], "k_rot")
  assert_matches_reference(q_rot, want[0], "q_rot")
  check_pool(k_out, k_pool, quantized_model(k_rot, ks), slots, 24)
  check_pool(v_out, v_pool, quantized_model(v, vs), slots, 24)
  # The pure-JAX reference quantizes the same way: its pools hold the model of its own k_rot
  # (equal to ours in bf16 / fp16, within an ulp in float32: assert_matches_reference).
  ref = reference.rope_pool_fused(q, k, v, pos, slots, k_pool, v_pool, is_neox=is_neox,
                                  k_scale=ks, v_scale=vs)
  check_pool(ref[2], k_pool, quantized_model(want[1], ks), slots, 24)
  check_pool(ref[3], v_pool, quantized_model(v, vs), slots, 24)


def test_saturation_and_specials():
  """|x / scale| >= 448 stores +-448 (infinities too), NaN stays NaN, ties round to even, tiny
  values become subnormals or signed zeros."""
  hkv, d = 2, 64
  q, k, v, pos, _ = make_inputs(3, tokens=4, hkv=hkv, d=d, dtype=jnp.float32)
  special = np.array([448.0, 449.0, 464.0, 465.0, 1e6, np.inf, -np.inf, np.nan, -500.0,
                      12.5, 13.5, 2.0 ** -10, -(2.0 ** -10), 2.0 ** -12, 3 * 2.0 ** -10, 0.5],
                     np.float32)  # 12.5, 13.5: ties (12 | 13, 13 | 14)
  v_np = np.asarray(v).copy()
  v_np[0, 0, :special.size] = special
  v_np[1, 1, :special.size] = -special
  v = jnp.asarray(v_np)
  slots = jnp.asarray([0, 1, 2, 3], jnp.int32)
  ones = np.float32(1.0)
  _, _, _, v_out = jax_sgl.rope_pool_fused(q, k, v, pos, slots, nan_pool((4, hkv, d)),
                                           nan_pool((4, hkv, d)), k_scale=ones, v_scale=ones)
  got = as_f64(v_out)
  np.testing.assert_array_equal(got[0, 0, :special.size], e4m3_model(special))
  np.testing.assert_array_equal(got[1, 1, :special.size], e4m3_model(-special))
  assert got[0, 0, :6].tolist() == [448.0] * 6 and got[0, 0, 6] == -448.0
  assert np.isnan(got[0, 0, 7]) and got[0, 0, 8] == -448.0
  assert got[0, 0, 9] == 12.0 and got[0, 0, 10] == 14.0   # to the even mantissa
  np.testing.assert_array_equal(got, quantized_model(v, ones))
  # Saturation through the scale: |x| up to 40 with scale 0.05 reaches 800.
  q, k, v, pos, slots = make_inputs(4, k_mag=20.0, v_mag=20.0)
  _, k_rot, k_out, v_out = jax_sgl.rope_pool_fused(q, k, v, pos, slots, nan_pool((24, 2, 64)),
                                                   nan_pool((24, 2, 64)),
                                                   k_scale=np.float32(0.05),
                                                   v_scale=np.float32(0.05))
  valid = (np.asarray(slots) >= 0) & (np.asarray(slots) < 24)
  assert np.abs(as_f64(v_out)[np.asarray(slots)[valid]]).max() == 448.0
  check_pool(k_out, nan_pool((24, 2, 64)), quantized_model(k_rot, 0.05), slots, 24)


@pytest.mark.parametrize("rank", [3, 4, 5])
@pytest.mark.parametrize("scales", ["tensor_0d", "per_head"])
def test_kv_buffer_quantized_exactly(rank, scales):
  """The fused buffer: K head h at 2h, V at 2h + 1, features [D, Dp) and every other row stay
  NaN bytes."""
  rng = np.random.default_rng(5)
  hkv, d, dp, page = 2, 64, 128, 4
  q, k, v, pos, slots = make_inputs(6, hkv=hkv, d=d, num_slots=24)
  ks, vs = SCALES[scales](hkv, rng)
  shape = {3: (24, 2 * hkv, dp), 4: (6, page, 2 * hkv, dp), 5: (6, page, 2 * hkv, 1, dp)}[rank]
  buf = nan_pool(shape)
  _, k_rot, out = jax_sgl.rope_pool_fused(q, k, v, pos, slots, kv_buffer=buf, k_scale=ks,
                                          v_scale=vs)
  assert out.shape == shape and out.dtype == E4M3
  rows_in = u8(buf).reshape(24, 2 * hkv, dp)
  rows = as_f64(out).reshape(24, 2 * hkv, dp)
  s = np.asarray(slots)
  valid = (s >= 0) & (s < 24)
  np.testing.assert_array_equal(rows[s[valid]][:, 0::2, :d], quantized_model(k_rot, ks)[valid])
  np.testing.assert_array_equal(rows[s[valid]][:, 1::2, :d], quantized_model(v, vs)[valid])
  out_u8 = u8(out).reshape(24, 2 * hkv, dp)
  np.testing.assert_array_equal(out_u8[:, :, d:], rows_in[:, :, d:])
  untouched = np.setdiff1d(np.arange(24), s[valid])
  np.testing.assert_array_equal(out_u8[untouched], rows_in[untouched])
  ref = reference.rope_pool_fused(q, k, v, pos, slots, kv_buffer=buf, k_scale=ks, v_scale=vs)
  np.testing.assert_array_equal(u8(out), u8(ref[2]))


def test_scales_are_traced_operands_and_donation_works():
  """Scales are runtime values (one compiled program serves every scale), and a donated pool is
  written in place."""
  q, k, v, pos, slots = make_inputs(7)
  f = jax.jit(lambda q, k, v, p, s, kp, vp, ks, vs: jax_sgl.rope_pool_fused(
      q, k, v, p, s, kp, vp, k_scale=ks, v_scale=vs), donate_argnums=(5, 6))
  for seed, scale in ((0, 0.02), (1, 0.03)):
    ks = jnp.full((2,), scale, jnp.float32)
    _, k_rot, k_out, v_out = f(q, k, v, pos, slots, nan_pool((24, 2, 64)), nan_pool((24, 2, 64)),
                               ks, ks * 2)
    check_pool(k_out, nan_pool((24, 2, 64)), quantized_model(k_rot, ks), slots, 24)
    check_pool(v_out, nan_pool((24, 2, 64)), quantized_model(v, ks * 2), slots, 24)


def test_vmap_shares_the_scales():
  cases = [make_inputs(10 + i) for i in range(3)]
  q, k, v, pos, slots = (jnp.stack(xs) for xs in zip(*cases))
  ks, vs = np.float32([0.02, 0.04]), np.float32(0.03)
  pools = nan_pool((3, 24, 2, 64))
  got = jax.vmap(lambda q, k, v, p, s, kp, vp: jax_sgl.rope_pool_fused(
      q, k, v, p, s, kp, vp, k_scale=ks, v_scale=vs))(q, k, v, pos, slots, pools, pools)
  for i, (qi, ki, vi, pi, si) in enumerate(cases):
    want = reference.rope_pool_fused(qi, ki, vi, pi, si, pools[i], pools[i], k_scale=ks,
                                     v_scale=vs)
    np.testing.assert_array_equal(u8(got[2][i]), u8(want[2]))
    np.testing.assert_array_equal(u8(got[3][i]), u8(want[3]))
  with pytest.raises(NotImplementedError, match="vmap over k_scale/v_scale"):
    jax.vmap(lambda q, k, v, p, s, kp, vp, ks: jax_sgl.rope_pool_fused(
        q, k, v, p, s, kp, vp, k_scale=ks, v_scale=ks))(q, k, v, pos, slots, pools, pools,
                                                        jnp.ones((3, 2), jnp.float32))


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

def _errors_case():
  q, k, v, pos, slots = make_inputs(20)
  return q, k, v, pos, slots, nan_pool((24, 2, 64))


def test_fp8_pool_without_scales_keeps_the_seed_error():
  q, k, v, pos, slots, pool = _errors_case()
  with pytest.raises(ValueError) as e:
    jax_sgl.rope_pool_fused(q, k, v, pos, slots, pool, pool)
  assert str(e.value) == SEED_POOL_DTYPE
  with pytest.raises(ValueError) as e:
    jax_sgl.rope_pool_fused(q, k, v, pos, slots, kv_buffer=nan_pool((24, 4, 64)))
  assert str(e.value) == SEED_POOL_DTYPE


@pytest.mark.parametrize("given", ["k_scale", "v_scale"])
def test_one_scale_missing(given):
  q, k, v, pos, slots, pool = _errors_case()
  with pytest.raises(ValueError, match="needs both k_scale and v_scale, got only " + given):
    jax_sgl.rope_pool_fused(q, k, v, pos, slots, pool, pool, **{given: np.float32(0.1)})


def test_scales_for_a_16_bit_pool():
  q, k, v, pos, slots, _ = _errors_case()
  pool = jnp.zeros((24, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="apply to a float8_e4m3fn pool only.*bfloat16 pool"):
    jax_sgl.rope_pool_fused(q, k, v, pos, slots, pool, pool, k_scale=1.0, v_scale=1.0)


def test_e5m2_pool_is_not_served():
  q, k, v, pos, slots, _ = _errors_case()
  pool = jnp.zeros((24, 2, 64), E5M2)
  with pytest.raises(NotImplementedError, match="float8_e4m3fn only.*float8_e5m2 pool"):
    jax_sgl.rope_pool_fused(q, k, v, pos, slots, pool, pool, k_scale=1.0, v_scale=1.0)


def test_mixed_pool_dtypes_with_scales():
  q, k, v, pos, slots, pool = _errors_case()
  with pytest.raises(ValueError, match="k_pool and v_pool must have one dtype"):
    jax_sgl.rope_pool_fused(q, k, v, pos, slots, pool, jnp.zeros((24, 2, 64), jnp.bfloat16),
                            k_scale=1.0, v_scale=1.0)


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad,err,msg", [
    (jnp.ones((2,), jnp.float16), TypeError, "float32, got float16"),
    (jnp.ones((2,), jnp.bfloat16), TypeError, "float32, got bfloat16"),
    (jnp.ones((3,), jnp.float32), ValueError, r"per KV head \[num_kv_heads\] = \(2,\), got \(3,\)"),
    (jnp.ones((1, 2), jnp.float32), ValueError, r"got \(1, 2\)"),
    (jnp.ones((2, 2), jnp.float32), ValueError, r"got \(2, 2\)"),
])
def test_bad_scales(name, bad, err, msg):
  q, k, v, pos, slots, pool = _errors_case()
  scales = dict(k_scale=jnp.ones((2,), jnp.float32), v_scale=jnp.ones((), jnp.float32))
  scales[name] = bad
  with pytest.raises(err, match=f"jax_sgl.rope_pool_fused: {name} must be .*{msg}"):
    jax_sgl.rope_pool_fused(q, k, v, pos, slots, pool, pool, **scales)


def test_errors_at_trace_time():
  """The checks run on shapes: eval_shape raises them without running a kernel."""
  q, k, v, pos, slots, pool = _errors_case()
  with pytest.raises(NotImplementedError, match="e4m3fn only"):
    jax.eval_shape(lambda p: jax_sgl.rope_pool_fused(q, k, v, pos, slots, p, p, k_scale=1.0,
                                                     v_scale=1.0),
                   jax.ShapeDtypeStruct((24, 2, 64), E5M2))


def test_rounding_over_random_float32_bit_patterns():
  """The CPU kernel's float32 -> e4m3 against the model on 2^16 random bit patterns of v (every
  exponent: subnormals, values past 448, infinities and NaNs), scale 1 and a scale that is not a
  power of two."""
  rng = np.random.default_rng(30)
  tokens, hkv, d = 512, 2, 64
  bits = rng.integers(0, 2 ** 32, (tokens, hkv, d), dtype=np.uint64).astype(np.uint32)
  v = jnp.asarray(bits.view(np.float32))
  q = jnp.asarray(rng.standard_normal((tokens, 2, d)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((tokens, hkv, d)), jnp.float32)
  pos = jnp.zeros((tokens,), jnp.int32)
  slots = jnp.arange(tokens, dtype=jnp.int32)
  for scale in (np.float32(1.0), np.float32(0.37)):
    _, _, _, v_out = jax_sgl.rope_pool_fused(q, k, v, pos, slots, nan_pool((tokens, hkv, d)),
                                             nan_pool((tokens, hkv, d)), k_scale=scale,
                                             v_scale=scale)
    np.testing.assert_array_equal(as_f64(v_out), quantized_model(v, scale))
    assert (u8(v_out)[np.isnan(as_f64(v_out))] == E4M3_NAN).all()   # one NaN encoding
