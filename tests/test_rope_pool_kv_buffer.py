"""rope_pool_fused into sglang-jax's fused K/V buffer (`kv_buffer=`) and with the caller's inv_freq
table, on the default backend: against the float32 reference (per-dtype TOL) and a float64 NumPy
oracle (within 2x the reference's own error, FA3's rule), on a NaN-poisoned buffer whose pad
columns and unwritten rows must come back bit for bit; 5-D, 4-D and 3-D buffers, page sizes 1, 5
and 16, GQA, partial rotary, both rotation styles, llama3-scaled frequencies; jit with donation
(in place, checked in the compiled HLO too), vmap, and every trace-time error."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from jax_sgl import reference
from test_rope_pool import TOL, assert_matches_reference
UINT = {jnp.float32: np.uint32, jnp.float16: np.uint16, jnp.bfloat16: np.uint16}
PACKING = 2   # sglang-jax's packing axis in the 5-D form (a reshape of the head axis)


def llama3_inv_freq(rotary_dim, base=500000.0, factor=8.0, low=1.0, high=4.0, orig=8192):
  """Llama 3's scaled frequencies as sglang-jax's Llama3RotaryEmbedding computes them (float32)."""
  inv = 1.0 / (base ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim))
  wave_len = 2 * math.pi / inv
  smooth = (orig / wave_len - low) / (high - low)
  scaled = np.where(wave_len < orig / high, inv,
                    np.where(wave_len > orig / low, inv / factor,
                             (1 - smooth) * inv / factor + smooth * inv))
  return scaled.astype(np.float32)


def buffer_shape(form, num_pages, page_size, hkv, d_pad):
  if form == "5d":
    return (num_pages, page_size, 2 * hkv // PACKING, PACKING, d_pad)
  if form == "4d":
    return (num_pages, page_size, 2 * hkv, d_pad)
  assert page_size == 1
  return (num_pages, 2 * hkv, d_pad)


def make_case(seed, num_tokens, hq, hkv, d, d_pad, num_pages, page_size, form, dtype,
              max_pos=4096):
  """Fresh random q/k/v, distinct slots with padding (< 0) and out-of-range ones mixed in, and a
  buffer poisoned with NaN."""
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(dtype)
  q, k, v = f(num_tokens, hq, d), f(num_tokens, hkv, d), f(num_tokens, hkv, d)
  positions = jnp.asarray(rng.integers(0, max_pos, num_tokens), jnp.int32)
  num_slots = num_pages * page_size
  slots = rng.permutation(num_slots + num_tokens)[:num_tokens] - num_tokens // 4
  kv_buffer = jnp.full(buffer_shape(form, num_pages, page_size, hkv, d_pad), jnp.nan, dtype)
  return q, k, v, positions, jnp.asarray(slots, jnp.int32), kv_buffer


def rows(kv_buffer):
  """The buffer as [num_slots, 2 * Hkv, Dp] in NumPy (a reshape, as the kernels read it)."""
  x = np.asarray(kv_buffer)
  return x.reshape((-1,) + x.shape[-2:]) if x.ndim != 5 else \
      x.reshape(x.shape[0] * x.shape[1], x.shape[2] * x.shape[3], x.shape[4])


def bits(x, dtype):
  return np.asarray(x).view(UINT[dtype])


def oracle(x, positions, inv_freq, rotary_dim, is_neox):
  """RoPE in float64 NumPy, independent of reference.py."""
  x = np.asarray(x, np.float64)
  angle = np.asarray(positions, np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None]
  c, s = np.cos(angle)[:, None], np.sin(angle)[:, None]
  out = x.copy()
  half = rotary_dim // 2
  ia = np.arange(half) if is_neox else 2 * np.arange(half)
  ib = ia + half if is_neox else ia + 1
  a, b = x[..., ia], x[..., ib]
  out[..., ia] = a * c - b * s
  out[..., ib] = b * c + a * s
  return out


def assert_within_reference_error(got, want_ref, want64, dtype, name):
  """FA3's rule: the kernel's max error vs the float64 oracle is at most 2x the float32
  reference's (stored in the same dtype), plus float32 noise."""
  err = np.max(np.abs(np.asarray(got, np.float64) - want64), initial=0.0)
  ref_err = np.max(np.abs(np.asarray(want_ref, np.float64) - want64), initial=0.0)
  assert err <= 2 * ref_err + 1e-5, (name, err, ref_err)


