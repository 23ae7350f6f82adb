"""rope_pool_fused into an e4m3 pool on the CUDA backend against the CPU kernel: k_rot within the
dtype's rounding, and bit for bit the quantized bytes of that k_rot and of v (IEEE x / scale,
round to nearest even, saturating at +-448) in every written row, every other byte of a NaN-poisoned pool untouched. Vectorized
(16-byte and 8-byte pool stores) and scalar layouts, NeoX and interleaved pairs, separate pools and
the fused kv_buffer, per-tensor and per-KV-head scales.

Every test first asserts that the call lowers to the native CUDA kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl

pytestmark = pytest.mark.gpu

TARGET = "jax_sgl_rope_pool_fwd"
E4M3 = jnp.float8_e4m3fn
TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.float16): 2e-3, jnp.dtype(jnp.bfloat16): 1.6e-2}


@pytest.fixture(scope="module")
def devices():
  return jax.devices("cuda")[0], jax.devices("cpu")[0]


def u8(x):
  return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8))


def make_inputs(seed, tokens, hq, hkv, d, num_slots, dtype, pool_shape):
  rng = np.random.default_rng(seed)
  # Magnitudes up to ~40 with scales ~0.05 reach past 448: saturation is exercised too.
  f = lambda mag, *s: jnp.asarray(rng.standard_normal(s) * mag, jnp.float32).astype(dtype)
  q, k, v = f(1.0, tokens, hq, d), f(8.0, tokens, hkv, d), f(8.0, tokens, hkv, d)
  positions = jnp.asarray(rng.integers(0, 32768, tokens), jnp.int32)
  slots = rng.permutation(num_slots + tokens)[:tokens] - tokens // 4   # padding and past the end
  pool = jax.lax.bitcast_convert_type(jnp.full(pool_shape, 0x7f, jnp.uint8), E4M3)   # NaN bytes
  return q, k, v, positions, jnp.asarray(slots, jnp.int32), pool


def run_on(device, fn, args):
  args = [jax.device_put(a, device) for a in args]
  return jax.jit(fn)(*args)


def compare(devices, fn, args):
  """q_rot / k_rot as the CPU kernel's within the dtype's rounding (sin/cos differ by ulps between
  the two); every pool byte as the CPU kernel writes it from the GPU's own k_rot: the CPU run at
  position 0 (cos 1, sin 0: k_rot passes unrotated) quantizes the same values, so the quantizing
  write is checked bit for bit, padding slots and untouched NaN bytes included."""
  gpu, cpu = devices
  assert TARGET in jax.jit(fn).lower(*[jax.device_put(a, gpu) for a in args]).as_text()
  q, _, v, positions, *rest = args
  got = run_on(gpu, fn, args)
  want = run_on(cpu, fn, args)
  tol = TOL[jnp.dtype(q.dtype)]
  for g, w in zip(got[:2], want[:2]):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol,
                               atol=tol)
  k_rot = jax.device_put(got[1], cpu)
  want = run_on(cpu, fn, (q, k_rot, v, jnp.zeros_like(positions), *rest))
  for g, w in zip(got[2:], want[2:]):
    assert g.dtype == w.dtype == E4M3 and g.shape == w.shape
    np.testing.assert_array_equal(u8(g), u8(w))


SCALES = {"tensor": lambda hkv: (np.float32(0.05), np.float32(0.03)),
          "per_head": lambda hkv: (np.linspace(0.02, 0.09, hkv, dtype=np.float32),
                                   np.linspace(0.05, 0.01, hkv, dtype=np.float32))}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 128), (128, 64), (64, 32), (72, 24),
                                                 (66, 34)])
@pytest.mark.parametrize("scales", list(SCALES))
def test_separate_pools(devices, dtype, is_neox, head_dim, rotary_dim, scales):
  hkv = 4
  q, k, v, pos, slots, pool = make_inputs(1, 77, 16, hkv, head_dim, 256, dtype,
                                          (256, hkv, head_dim))
  ks, vs = SCALES[scales](hkv)
  fn = lambda q, k, v, p, s, kp, vp: jax_sgl.rope_pool_fused(
      q, k, v, p, s, kp, vp, rotary_dim=rotary_dim, is_neox=is_neox, k_scale=ks, v_scale=vs)
  compare(devices, fn, (q, k, v, pos, slots, pool, pool))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim_pad", [128, 136, 130])   # 16-byte, 8-byte and 1-byte stores
def test_kv_buffer(devices, dtype, is_neox, head_dim_pad):
  hkv, d = 8, 128
  q, k, v, pos, slots, buf = make_inputs(2, 300, 32, hkv, d, 64 * 16, dtype,
                                         (64, 16, 2 * hkv, head_dim_pad))
  ks, vs = SCALES["per_head"](hkv)
  fn = lambda q, k, v, p, s, b: jax_sgl.rope_pool_fused(q, k, v, p, s, kv_buffer=b,
                                                        is_neox=is_neox, k_scale=ks, v_scale=vs)
  compare(devices, fn, (q, k, v, pos, slots, buf))


@pytest.mark.parametrize("v_scale", [1.0, float.fromhex("0x1.e18c6ap-19")])
def test_specials(devices, v_scale):
  """inf and NaN in v: +-448 and NaN, as on the CPU; a quotient that overflows float32 (the second
  scale makes one of v's values exactly -2^128 / scale's rounding) saturates too."""
  q, k, v, pos, _, pool = make_inputs(3, 4, 4, 2, 64, 8, jnp.float32, (8, 2, 64))
  v = v.at[0, 0, :6].set(jnp.array([jnp.inf, -jnp.inf, jnp.nan, 1e30, float.fromhex(
      "-0x1.e18c6ap+109"), 3.4e38], jnp.float32))
  slots = jnp.arange(4, dtype=jnp.int32)
  fn = lambda q, k, v, p, s, kp, vp: jax_sgl.rope_pool_fused(q, k, v, p, s, kp, vp,
                                                             k_scale=1.0, v_scale=v_scale)
  compare(devices, fn, (q, k, v, pos, slots, pool, pool))
