"""jax_sgl's fp8 KV cache end to end on the CPU: rope_pool_fused writes rotated k and v into a
float8_e4m3fn pool (paged, token pool or fused kv_buffer), and attention reads it under bf16 /
fp16 q with k_descale / v_descale (the same arrays as the write's k_scale / v_scale). Paged decode
and chunked prefill against a float64 oracle of the dequantized values (stored * scale), with
FlashAttention's rule: the error is at most twice that of the same math done in bfloat16 (plus a
float32-noise floor). Also the pure-JAX reference, every descale shape, dense K/V, masked page-table
entries over NaN-poisoned pages, and every bad-input error (the seed's `Type mismatch` without
k_descale)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from attention_cases import naive_attention, reference_attention
from jax_sgl._checks import check_attention_cuda

E4M3, E5M2, BF16, F16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float16
H, HKV, D, PAGE = 8, 2, 128, 16
NUM_PAGES = 20


def nan_pool(shape):
  return jax.lax.bitcast_convert_type(jnp.full(shape, 0x7f, jnp.uint8), E4M3)


def dequantize(pool, scale):
  """stored * scale in float64, per KV head (the head axis is -2)."""
  s = np.broadcast_to(np.asarray(scale, np.float64).reshape(-1), (pool.shape[-2],))
  return np.asarray(pool).astype(np.float64) * s[:, None]


class Cache:
  """A paged fp8 cache filled by rope_pool_fused: sequences of k_lens tokens on shuffled pages;
  `bad` (batch, page index) entries of the page table point outside the pool (masked keys, and
  their tokens are not written). Unwritten rows stay NaN."""

  def __init__(self, seed, k_lens, *, bad=(), dtype=BF16, per_head=True, kv_buffer=False):
    rng = np.random.default_rng(seed)
    self.rng, self.dtype, self.k_lens = rng, dtype, np.asarray(k_lens, np.int32)
    batch = len(k_lens)
    max_pages = max(-(-n // PAGE) for n in k_lens)
    pages = rng.permutation(NUM_PAGES)[:batch * max_pages].reshape(batch, max_pages)
    for b, j in bad:
      pages[b, j] = NUM_PAGES + 3 if (b + j) % 2 else -1
    self.page_table = jnp.asarray(pages, jnp.int32)
    self.k_scale = (rng.uniform(0.01, 0.03, HKV) if per_head else rng.uniform(0.01, 0.03, 1)
                    ).astype(np.float32)
    self.v_scale = (rng.uniform(0.01, 0.03, HKV) if per_head else rng.uniform(0.01, 0.03, 1)
                    ).astype(np.float32)
    tokens = int(self.k_lens.sum())
    f = lambda mag, *s: jnp.asarray(rng.standard_normal(s) * mag, jnp.float32).astype(dtype)
    q, k, v = f(1.0, tokens, H, D), f(2.0, tokens, HKV, D), f(2.0, tokens, HKV, D)
    positions = np.concatenate([np.arange(n) for n in k_lens]).astype(np.int32)
    seq = np.repeat(np.arange(batch), k_lens)
    page = pages[seq, positions // PAGE]
    slots = np.where((page >= 0) & (page < NUM_PAGES), page * PAGE + positions % PAGE, -1)
    scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
    if kv_buffer:
      buf = nan_pool((NUM_PAGES, PAGE, 2 * HKV, D))
      _, _, self.kv_buffer = jax_sgl.rope_pool_fused(q, k, v, jnp.asarray(positions),
                                                     jnp.asarray(slots, jnp.int32),
                                                     kv_buffer=buf, **scales)
      self.k_pages, self.v_pages = self.kv_buffer[:, :, 0::2], self.kv_buffer[:, :, 1::2]
    else:
      pool = nan_pool((NUM_PAGES * PAGE, HKV, D))
      _, _, k_pool, v_pool = jax_sgl.rope_pool_fused(q, k, v, jnp.asarray(positions),
                                                     jnp.asarray(slots, jnp.int32), pool, pool,
                                                     **scales)
      self.k_pages = k_pool.reshape(NUM_PAGES, PAGE, HKV, D)
      self.v_pages = v_pool.reshape(NUM_PAGES, PAGE, HKV, D)
    assert self.k_pages.dtype == E4M3

  def query(self, q_len):
    f = lambda *s: jnp.asarray(self.rng.standard_normal(s), jnp.float32).astype(self.dtype)
    return f(len(self.k_lens), q_len, H, D)

  def arrays(self, descale_shape="head"):
    target = {"head": (HKV,), "batch_head": (len(self.k_lens), HKV), "tensor_1": (1,),
              "tensor_0d": ()}[descale_shape]

    def fit(x):
      if descale_shape.startswith("tensor"):   # a per-tensor cache keeps one value
        return jnp.asarray(x[:1].reshape(target))
      return jnp.asarray(np.broadcast_to(x, target).copy())

    return dict(page_table=self.page_table, seqused_k=jnp.asarray(self.k_lens),
                k_descale=fit(self.k_scale), v_descale=fit(self.v_scale))

  def dequantized(self):
    return dequantize(self.k_pages, self.k_scale), dequantize(self.v_pages, self.v_scale)


def bf16_attention(q, k, v, *, causal, page_table, seqused_k, **_):
  """The same math done in bfloat16 (scores, softmax and P V rounded to bf16 at every step) on
  the dequantized values, gathered per sequence: the error scale of FlashAttention's rule."""
  q = np.asarray(q, np.float32)
  table, used = np.asarray(page_table), np.asarray(seqused_k)
  pool_k, pool_v = k.reshape(-1, HKV, D), v.reshape(-1, HKV, D)
  bf = lambda x: jnp.asarray(x, jnp.float32).astype(BF16)
  outs = []
  for b in range(q.shape[0]):
    n = int(used[b])
    page = table[b, np.arange(n) // PAGE]
    ok = (page >= 0) & (page < NUM_PAGES)
    rows = np.clip(page, 0, NUM_PAGES - 1) * PAGE + np.arange(n) % PAGE
    kb = bf(np.repeat(np.where(ok[:, None, None], pool_k[rows], 0), H // HKV, axis=1))
    vb = bf(np.repeat(np.where(ok[:, None, None], pool_v[rows], 0), H // HKV, axis=1))
    lq = q.shape[1]
    s = jnp.einsum("qhd,khd->hqk", bf(q[b]), kb, preferred_element_type=BF16)
    s = s * BF16(1 / np.sqrt(D))
    mask = np.broadcast_to(ok[None, :], (lq, n))
    if causal:
      mask = mask & (np.arange(n)[None, :] <= np.arange(lq)[:, None] + n - lq)
    s = jnp.where(mask[None], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    o = jnp.einsum("hqk,khd->qhd", p, vb, preferred_element_type=BF16)
    outs.append(o / jnp.swapaxes(jnp.sum(p, axis=-1), 0, 1)[..., None])
  return np.stack([np.asarray(o, np.float64) for o in outs])


def check_flash_rule(out, cache, q, *, causal):
  arrays = cache.arrays()
  k64, v64 = cache.dequantized()
  want = naive_attention(q, k64, v64, causal=causal, page_table=arrays["page_table"],
                         seqused_k=arrays["seqused_k"])
  base = bf16_attention(q, k64, v64, causal=causal, **arrays)
  got = np.asarray(out, np.float64)
  assert np.isfinite(got).all()
  err, base_err = np.abs(got - want).max(), np.abs(base - want).max()
  assert err <= 2 * base_err + 1e-5, (err, base_err)
  return want


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("per_head", [True, False])
def test_paged_decode_round_trip(dtype, per_head):
  cache = Cache(1, [37, 5, 60], bad=[(0, 1), (2, 3)], dtype=dtype, per_head=per_head)
  q = cache.query(1)
  out = jax_sgl.attention(q, cache.k_pages, cache.v_pages, **cache.arrays())
  assert out.dtype == dtype and out.shape == q.shape
  check_flash_rule(out, cache, q, causal=False)
  # The pure-JAX reference computes the same (float32) math.
  ref = reference_attention(q, cache.k_pages, cache.v_pages, **cache.arrays("batch_head"))
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             rtol=2 ** -7, atol=2e-3)


@pytest.mark.parametrize("q_len", [4, 16])
def test_chunked_prefill_round_trip(q_len):
  cache = Cache(2, [40, 16, 75], bad=[(2, 1)])
  q = cache.query(q_len)
  out = jax_sgl.attention(q, cache.k_pages, cache.v_pages, causal=True, **cache.arrays())
  check_flash_rule(out, cache, q, causal=True)
  ref = reference_attention(q, cache.k_pages, cache.v_pages, causal=True,
                            **cache.arrays("batch_head"))
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             rtol=2 ** -7, atol=2e-3)


def test_kv_buffer_round_trip():
  cache = Cache(3, [33, 50], bad=[(1, 0)], kv_buffer=True)
  q = cache.query(3)
  arrays = cache.arrays()
  out = jax_sgl.attention(q, kv_buffer=cache.kv_buffer, causal=True, **arrays)
  check_flash_rule(out, cache, q, causal=True)
  # The fused buffer reads exactly as its K and V views.
  split = jax_sgl.attention(q, cache.k_pages, cache.v_pages, causal=True, **arrays)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(split, np.float32))


def test_token_pool():
  """A 3-D token pool (page size 1): page_table holds slots."""
  cache = Cache(4, [20, 31])
  k_tok = cache.k_pages.reshape(-1, HKV, D)
  v_tok = cache.v_pages.reshape(-1, HKV, D)
  pt = np.asarray(cache.page_table)
  slots = np.stack([np.concatenate([pt[b, j // PAGE:j // PAGE + 1] * PAGE + j % PAGE
                                    for j in range(32)]) for b in range(2)]).astype(np.int32)
  arrays = {**cache.arrays(), "page_table": jnp.asarray(slots)}
  q = cache.query(2)
  out = jax_sgl.attention(q, k_tok, v_tok, causal=True, **arrays)
  paged = jax_sgl.attention(q, cache.k_pages, cache.v_pages, causal=True, **cache.arrays())
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(paged, np.float32),
                             rtol=1e-2, atol=1e-3)
  check_flash_rule(out, cache, q, causal=True)


@pytest.mark.parametrize("shape", ["head", "batch_head", "tensor_1", "tensor_0d"])
def test_descale_shapes_agree(shape):
  """Per-tensor, per-head and per-(batch, head) descales holding the same values give the same
  bits: the kernels read each through its strides (HeadDescale)."""
  cache = Cache(5, [24, 9], per_head=shape.startswith("tensor") is False)
  q = cache.query(1)
  base = jax_sgl.attention(q, cache.k_pages, cache.v_pages, **cache.arrays("batch_head"))
  out = jax_sgl.attention(q, cache.k_pages, cache.v_pages, **cache.arrays(shape))
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(base, np.float32))


def test_dense_fp8_kv():
  """Dense K/V in e4m3 under bf16 q falls out of the same path."""
  rng = np.random.default_rng(6)
  q = jnp.asarray(rng.standard_normal((2, 5, H, D)), jnp.float32).astype(BF16)
  k8 = jnp.asarray(rng.standard_normal((2, 19, HKV, D)) * 50, jnp.float32).astype(E4M3)
  v8 = jnp.asarray(rng.standard_normal((2, 19, HKV, D)) * 50, jnp.float32).astype(E4M3)
  ks, vs = np.float32([0.02, 0.01]), np.float32(0.03)
  out = jax_sgl.attention(q, k8, v8, causal=True, k_descale=ks, v_descale=vs)
  want = naive_attention(q, dequantize(k8, ks), dequantize(v8, vs), causal=True)
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2 ** -7, atol=2e-3)


def test_descales_reach_the_kernel_unbroadcast():
  """[Hkv] and per-tensor descales are the custom call's operands as given ([Hkv], [1]): no
  [batch, Hkv] copy, which would cost XLA a broadcast kernel per descale and call."""
  cache = Cache(5, [24, 9])
  arrays = cache.arrays("head")
  arrays["v_descale"] = cache.arrays("tensor_0d")["v_descale"]
  text = jax.jit(lambda q, a: jax_sgl.attention(q, cache.k_pages, cache.v_pages, **a)).lower(
      cache.query(1), arrays).as_text()
  call = next(line for line in text.splitlines() if "custom_call @jax_sgl_attention" in line)
  operand_types = call.rsplit(" : (", 1)[1].split(") -> ")[0].split(", ")
  assert operand_types[8:10] == [f"tensor<{HKV}xf32>", "tensor<1xf32>"], operand_types
  assert f"tensor<2x{HKV}xf32>" not in text


def test_vmap_over_descales():
  """Mapped [Hkv] and per-tensor descales fold with the heads (one call), each instance scaled
  by its own."""
  cache = Cache(11, [21, 6])
  q = cache.query(1)
  arrays = cache.arrays("head")
  ks = jnp.stack([arrays["k_descale"], 2 * arrays["k_descale"]])
  vs = jnp.asarray([0.5, 3.0], jnp.float32) * arrays["v_descale"][0]
  got = jax.vmap(lambda k_descale, v_descale: jax_sgl.attention(
      q, cache.k_pages, cache.v_pages, **{**arrays, "k_descale": k_descale,
                                         "v_descale": v_descale}))(ks, vs)
  for i in range(2):
    want = jax_sgl.attention(q, cache.k_pages, cache.v_pages,
                             **{**arrays, "k_descale": ks[i], "v_descale": vs[i]})
    np.testing.assert_allclose(np.asarray(got[i], np.float32), np.asarray(want, np.float32),
                               rtol=1e-6, atol=1e-6)


def test_jit_and_vmap():
  cache = Cache(7, [30, 12])
  q = cache.query(1)
  arrays = cache.arrays()
  want = jax_sgl.attention(q, cache.k_pages, cache.v_pages, **arrays)
  got = jax.jit(lambda q, k, v, a: jax_sgl.attention(q, k, v, **a))(q, cache.k_pages,
                                                                    cache.v_pages, arrays)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  stacked = jax.vmap(lambda q: jax_sgl.attention(q, cache.k_pages, cache.v_pages, **arrays))(
      jnp.stack([q, q]))
  np.testing.assert_array_equal(np.asarray(stacked[1], np.float32),
                                np.asarray(want, np.float32))


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

def _bad_case():
  cache = Cache(8, [17, 4])
  return cache, cache.query(1), cache.arrays()


def test_without_k_descale_the_seed_type_mismatch():
  cache, q, arrays = _bad_case()
  for drop in (("k_descale",), ("k_descale", "v_descale")):
    a = {n: x for n, x in arrays.items() if n not in drop}
    with pytest.raises(TypeError) as e:
      jax_sgl.attention(q, cache.k_pages, cache.v_pages, **a)
    assert str(e.value) == "Type mismatch: bfloat16 != float8_e4m3fn"
  with pytest.raises(TypeError, match="^Type mismatch: bfloat16 != float8_e4m3fn"):
    jax_sgl.attention(q, kv_buffer=Cache(9, [5], kv_buffer=True).kv_buffer,
                      **{n: x for n, x in arrays.items() if n != "k_descale"})


def test_missing_v_descale():
  cache, q, arrays = _bad_case()
  arrays.pop("v_descale")
  with pytest.raises(ValueError, match="fp8 KV cache .* needs v_descale as well as k_descale"):
    jax_sgl.attention(q, cache.k_pages, cache.v_pages, **arrays)


def test_e5m2_pool_is_not_served():
  cache, q, arrays = _bad_case()
  k5 = cache.k_pages.astype(jnp.float32).astype(E5M2)
  with pytest.raises(NotImplementedError, match="served in float8_e4m3fn only, got k float8_e5m2"):
    jax_sgl.attention(q, k5, k5, **arrays)


def test_v_not_fp8():
  cache, q, arrays = _bad_case()
  with pytest.raises(TypeError, match="Type mismatch: float8_e4m3fn != bfloat16"):
    jax_sgl.attention(q, cache.k_pages, cache.v_pages.astype(BF16), **arrays)


def test_q_descale_with_16_bit_q():
  cache, q, arrays = _bad_case()
  with pytest.raises(ValueError, match="q_descale applies to fp8 q only, got q bfloat16"):
    jax_sgl.attention(q, cache.k_pages, cache.v_pages, q_descale=arrays["k_descale"], **arrays)


@pytest.mark.parametrize("name", ["k_descale", "v_descale"])
@pytest.mark.parametrize("bad,err,msg", [
    (np.ones((3,), np.float32), ValueError, r"\[num_kv_heads\] = \(2,\), \[1\] or \[\].*got \(3,\)"),
    (np.ones((2, 3), np.float32), ValueError, r"got \(2, 3\)"),
    (np.ones((2,), np.float16), TypeError, "must be float32, got float16"),
])
def test_bad_descales(name, bad, err, msg):
  cache, q, arrays = _bad_case()
  arrays[name] = jnp.asarray(bad)
  with pytest.raises(err, match=f"jax_sgl.attention: {name} .*{msg}"):
    jax_sgl.attention(q, cache.k_pages, cache.v_pages, **arrays)


def test_not_differentiable():
  cache, q, arrays = _bad_case()
  with pytest.raises(NotImplementedError, match="gradients"):
    jax.grad(lambda q: jax_sgl.attention(q, cache.k_pages, cache.v_pages, **arrays).astype(
        jnp.float32).sum())(q)


def test_cuda_serves_every_fp8_kv_call_shape():
  """On CUDA the fp8-KV decode takes decode calls and the portable kernel's fp8 form every other
  call shape (prefill, chunked prefill, verify; any head dim the general checks accept): only
  float32 q and float8_e5m2 raise at trace time, naming what is missing."""
  check_attention_cuda(BF16, E4M3, False, k_dtype=E4M3)
  check_attention_cuda(F16, E4M3, False, k_dtype=E4M3)
  with pytest.raises(NotImplementedError, match="float32 q over fp8 k/v runs on the CPU"):
    check_attention_cuda(jnp.float32, E4M3, False, k_dtype=E4M3)
  with pytest.raises(NotImplementedError, match="float8_e4m3fn only"):
    check_attention_cuda(BF16, E5M2, False, k_dtype=E5M2)
  check_attention_cuda(BF16, BF16, False, k_dtype=BF16)   # the 16-bit path is untouched


def test_cuda_lowering_of_a_prefill_shape_passes():
  """With a CUDA build, lowering for CUDA (no GPU needed) reaches the check: prefill and decode
  over an fp8 pool both lower."""
  if "jax_sgl_attention_fwd" not in jax_sgl.CUDA_TARGETS:
    pytest.skip("needs the CUDA build")
  cache = Cache(8, [17, 4])
  arrays = cache.arrays()
  lower = lambda q: jax.jit(lambda q, k, v: jax_sgl.attention(q, k, v, **arrays)).trace(
      q, cache.k_pages, cache.v_pages).lower(lowering_platforms=("cuda",))
  lower(cache.query(12))
  lower(cache.query(1))