def check_kv_buffer(args, **kwargs):
  """Runs the public op and the reference; checks outputs, the oracle, and the buffer bit for bit:
  written rows hold exactly k_rot / v in [0, D) of their K / V heads, all else is the input."""
  q, k, v, positions, slots, kv_buffer = args
  dtype = q.dtype.type
  d = q.shape[-1]
  before = rows(kv_buffer).copy()
  q_rot, k_rot, out = jax_sgl.rope_pool_fused(q, k, v, positions, slots, kv_buffer=kv_buffer,
                                              **kwargs)
  want = reference.rope_pool_fused(q, k, v, positions, slots, kv_buffer=kv_buffer, **kwargs)
  assert out.shape == kv_buffer.shape and out.dtype == kv_buffer.dtype
  for g, w, name in zip((q_rot, k_rot), want[:2], ("q_rot", "k_rot")):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=TOL[dtype], atol=TOL[dtype], err_msg=name)
  assert_matches_reference(out, want[2], "kv_buffer")

  rotary_dim = kwargs.get("rotary_dim") or d
  inv_freq = kwargs.get("inv_freq")
  if inv_freq is None:
    inv_freq = reference.rope_inv_freq(rotary_dim, kwargs.get("rope_base"))
  is_neox = kwargs.get("is_neox", True)
  for g, w, x, name in ((q_rot, want[0], q, "q_rot"), (k_rot, want[1], k, "k_rot")):
    want64 = oracle(np.asarray(x, np.float32), positions, inv_freq, rotary_dim, is_neox)
    assert_within_reference_error(g, w, want64, dtype, name)

  got_rows = rows(out)
  s = np.asarray(slots)
  valid = (s >= 0) & (s < got_rows.shape[0])
  expect = before.copy()
  expect[s[valid], 0::2, :d] = np.asarray(k_rot)[valid]
  expect[s[valid], 1::2, :d] = np.asarray(v)[valid]
  np.testing.assert_array_equal(bits(got_rows, dtype), bits(expect, dtype))
  assert np.isnan(np.asarray(got_rows[..., d:], np.float32)).all()   # pad columns untouched
  return q_rot, k_rot, out


# Each (form, page size) once over every dtype; GQA 8/2 and MQA 4/1; head dim padded (64 -> 128)
# and unpadded (128), an odd head dim (80 -> 128) on one case.
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("form,page_size,num_pages,hq,hkv,d,d_pad,num_tokens", [
    ("3d", 1, 40, 8, 2, 64, 128, 19),
    ("4d", 1, 50, 4, 1, 128, 128, 33),
    ("4d", 5, 9, 8, 2, 80, 128, 7),
    ("5d", 16, 6, 8, 2, 64, 128, 99),
    ("5d", 5, 11, 6, 2, 128, 256, 1),
])
def test_matches_reference_and_oracle(dtype, form, page_size, num_pages, hq, hkv, d, d_pad,
                                      num_tokens):
  args = make_case(num_tokens, num_tokens, hq, hkv, d, d_pad, num_pages, page_size, form, dtype)
  check_kv_buffer(args)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [None, 64, 32])
def test_llama3_inv_freq_partial_rotary_and_styles(is_neox, rotary_dim):
  args = make_case(7, 33, 8, 2, 128, 128, 8, 16, "5d", jnp.bfloat16, max_pos=65536)
  inv_freq = llama3_inv_freq(rotary_dim or 128)
  check_kv_buffer(args, inv_freq=jnp.asarray(inv_freq), rotary_dim=rotary_dim, is_neox=is_neox)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_inv_freq_with_separate_pools(is_neox, dtype):
  """inv_freq also drives the k_pool/v_pool form: vs the reference and the float64 oracle."""
  q, k, v, positions, slots, _ = make_case(8, 19, 4, 2, 96, 96, 40, 1, "3d", dtype,
                                           max_pos=65536)
  k_pool = v_pool = jnp.zeros((40, 2, 96), dtype)
  inv_freq = jnp.asarray(llama3_inv_freq(64))
  kwargs = dict(inv_freq=inv_freq, rotary_dim=64, is_neox=is_neox)
  got = jax_sgl.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **kwargs)
  want = reference.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **kwargs)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=TOL[dtype], atol=TOL[dtype])
  want64 = oracle(np.asarray(q, np.float32), positions, inv_freq, 64, is_neox)
  assert_within_reference_error(got[0], want[0], want64, dtype, "q_rot")


