"""The Metal kernels (metal/kernels/*.metal), compiled as C++ against metal/shim and run on the CPU
grid emulator (jax_sgl._metal_emu), against jax_sgl.reference.

This checks the kernels' logic, indexing, bounds and barriers on every CI run; it does not check
Metal compilation, simdgroup_matrix lane layouts or performance (see metal/README.md). Outputs are
poisoned with NaN so an element the kernel forgets to write fails the comparison.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_sgl import reference

emu = pytest.importorskip(
    "jax_sgl._metal_emu", reason="jax_sgl built without the Metal emulator (JAX_SGL_METAL_EMULATOR)")

KV_DENSE, KV_VARLEN, KV_PAGED = 0, 1, 2

# dtype -> (code of jax_sgl::DType, atol/rtol of outputs stored in that dtype)
DTYPES = {
    "float32": (0, 2e-5),
    "float16": (1, 2e-3),
    "bfloat16": (2, 1.6e-2),
}
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


# The reference runs jitted: op-by-op it costs far more than the emulated kernels.
_ref_rope_pool = jax.jit(reference.rope_pool_fused,
                         static_argnames=("rope_base", "rotary_dim", "is_neox"))
_ref_rope_pool_kv = jax.jit(
    lambda q, k, v, p, s, inv_freq, buf, **kw: reference.rope_pool_fused(
        q, k, v, p, s, inv_freq=inv_freq, kv_buffer=buf, **kw),
    static_argnames=("rotary_dim", "is_neox"))
_ref_attention = jax.jit(reference.attention, static_argnames=(
    "kv_layout", "varlen_q", "batch", "softmax_scale", "softcap", "causal", "window_left",
    "window_right"))
_ref_attention_sinks = jax.jit(reference.attention, static_argnames=(
    "kv_layout", "varlen_q", "batch", "softmax_scale", "softcap", "causal", "window_left",
    "window_right"))


def _emu_view(a):
  """numpy has no bfloat16 buffer format: hand 2-byte floats to the emulator as uint16."""
  a = np.ascontiguousarray(a)
  return a.view(np.uint16) if a.dtype.itemsize == 2 else a


def _rand(rng, shape, dtype):
  return rng.standard_normal(shape, dtype=np.float32).astype(NP_DTYPES[dtype])


def _f32(a):
  return np.asarray(a).astype(np.float32)


# --------------------------------------------------------------------------------------------
# rope_pool_fused
# --------------------------------------------------------------------------------------------

def _run_rope_pool(q, k, v, positions, slots, k_pool, v_pool, dtype, rope_base, rotary_dim,
                   is_neox, inv_freq=None):
  """v_pool None: k_pool is a fused kv_buffer; returns (q_rot, k_rot, kv_buffer) then."""
  q_rot = np.full_like(q, np.nan)
  k_rot = np.full_like(k, np.nan)
  if inv_freq is None:
    inv_freq = reference.rope_inv_freq(rotary_dim, rope_base)
  # The kernel writes the (aliased) pools in place; an empty v_pool says "fused kv_buffer".
  k_out = k_pool.copy()
  v_out = np.zeros(0, k_pool.dtype) if v_pool is None else v_pool.copy()
  emu.rope_pool(_emu_view(q), _emu_view(k), _emu_view(v), positions, slots,
                np.ascontiguousarray(inv_freq, np.float32), _emu_view(q_rot), _emu_view(k_rot),
                _emu_view(k_out), _emu_view(v_out), dtype=DTYPES[dtype][0],
                rotary_dim=rotary_dim, is_neox=is_neox)
  return (q_rot, k_rot, k_out) if v_pool is None else (q_rot, k_rot, k_out, v_out)


# Each reference shape costs a jit compile: sizes and index dtypes are paired, not crossed.
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("num_tokens,head_dim,index_dtype",
                         [(1, 64, np.int32), (7, 80, np.int64), (33, 128, np.int32)])
@pytest.mark.parametrize("is_neox,partial", [(True, False), (False, False), (True, True),
                                            (False, True)])
def test_rope_pool(dtype, num_tokens, head_dim, index_dtype, is_neox, partial):
  rng = np.random.default_rng(num_tokens * 131 + head_dim)
  hq, hkv, num_slots = 4, 2, 3 * num_tokens + 5
  rotary_dim = head_dim // 2 if partial else head_dim
  q = _rand(rng, (num_tokens, hq, head_dim), dtype)
  k = _rand(rng, (num_tokens, hkv, head_dim), dtype)
  v = _rand(rng, (num_tokens, hkv, head_dim), dtype)
  positions = rng.integers(0, 8192, num_tokens).astype(index_dtype)
  # Distinct slots, with padding (-1, -7) and out-of-range (num_slots, huge) tokens mixed in.
  slots = rng.permutation(num_slots)[:num_tokens].astype(index_dtype)
  bad = rng.random(num_tokens) < 0.3
  slots[bad] = rng.choice(np.array([-1, -7, num_slots, num_slots + 1000], index_dtype), bad.sum())
  k_pool = _rand(rng, (num_slots, hkv, head_dim), dtype)
  v_pool = _rand(rng, (num_slots, hkv, head_dim), dtype)

  got = _run_rope_pool(q, k, v, positions, slots, k_pool, v_pool, dtype, 10000.0, rotary_dim,
                       is_neox)
  want = _ref_rope_pool(*map(jnp.asarray, (q, k, v, positions, slots, k_pool, v_pool)),
                                   rope_base=10000.0, rotary_dim=rotary_dim, is_neox=is_neox)
  tol = DTYPES[dtype][1]
  for name, g, w in zip(("q_rot", "k_rot", "k_pool", "v_pool"), got, want):
    np.testing.assert_allclose(_f32(g), _f32(w), atol=tol, rtol=tol, err_msg=name)
  # Rows no valid slot names are untouched bit for bit; v is copied, not rounded.
  written = np.zeros(num_slots, bool)
  written[slots[(slots >= 0) & (slots < num_slots)]] = True
  for pool, out in ((k_pool, got[2]), (v_pool, got[3])):
    np.testing.assert_array_equal(out[~written].view(np.uint8), pool[~written].view(np.uint8))
  valid = (slots >= 0) & (slots < num_slots)
  np.testing.assert_array_equal(got[3][slots[valid]].view(np.uint8), v[valid].view(np.uint8))
  # Unrotated tail features are copied exactly.
  np.testing.assert_array_equal(got[0][..., rotary_dim:].view(np.uint8),
                                q[..., rotary_dim:].view(np.uint8))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape,d,is_neox,partial", [
    ((9, 5, 4, 128), 80, True, False),        # 4-D, page size 5, head dim padded 80 -> 128
    ((6, 16, 2, 2, 128), 64, False, True),    # sglang-jax's 5-D form, interleaved, partial
    ((40, 4, 128), 128, True, True),          # 3-D token pool, unpadded
])
def test_rope_pool_kv_buffer(dtype, shape, d, is_neox, partial):
  """The fused K/V buffer (K head h at head index 2h, V at 2h + 1, pad columns untouched) with a
  llama3-style inv_freq table, against the reference; the buffer is NaN-poisoned and every element
  the kernel must not write is compared bit for bit."""
  rng = np.random.default_rng(len(shape) * 7 + d)
  num_tokens, hq, hkv = 23, 4, 2
  rotary_dim = d // 2 if partial else d
  q = _rand(rng, (num_tokens, hq, d), dtype)
  k = _rand(rng, (num_tokens, hkv, d), dtype)
  v = _rand(rng, (num_tokens, hkv, d), dtype)
  num_slots = shape[0] if len(shape) == 3 else shape[0] * shape[1]
  positions = rng.integers(0, 65536, num_tokens).astype(np.int32)
  slots = (rng.permutation(num_slots + 6)[:num_tokens] - 3).astype(np.int32)
  kv_buffer = np.full(shape, np.nan, NP_DTYPES[dtype])
  # A llama3-like table: the low frequencies divided by 8 (any float32 table will do here).
  inv_freq = reference.rope_inv_freq(rotary_dim, 500000.0)
  inv_freq[rotary_dim // 4:] /= 8
  got = _run_rope_pool(q, k, v, positions, slots, kv_buffer, None, dtype, None, rotary_dim,
                       is_neox, inv_freq=inv_freq)
  want = _ref_rope_pool_kv(*map(jnp.asarray, (q, k, v, positions, slots, inv_freq, kv_buffer)),
                           rotary_dim=rotary_dim, is_neox=is_neox)
  tol = DTYPES[dtype][1]
  for name, g, w in zip(("q_rot", "k_rot"), got, want):
    np.testing.assert_allclose(_f32(g), _f32(w), atol=tol, rtol=tol, err_msg=name)
  rows = lambda x: np.asarray(x).reshape(num_slots, 2 * hkv, shape[-1])
  expect = rows(kv_buffer).copy()
  valid = (slots >= 0) & (slots < num_slots)
  expect[slots[valid], 0::2, :d] = got[1][valid]   # the kernel's own k_rot, checked above
  expect[slots[valid], 1::2, :d] = v[valid]
  np.testing.assert_array_equal(rows(got[2]).view(np.uint8), expect.view(np.uint8))
  np.testing.assert_allclose(_f32(rows(got[2])), _f32(rows(want[2])), atol=tol, rtol=tol,
                             equal_nan=True)


def test_rope_pool_only_padding_writes_nothing():
  rng = np.random.default_rng(1)
  q, k, v = (_rand(rng, (3, h, 64), "float32") for h in (2, 1, 1))
  pools = [_rand(rng, (4, 1, 64), "float32") for _ in range(2)]
  got = _run_rope_pool(q, k, v, np.arange(3, dtype=np.int32), np.array([-1, 4, 99], np.int32),
                       *pools, "float32", 10000.0, 64, True)
  np.testing.assert_array_equal(got[2], pools[0])
  np.testing.assert_array_equal(got[3], pools[1])
  assert np.isfinite(got[0]).all() and np.isfinite(got[1]).all()


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------

def _run_attention(q, k, v, *, dtype, kv_layout, varlen_q, batch, max_seqlen_q, scale,
                   softcap=0.0, causal=False, window=(-1, -1), cu_seqlens_q=None,
                   cu_seqlens_k=None, seqused_k=None, page_table=None, sinks=None,
                   kv_buffer=False):
  num_heads, head_dim_v = q.shape[-2], q.shape[-1] if kv_buffer else v.shape[-1]
  out = np.full(q.shape[:-1] + (head_dim_v,), np.nan, NP_DTYPES[dtype])
  total_q = q.shape[0] if varlen_q else q.shape[0] * q.shape[1]
  lse = np.full((num_heads, total_q) if varlen_q else (batch, num_heads, q.shape[1]), np.nan,
                np.float32)
  empty = np.zeros(0, np.int32)
  idx = lambda a: empty if a is None else np.ascontiguousarray(a, np.int32)
  emu.attention(_emu_view(q), _emu_view(k), _emu_view(v), _emu_view(out), lse, idx(cu_seqlens_q),
                idx(cu_seqlens_k), idx(seqused_k), idx(page_table),
                np.zeros(0, np.float32) if sinks is None else np.ascontiguousarray(sinks, np.float32),
                dtype=DTYPES[dtype][0],
                kv_layout=kv_layout, varlen_q=varlen_q, batch=batch, max_seqlen_q=max_seqlen_q,
                softmax_scale=scale, softcap=softcap, causal=causal, window_left=window[0],
                window_right=window[1], kv_buffer=kv_buffer)
  return out, lse


def _check_attention(q, k, v, *, dtype, kv_layout, varlen_q, batch, max_seqlen_q=0, softcap=0.0,
                     causal=False, window=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None,
                     seqused_k=None, page_table=None, sinks=None):
  scale = float(q.shape[-1]) ** -0.5
  index = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
               page_table=page_table)
  out, lse = _run_attention(q, k, v, dtype=dtype, kv_layout=kv_layout, varlen_q=varlen_q,
                            batch=batch, max_seqlen_q=max_seqlen_q, scale=scale, softcap=softcap,
                            causal=causal, window=window, sinks=sinks, **index)
  ref = _ref_attention if sinks is None else functools.partial(_ref_attention_sinks,
                                                               sinks=jnp.asarray(sinks))
  want_out, want_lse = ref(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), kv_layout=kv_layout, varlen_q=varlen_q,
      batch=batch, softmax_scale=scale, softcap=softcap, causal=causal, window_left=window[0],
      window_right=window[1],
      **{n: None if a is None else jnp.asarray(a, jnp.int32) for n, a in index.items()})
  tol = DTYPES[dtype][1]
  np.testing.assert_allclose(_f32(out), _f32(want_out), atol=tol, rtol=tol, err_msg="out")
  # LSE is float32 from the same (rounded) inputs on both sides; -inf must match exactly.
  np.testing.assert_allclose(lse, np.asarray(want_lse), atol=1e-4, rtol=1e-4, err_msg="lse")
  return out, lse


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 33), (7, 7), (33, 19), (19, 70)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_dense(dtype, seqlen_q, seqlen_k, causal):
  rng = np.random.default_rng(seqlen_q * 100 + seqlen_k)
  b, h, hkv, d = 2, 4, 2, 64
  q = _rand(rng, (b, seqlen_q, h, d), dtype)
  k = _rand(rng, (b, seqlen_k, hkv, d), dtype)
  v = _rand(rng, (b, seqlen_k, hkv, d), dtype)
  out, lse = _check_attention(q, k, v, dtype=dtype, kv_layout=KV_DENSE, varlen_q=False, batch=b,
                              causal=causal)
  if causal and seqlen_q > seqlen_k:  # bottom-right: the first rows see no key
    assert np.all(_f32(out)[:, : seqlen_q - seqlen_k] == 0)
    assert np.all(lse[:, :, : seqlen_q - seqlen_k] == -np.inf)


@pytest.mark.parametrize("head_dim,head_dim_v,num_heads,num_kv_heads", [
    (64, 64, 4, 1), (80, 80, 6, 3), (128, 128, 2, 2), (80, 64, 4, 2), (36, 20, 3, 1)])
def test_attention_head_dims_and_gqa(head_dim, head_dim_v, num_heads, num_kv_heads):
  rng = np.random.default_rng(head_dim * 7 + num_heads)
  b, sq, sk = 1, 17, 41
  q = _rand(rng, (b, sq, num_heads, head_dim), "float32")
  k = _rand(rng, (b, sk, num_kv_heads, head_dim), "float32")
  v = _rand(rng, (b, sk, num_kv_heads, head_dim_v), "float32")
  _check_attention(q, k, v, dtype="float32", kv_layout=KV_DENSE, varlen_q=False, batch=b,
                   causal=True)


@pytest.mark.parametrize("window,causal,softcap", [
    ((5, 0), False, 0.0), ((3, 2), False, 5.0), ((-1, 4), False, 0.0), ((8, -1), True, 5.0),
    ((0, 0), False, 0.0), ((-1, -1), False, 5.0)])
def test_attention_window_softcap(window, causal, softcap):
  rng = np.random.default_rng(sum(window) + 3)
  b, sq, sk, h, d = 2, 21, 37, 2, 64
  q = _rand(rng, (b, sq, h, d), "bfloat16")
  k = _rand(rng, (b, sk, h, d), "bfloat16")
  v = _rand(rng, (b, sk, h, d), "bfloat16")
  _check_attention(q, k, v, dtype="bfloat16", kv_layout=KV_DENSE, varlen_q=False, batch=b,
                   causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_attention_varlen(dtype, causal):
  rng = np.random.default_rng(11)
  h, hkv, d = 4, 2, 80
  q_lens, k_lens = [5, 0, 33, 1], [9, 4, 40, 1]  # an empty query sequence; Sq < Sk and Sq = Sk
  cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
  total_q, total_k = cu_q[-1] + 3, cu_k[-1] + 2  # padding rows past the last sequence
  q = _rand(rng, (total_q, h, d), dtype)
  k = _rand(rng, (total_k, hkv, d), dtype)
  v = _rand(rng, (total_k, hkv, d), dtype)
  # max_seqlen_q is only a hint to the grid: a smaller one must still cover every row.
  out, lse = _check_attention(q, k, v, dtype=dtype, kv_layout=KV_VARLEN, varlen_q=True,
                              batch=len(q_lens), max_seqlen_q=16, causal=causal, cu_seqlens_q=cu_q,
                              cu_seqlens_k=cu_k)
  assert np.all(_f32(out)[cu_q[-1]:] == 0) and np.all(lse[:, cu_q[-1]:] == -np.inf)


def test_attention_varlen_bad_cu_seqlens_are_clamped():
  rng = np.random.default_rng(5)
  h, d = 2, 64
  # Negative start, end past the buffer, a reversed last pair (empty). Query ranges must not
  # overlap: rows claimed by two sequences have no single right answer on any backend.
  cu_q = np.array([-3, 6, 50, 3], np.int32)
  cu_k = np.array([-3, 10, 10, 999], np.int32)
  q = _rand(rng, (12, h, d), "float32")
  k = _rand(rng, (20, h, d), "float32")
  v = _rand(rng, (20, h, d), "float32")
  _check_attention(q, k, v, dtype="float32", kv_layout=KV_VARLEN, varlen_q=True, batch=3,
                   max_seqlen_q=6, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("page_size,dtype", [(1, "float32"), (4, "bfloat16"), (16, "float16")])
@pytest.mark.parametrize("seqlen_q,varlen_q", [(1, False), (7, False), (None, True)])
def test_attention_paged(page_size, dtype, seqlen_q, varlen_q):
  rng = np.random.default_rng(page_size * 10 + (seqlen_q or 0))
  b, h, hkv, d = 3, 4, 1, 64
  max_pages = -(-45 // page_size)
  num_pages = b * max_pages + 2
  k = _rand(rng, (num_pages, page_size, hkv, d), dtype)
  v = _rand(rng, (num_pages, page_size, hkv, d), dtype)
  page_table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
  # Entries outside [0, num_pages) are masked keys, never read.
  page_table[0, 1 % max_pages] = -1
  page_table[1, -1] = num_pages + 3
  seqused_k = np.array([45, 13, 0], np.int32)  # the last sequence has no keys: 0 / -inf
  if varlen_q:
    q_lens = [3, 9, 2]
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = _rand(rng, (cu_q[-1], h, d), dtype)
    extra = dict(varlen_q=True, max_seqlen_q=max(q_lens), cu_seqlens_q=cu_q)
  else:
    q = _rand(rng, (b, seqlen_q, h, d), dtype)
    extra = dict(varlen_q=False)
  out, lse = _check_attention(q, k, v, dtype=dtype, kv_layout=KV_PAGED, batch=b, causal=True,
                              seqused_k=seqused_k, page_table=page_table, **extra)
  assert np.all(lse[-1] == -np.inf if not varlen_q else lse[:, cu_q[-2]:] == -np.inf)


def test_attention_token_pool_decode():
  """rope_pool_fused's token pool [num_slots, Hkv, D] read as pages of one token."""
  rng = np.random.default_rng(9)
  b, h, hkv, d, num_slots, max_len = 4, 8, 2, 128, 64, 23
  pool_k = _rand(rng, (num_slots, 1, hkv, d), "float16")
  pool_v = _rand(rng, (num_slots, 1, hkv, d), "float16")
  page_table = np.stack([rng.permutation(num_slots)[:max_len] for _ in range(b)]).astype(np.int32)
  q = _rand(rng, (b, 1, h, d), "float16")
  _check_attention(q, pool_k, pool_v, dtype="float16", kv_layout=KV_PAGED, varlen_q=False,
                   batch=b, causal=True, seqused_k=np.array([23, 1, 7, 16], np.int32),
                   page_table=page_table)


