"""attention over a fused K/V buffer (`kv_buffer=`, sglang-jax's interleaved pool) on the CUDA
kernels: every kernel reads K and V through the params' strides, so each path gets the buffer with
NaN wherever a correct kernel never reads (padding features D..head_dim_pad, unnamed pages, page
tails), against the reference on K/V sliced out of it and a float64 oracle (kv_buffer_cases.py).

Paths (picked by shape and device, docs/kernels.md): the warp-sliced decode kernels (1 q row per
sequence, at most 16 packed rows: TMA on sm_90 for pages of a multiple of 16 keys, else cp.async),
the block-wide decode kernel (more packed rows), the sm90 paged prefill (>= 64 q rows per sequence,
pages of 16 / 64 keys, head dims 64 / 128) and the portable sm80 kernel (page size 5)."""

import zlib

import jax.numpy as jnp
import pytest

from attention_cases import turn_off_xla_autotuning
from kv_buffer_cases import check_buffer_case, make_buffer_case

pytestmark = pytest.mark.gpu

turn_off_xla_autotuning()

TOL = {jnp.dtype(jnp.bfloat16): 2.5e-2, jnp.dtype(jnp.float16): 4e-3}


def _seed(*parts):
  return zlib.crc32(repr(parts).encode())


def _check(q, buf, k, v, arrays, **flags):
  return check_buffer_case(q, buf, k, v, arrays, tol=TOL[jnp.dtype(q.dtype)], **flags)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("heads", [(8, 2), (32, 8), (32, 1)], ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode(page_size, heads, dtype):
  """One q row per sequence: the warp-sliced forms (group <= 16) and the block kernel (32x1)."""
  q, buf, k, v, arrays = make_buffer_case(
      seed=_seed("decode", page_size, heads), q_lens=[1] * 6, k_lens=[1, 17, 300, 64, 1000, 33],
      num_heads=heads[0], num_kv_heads=heads[1], head_dim=128, head_dim_pad=128,
      page_size=page_size, dtype=dtype, dense_q=True, form="3d" if page_size == 1 else "5d")
  _check(q, buf, k, v, arrays, causal=True)


@pytest.mark.parametrize("head_dim,head_dim_pad", [(64, 128), (128, 256)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_padded_head_dim(page_size, head_dim, head_dim_pad):
  q, buf, k, v, arrays = make_buffer_case(
      seed=_seed("decode_pad", page_size, head_dim), q_lens=[1] * 4, k_lens=[5, 200, 31, 1],
      num_heads=16, num_kv_heads=4, head_dim=head_dim, head_dim_pad=head_dim_pad,
      page_size=page_size, dense_q=True, form="3d" if page_size == 1 else "5d")
  _check(q, buf, k, v, arrays, causal=True, softcap=20.0)


@pytest.mark.parametrize("head_dim,head_dim_pad", [(64, 128), (128, 128)])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("mask", ["causal", "window"])
def test_sm90_paged_prefill(page_size, head_dim, head_dim_pad, mask):
  """>= 64 q rows per sequence over pages of a multiple of 16 keys: the Hopper paged forward."""
  flags = dict(causal=True) if mask == "causal" else dict(causal=True, window=(100, 0))
  q, buf, k, v, arrays = make_buffer_case(
      seed=_seed("sm90", page_size, head_dim, mask), q_lens=[64, 200, 129],
      k_lens=[64, 700, 300], num_heads=8, num_kv_heads=2, head_dim=head_dim,
      head_dim_pad=head_dim_pad, page_size=page_size, form="5d")
  _check(q, buf, k, v, arrays, **flags)


@pytest.mark.parametrize("q_lens", [[1, 19, 64, 3], [100, 9]])
def test_sm80_page_size_5(q_lens):
  """Pages of 5 keys: the portable mma.sync kernel (and the decode kernels for the short rows)."""
  q, buf, k, v, arrays = make_buffer_case(
      seed=_seed("sm80", len(q_lens)), q_lens=q_lens, k_lens=[ql + 37 for ql in q_lens],
      num_heads=8, num_kv_heads=2, head_dim=96, head_dim_pad=128, page_size=5)
  sinks = jnp.linspace(-1.0, 2.0, 8, dtype=jnp.float32)
  _check(q, buf, k, v, arrays, causal=True, sinks=sinks)
