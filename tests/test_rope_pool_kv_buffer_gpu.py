"""rope_pool_fused on the CUDA backend into sglang-jax's fused K/V buffer (`kv_buffer=`) with a
llama3-style inv_freq: the vectorized and scalar kernels, 5-D/4-D/3-D buffers, page sizes 1, 5 and
16, padded head dims, both rotation styles and partial rotary, against the float32 reference; the
buffer is poisoned with random bit patterns and compared bit for bit (pad columns and unwritten
rows unchanged). Donation keeps the buffer in place.

Every test runs on the first CUDA device and first asserts that the native CUDA kernel (not the
reference fallback) is what the op lowers to."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from jax_sgl import reference
from test_rope_pool_gpu import TARGET, gpu  # noqa: F401 (gpu: the device fixture)
from test_rope_pool_kv_buffer import TOL, UINT, buffer_shape, llama3_inv_freq, rows

pytestmark = pytest.mark.gpu


def make_case(gpu, seed, num_tokens, hq, hkv, d, d_pad, num_pages, page_size, form, dtype):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(dtype)
  q, k, v = f(num_tokens, hq, d), f(num_tokens, hkv, d), f(num_tokens, hkv, d)
  positions = jnp.asarray(rng.integers(0, 65536, num_tokens), jnp.int32)
  num_slots = num_pages * page_size
  slots = jnp.asarray(rng.permutation(num_slots + num_tokens)[:num_tokens] - num_tokens // 4,
                      jnp.int32)
  shape = buffer_shape(form, num_pages, page_size, hkv, d_pad)
  u = UINT[dtype]
  poison = rng.integers(0, np.iinfo(u).max, shape, dtype=np.uint64).astype(u)
  kv_buffer = jax.lax.bitcast_convert_type(jnp.asarray(poison), dtype)
  return tuple(jax.device_put(a, gpu) for a in (q, k, v, positions, slots, kv_buffer))


def check(args, donate=False, **kwargs):
  q, k, v, positions, slots, kv_buffer = args
  dtype, d = q.dtype.type, q.shape[-1]
  before = rows(jax.lax.bitcast_convert_type(kv_buffer, UINT[dtype])).copy()
  want = reference.rope_pool_fused(q, k, v, positions, slots, kv_buffer=kv_buffer, **kwargs)
  fn = jax.jit(lambda q, k, v, p, s, b: jax_sgl.rope_pool_fused(q, k, v, p, s, kv_buffer=b,
                                                                **kwargs),
               donate_argnums=(5,) if donate else ())
  assert TARGET in fn.lower(*args).as_text(), "did not lower to the native CUDA kernel"
  ptr = kv_buffer.unsafe_buffer_pointer()
  q_rot, k_rot, out = fn(*args)
  if donate:
    assert kv_buffer.is_deleted() and out.unsafe_buffer_pointer() == ptr
  for g, w, name in zip((q_rot, k_rot), want[:2], ("q_rot", "k_rot")):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=TOL[dtype], atol=TOL[dtype], err_msg=name)
  s = np.asarray(slots)
  valid = (s >= 0) & (s < before.shape[0])
  expect = before.copy()
  expect[s[valid], 0::2, :d] = np.asarray(k_rot).view(UINT[dtype])[valid]
  expect[s[valid], 1::2, :d] = np.asarray(v).view(UINT[dtype])[valid]
  np.testing.assert_array_equal(rows(jax.lax.bitcast_convert_type(out, UINT[dtype])), expect)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("form,page_size,num_pages,hq,hkv,d,d_pad,num_tokens", [
    ("3d", 1, 3000, 32, 8, 128, 128, 1000),   # vectorized, unpadded
    ("4d", 5, 40, 8, 2, 64, 128, 99),         # vectorized, padded
    ("5d", 16, 64, 32, 8, 128, 128, 1000),    # sglang-jax's form
    ("5d", 1, 64, 8, 2, 66, 128, 33),         # scalar fallback (head dim 66)
])
def test_matches_reference(gpu, dtype, form, page_size, num_pages, hq, hkv, d, d_pad,
                           num_tokens):
  check(make_case(gpu, num_tokens, num_tokens, hq, hkv, d, d_pad, num_pages, page_size, form,
                  dtype))


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [None, 64, 34])
def test_llama3_inv_freq_partial_rotary_and_styles(gpu, is_neox, rotary_dim):
  args = make_case(gpu, 1, 33, 8, 2, 128, 128, 8, 16, "5d", jnp.bfloat16)
  inv_freq = jax.device_put(jnp.asarray(llama3_inv_freq(rotary_dim or 128)), gpu)
  check(args, inv_freq=inv_freq, rotary_dim=rotary_dim, is_neox=is_neox)


def test_donated_buffer_is_written_in_place(gpu):
  check(make_case(gpu, 2, 1000, 32, 8, 128, 128, 256, 16, "5d", jnp.bfloat16), donate=True)