@pytest.mark.parametrize("page_size,head_dim,head_dim_pad,dtype", [
    (1, 64, 128, "bfloat16"), (5, 128, 128, "float32"), (16, 64, 256, "float16")])
def test_attention_kv_buffer(page_size, head_dim, head_dim_pad, dtype):
  """sglang-jax's fused pool [P, page, 2 * Hkv, head_dim_pad] bound as both k and v, read through
  the strides (NaN in its padding, unnamed pages and page tails), against the reference on K/V
  sliced out of it."""
  from kv_buffer_cases import make_buffer_case
  q, buf, k, v, arrays = make_buffer_case(
      seed=page_size, q_lens=[3, 1, 17], k_lens=[40, 9, 17], num_heads=4, num_kv_heads=2,
      head_dim=head_dim, head_dim_pad=head_dim_pad, page_size=page_size,
      dtype=NP_DTYPES[dtype])
  q, buf = np.array(q), np.array(buf)   # writable copies: the emulator binds writable arrays
  if k.ndim == 3:
    k, v = k[:, None], v[:, None]
  cu_q, table, used = (np.array(arrays[n]) for n in ("cu_seqlens_q", "page_table", "seqused_k"))
  scale = float(head_dim) ** -0.5
  out, lse = _run_attention(q, buf, buf, dtype=dtype, kv_layout=KV_PAGED, varlen_q=True, batch=3,
                            max_seqlen_q=17, scale=scale, causal=True, cu_seqlens_q=cu_q,
                            seqused_k=used, page_table=table, kv_buffer=True)
  want_out, want_lse = _ref_attention(
      jnp.asarray(q), k, v, kv_layout=KV_PAGED, varlen_q=True, batch=3, softmax_scale=scale,
      causal=True, window_right=0, cu_seqlens_q=jnp.asarray(cu_q), page_table=jnp.asarray(table),
      seqused_k=jnp.asarray(used))
  tol = DTYPES[dtype][1]
  np.testing.assert_allclose(_f32(out), _f32(want_out), atol=tol, rtol=tol, err_msg="out")
  np.testing.assert_allclose(lse, np.asarray(want_lse), atol=1e-4, rtol=1e-4, err_msg="lse")