def test_inv_freq_from_rope_base_is_the_rope_base_path():
  """rope_base=b and inv_freq=reference.rope_inv_freq(rotary_dim, b) read the same table: equal
  bits."""
  q, k, v, positions, slots, kv_buffer = make_case(9, 33, 8, 2, 64, 128, 40, 1, "4d",
                                                   jnp.float32)
  a = jax_sgl.rope_pool_fused(q, k, v, positions, slots, kv_buffer=kv_buffer, rope_base=5e5,
                              rotary_dim=48)
  b = jax_sgl.rope_pool_fused(q, k, v, positions, slots, kv_buffer=kv_buffer, rotary_dim=48,
                              inv_freq=reference.rope_inv_freq(48, 5e5))
  for x, y in zip(a, b):
    np.testing.assert_array_equal(bits(x, jnp.float32), bits(y, jnp.float32))


def test_fused_buffer_holds_what_separate_pools_hold():
  q, k, v, positions, slots, kv_buffer = make_case(10, 33, 8, 2, 128, 128, 4, 16, "5d",
                                                   jnp.bfloat16)
  kv_buffer = jnp.zeros_like(kv_buffer)
  pools = jnp.zeros((64, 2, 128), jnp.bfloat16)
  _, _, k_pool, v_pool = jax_sgl.rope_pool_fused(q, k, v, positions, slots, pools, pools)
  _, _, out = jax_sgl.rope_pool_fused(q, k, v, positions, slots, kv_buffer=kv_buffer)
  r = rows(out)
  np.testing.assert_array_equal(bits(r[:, 0::2], jnp.bfloat16), bits(k_pool, jnp.bfloat16))
  np.testing.assert_array_equal(bits(r[:, 1::2], jnp.bfloat16), bits(v_pool, jnp.bfloat16))


def test_jit_with_donation_writes_in_place():
  q, k, v, positions, slots, kv_buffer = make_case(11, 33, 8, 2, 64, 128, 8, 16, "5d",
                                                   jnp.bfloat16)
  before = jnp.copy(kv_buffer)   # an XLA copy: a NumPy view would pin the buffer, blocking donation
  ptr = kv_buffer.unsafe_buffer_pointer()
  f = jax.jit(lambda q, k, v, p, s, buf: jax_sgl.rope_pool_fused(q, k, v, p, s, kv_buffer=buf),
              donate_argnums=5)
  q_rot, k_rot, out = f(q, k, v, positions, slots, kv_buffer)
  assert kv_buffer.is_deleted()
  assert out.unsafe_buffer_pointer() == ptr
  want = reference.rope_pool_fused(q, k, v, positions, slots, kv_buffer=before)
  np.testing.assert_array_equal(bits(out, jnp.bfloat16), bits(want[2], jnp.bfloat16))


def _compiled_hlo(donate):
  q, k, v, positions, slots, kv_buffer = make_case(12, 16, 8, 2, 64, 128, 64, 16, "5d",
                                                   jnp.bfloat16)
  f = lambda q, k, v, p, s, buf: jax_sgl.rope_pool_fused(q, k, v, p, s, kv_buffer=buf)
  jitted = jax.jit(f, donate_argnums=(5,) if donate else ())
  return jitted.lower(q, k, v, positions, slots, kv_buffer).compile().as_text(), kv_buffer.shape


def _buffer_copies(hlo, shape):
  """HLO instructions that produce a whole buffer-shaped array other than the custom call and the
  parameter / tuple plumbing: copies, slices, gathers, fusions (e.g. copy.3 = bf16[64,16,...])."""
  dims = ",".join(map(str, shape))
  found = []
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT\s+)?(\S+)\s*=\s*\w+\[" + re.escape(dims) + r"\]\S*\s+(\w[\w-]*)\(",
                 line)
    if m and m.group(2) not in ("parameter", "get-tuple-element", "custom-call", "bitcast",
                                "tuple"):
      found.append(line.strip())
  return found


def test_compiled_call_writes_the_buffer_in_place():
  """With donation the compiled program aliases the buffer parameter to the output and contains no
  buffer-sized copy; without donation XLA must copy it (the check would catch a copy)."""
  hlo, shape = _compiled_hlo(donate=True)
  assert "jax_sgl_rope_pool_fwd" in hlo
  # Custom call output 2 is operand 7 (the buffer, after inv_freq and kv_scales), and the
  # program's output 2 is parameter 5.
  assert re.search(r"output_to_operand_aliasing=\{\{2\}: \(7, \{\}\)\}", hlo), hlo
  assert re.search(r"input_output_alias=\{ \{2\}: \(5, \{\}", hlo), hlo
  assert _buffer_copies(hlo, shape) == []
  hlo_copy, _ = _compiled_hlo(donate=False)
  assert _buffer_copies(hlo_copy, shape), "without donation the buffer should be copied"