@pytest.mark.parametrize("layout", ["dense", "varlen", "paged"])
def test_attention_sinks(layout):
  """Attention sinks: each head's logit joins the denominator; rows without keys give 0 and
  lse = sink (padding rows past cu_seqlens_q stay 0 / -inf)."""
  rng = np.random.default_rng(17)
  h, hkv, d, dtype = 6, 2, 64, "bfloat16"
  sinks = rng.uniform(-1.0, 4.0, h).astype(np.float32)
  if layout == "dense":
    q = _rand(rng, (2, 19, h, d), dtype)
    k, v = _rand(rng, (2, 11, hkv, d), dtype), _rand(rng, (2, 11, hkv, d), dtype)
    out, lse = _check_attention(q, k, v, dtype=dtype, kv_layout=KV_DENSE, varlen_q=False, batch=2,
                                causal=True, sinks=sinks)
    assert np.all(_f32(out)[:, :8] == 0)       # 19 queries over 11 keys: 8 rows see none
    np.testing.assert_array_equal(lse[:, :, :8], np.broadcast_to(sinks[None, :, None], (2, h, 8)))
  elif layout == "varlen":
    q_lens, k_lens = [5, 0, 33, 1], [9, 4, 40, 1]
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    q = _rand(rng, (cu_q[-1] + 3, h, d), dtype)
    k, v = _rand(rng, (cu_k[-1], hkv, d), dtype), _rand(rng, (cu_k[-1], hkv, d), dtype)
    out, lse = _check_attention(q, k, v, dtype=dtype, kv_layout=KV_VARLEN, varlen_q=True,
                                batch=4, max_seqlen_q=33, window=(3, 1), cu_seqlens_q=cu_q,
                                cu_seqlens_k=cu_k, sinks=sinks)
    assert np.all(_f32(out)[cu_q[-1]:] == 0) and np.all(lse[:, cu_q[-1]:] == -np.inf)
  else:
    page_size, max_pages = 5, 9
    k = _rand(rng, (20, page_size, hkv, d), dtype)
    v = _rand(rng, (20, page_size, hkv, d), dtype)
    page_table = rng.permutation(20)[:18].reshape(2, max_pages).astype(np.int32)
    q = _rand(rng, (2, 3, h, d), dtype)
    out, lse = _check_attention(q, k, v, dtype=dtype, kv_layout=KV_PAGED, varlen_q=False, batch=2,
                                causal=True, softcap=5.0, seqused_k=np.array([43, 0], np.int32),
                                page_table=page_table, sinks=sinks)
    assert np.all(_f32(out)[1] == 0)           # no keys: 0 and lse = sink
    np.testing.assert_array_equal(lse[1], np.broadcast_to(sinks[:, None], (h, 3)))


def test_attention_unsupported_head_dim_is_refused():
  rng = np.random.default_rng(0)
  q = _rand(rng, (1, 3, 1, 256), "float32")
  with pytest.raises(ValueError, match="head_dim > 128"):
    _run_attention(q, q, q, dtype="float32", kv_layout=KV_DENSE, varlen_q=False, batch=1,
                   max_seqlen_q=0, scale=1.0)


def test_kernel_names_cover_every_instantiation():
  names = set(emu.kernel_names())
  for t in ("f32", "f16", "bf16"):
    assert {f"jax_sgl_attention_fwd_{t}", f"jax_sgl_attention_clear_{t}",
            f"jax_sgl_rope_pool_{t}_i32", f"jax_sgl_rope_pool_{t}_i64"} <= names


# --------------------------------------------------------------------------------------------
# The emulator itself
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("threads", [32, 48, 96])
def test_emulator_simd_ops(threads):
  out = np.full(3 * threads, np.nan, np.float32)
  emu.selftest("emu_selftest_simd_ops", out, threads)
  lane = np.arange(threads) % 32
  width = np.minimum(32, threads - np.arange(threads) // 32 * 32)  # a partial last simdgroup
  out = out.reshape(threads, 3)
  np.testing.assert_array_equal(out[:, 0], width * (width - 1) / 2)
  np.testing.assert_array_equal(out[:, 1], width - 1)
  partner = lane ^ 1
  np.testing.assert_array_equal(out[:, 2], np.where(partner < width, partner, lane))


def test_emulator_barrier_orders_threads():
  out = np.full(3 * 64, np.nan, np.float32)
  emu.selftest("emu_selftest_barrier_order", out, 64)
  np.testing.assert_array_equal(out[:64], (np.arange(64) + 1) % 64 + 0.5)


@pytest.mark.parametrize("name,message", [("emu_selftest_divergent_barrier", "barrier"),
                                          ("emu_selftest_threadgroup_overflow", "32768 B")])
def test_emulator_reports_kernel_errors(name, message):
  with pytest.raises(RuntimeError, match=message):
    emu.selftest(name, np.zeros(3 * 64, np.float32), 64)