def test_vmap_each_instance_owns_its_buffer():
  cases = [make_case(20 + i, 7, 4, 2, 64, 128, 3, 5, "4d", jnp.float32) for i in range(3)]
  stacked = [jnp.stack(xs) for xs in zip(*cases)]
  got = jax.vmap(lambda q, k, v, p, s, b: jax_sgl.rope_pool_fused(q, k, v, p, s, kv_buffer=b))(
      *stacked)
  for i, (q, k, v, p, s, b) in enumerate(cases):
    want = reference.rope_pool_fused(q, k, v, p, s, kv_buffer=b)
    for g, w in zip(got, want):
      np.testing.assert_allclose(np.asarray(g[i]), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_vmap_over_inv_freq_is_refused():
  q, k, v, p, s, b = make_case(30, 5, 2, 2, 64, 128, 4, 1, "3d", jnp.float32)
  inv = jnp.stack([jnp.asarray(reference.rope_inv_freq(64))] * 2)
  f = lambda inv: jax_sgl.rope_pool_fused(q, k, v, p, s, kv_buffer=b, inv_freq=inv)
  with pytest.raises(NotImplementedError, match="vmap over inv_freq is not supported"):
    jax.vmap(f)(inv)


# --------------------------------------------------------------------------------------------
# Trace-time errors (jax.eval_shape: no kernel runs)
# --------------------------------------------------------------------------------------------

S = jax.ShapeDtypeStruct
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
T, HQ, HKV, D, DP = 5, 8, 2, 64, 128


def fused_args(**over):
  args = dict(q=S((T, HQ, D), BF16), k=S((T, HKV, D), BF16), v=S((T, HKV, D), BF16),
              positions=S((T,), I32), slots=S((T,), I32), k_pool=None, v_pool=None,
              kv_buffer=S((4, 16, 2 * HKV, DP), BF16))
  args.update(over)
  return args


def eval_fused(args, **kwargs):
  arrays = {n: a for n, a in args.items() if a is not None}
  names = list(arrays)

  def f(*a):
    return jax_sgl.rope_pool_fused(**dict(zip(names, a)), **kwargs)
  return jax.eval_shape(f, *arrays.values())


ERROR_CASES = [
    (fused_args(k_pool=S((32, HKV, D), BF16), v_pool=S((32, HKV, D), BF16)), {}, ValueError,
     "give k_pool/v_pool or kv_buffer, not both"),
    (fused_args(k_pool=S((32, HKV, D), BF16)), {}, ValueError,
     "give k_pool/v_pool or kv_buffer, not both"),
    (fused_args(kv_buffer=None), {}, ValueError, "needs k_pool and v_pool, or kv_buffer="),
    (fused_args(kv_buffer=None, k_pool=S((32, HKV, D), BF16)), {}, ValueError,
     "needs k_pool and v_pool, or kv_buffer="),
    (fused_args(kv_buffer=S((64, 2 * HKV * DP), BF16)), {}, ValueError,
     "kv_buffer must be [num_pages, page_size, 2 * num_kv_heads, head_dim]"),
    (fused_args(kv_buffer=S((1, 4, 16, 2, 2, DP), BF16)), {}, ValueError,
     "kv_buffer must be [num_pages, page_size, 2 * num_kv_heads, head_dim]"),
    (fused_args(kv_buffer=S((4, 16, 3, DP), BF16)), {}, ValueError,
     "holds K and V interleaved (K0, V0, K1, V1, ...) so it must be even"),
    (fused_args(kv_buffer=S((4, 16, 2 * HKV + 2, DP), BF16)), {}, ValueError,
     "kv_buffer holds 3 KV heads (K and V interleaved on its head axis) but k has 2"),
    (fused_args(kv_buffer=S((4, 16, 3, PACKING, DP), BF16)), {}, ValueError,
     "kv_buffer holds 3 KV heads (K and V interleaved on its head axis) but k has 2"),
    (fused_args(kv_buffer=S((4, 16, 2 * HKV, 32), BF16)), {}, ValueError,
     "kv_buffer's head dim 32 is smaller than q/k/v's 64"),
    (fused_args(kv_buffer=S((4, 16, 2 * HKV, DP), F32)), {}, ValueError,
     "pool dtypes must match q/k/v dtype"),
    (fused_args(kv_buffer=S((4, 16, 2 * HKV, DP), I32)), {}, TypeError,
     "kv_buffer must be one of"),
    (fused_args(v=S((T, HKV, D), F32)), {}, ValueError, "q/k/v dtypes must match"),
    (fused_args(), dict(inv_freq=S((D // 2,), F32), rope_base=10000.0), ValueError,
     "give rope_base or inv_freq, not both"),
    (fused_args(), dict(inv_freq=S((D // 2,), BF16)), TypeError, "inv_freq must be float32"),
    (fused_args(), dict(inv_freq=S((D,), F32)), ValueError,
     "inv_freq must have shape [rotary_dim // 2] = (32,), got (64,)"),
    (fused_args(), dict(inv_freq=S((D // 2,), F32), rotary_dim=32), ValueError,
     "inv_freq must have shape [rotary_dim // 2] = (16,), got (32,)"),
    (fused_args(), dict(rope_base=-1.0), ValueError, "rope_base must be a positive finite float"),
]


@pytest.mark.parametrize("args,kwargs,exc,message", ERROR_CASES)
def test_trace_time_errors(args, kwargs, exc, message):
  kwargs = dict(kwargs)
  if "inv_freq" in kwargs:   # an abstract inv_freq travels as a traced operand
    inv = kwargs.pop("inv_freq")
    args = dict(args, inv_freq=inv)
  with pytest.raises(exc, match=re.escape(message)):
    eval_fused(args, **kwargs)


def test_eval_shape_of_every_form():
  for buf in (S((40, 2 * HKV, DP), BF16), S((4, 16, 2 * HKV, DP), BF16),
              S((4, 16, 2 * HKV // PACKING, PACKING, DP), BF16)):
    shapes = eval_fused(fused_args(kv_buffer=buf))
    assert [s.shape for s in shapes] == [(T, HQ, D), (T, HKV, D), buf.shape]


def test_separate_pools_default_contract_unchanged():
  """The seed's positional call still returns four arrays with SGLang's pool check messages."""
  args = dict(q=S((T, HQ, D), BF16), k=S((T, HKV, D), BF16), v=S((T, HKV, D), BF16),
              positions=S((T,), I32), slots=S((T,), I32), k_pool=S((32, HKV, D), BF16),
              v_pool=S((32, HKV, D), BF16))
  shapes = jax.eval_shape(jax_sgl.rope_pool_fused, *args.values())
  assert len(shapes) == 4
  with pytest.raises(ValueError, match=re.escape("rope_pool_fused expects pool tensors to be 3-D")):
    jax.eval_shape(jax_sgl.rope_pool_fused, *list(args.values())[:5], S((32, HKV * D), BF16),
                   args["v_pool"])
