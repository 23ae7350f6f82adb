"""jax_sgl.attention on the default backend vs the float32 reference (and the reference vs an
independent NumPy loop): every layout x mask x GQA, dtypes x head dims, ragged and empty
sequences, KV shorter than q, bad page-table entries, fp8, jit and vmap."""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgl
from attention_cases import (LAYOUTS, MASKS, TOL, make_case, naive_attention,
                             reference_attention)


def assert_close(got, want, dtype):
  tol = TOL[dtype]
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=tol, atol=tol)


def check(q, k, v, dtype=None, **kwargs):
  dtype = dtype or q.dtype.type
  out, lse = jax_sgl.attention(q, k, v, return_lse=True, **kwargs)
  want_out, want_lse = reference_attention(q, k, v, return_lse=True, **kwargs)
  assert out.shape == want_out.shape and out.dtype == want_out.dtype
  assert lse.shape == want_lse.shape and lse.dtype == jnp.float32
  assert_close(out, want_out, dtype)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
  finite = np.isfinite(np.asarray(want_lse))
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], rtol=1e-4,
                             atol=1e-4)
  assert not np.isnan(np.asarray(out, np.float32)).any()
  return out, lse


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("group", [1, 4])
def test_layout_mask_gqa(layout, mask, group):
  q, k, v, arrays = make_case(layout, seed=zlib.crc32(f"{layout}{mask}{group}".encode()), num_heads=4,
                              num_kv_heads=4 // group)
  check(q, k, v, **arrays, **MASKS[mask])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("layout", ["dense", "paged_pages"])
def test_dtypes_and_head_dims(dtype, head_dim, layout):
  q, k, v, arrays = make_case(layout, seed=head_dim, head_dim=head_dim, dtype=dtype,
                              q_lens=[1, 19, 7], k_lens=[33, 19, 40], page_size=16)
  check(q, k, v, causal=True, **arrays)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_dim_v_differs(layout):
  q, k, v, arrays = make_case(layout, seed=3, head_dim=128, head_dim_v=64)
  out, _ = check(q, k, v, causal=True, **arrays)
  assert out.shape[-1] == 64


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", ["none", "causal", "causal_window", "softcap"])
def test_reference_matches_naive_loop(layout, mask):
  q, k, v, arrays = make_case(layout, seed=11, dtype=jnp.float32, q_lens=[5, 1, 9],
                              k_lens=[5, 12, 20])
  want = naive_attention(q, k, v, **arrays, **MASKS[mask])
  got = jax_sgl.attention(q, k, v, **arrays, **MASKS[mask])
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_long_sequence_many_blocks():
  q, k, v, _ = make_case("dense", seed=5, batch=1, q_lens=[1000], k_lens=[1000], num_heads=2,
                         num_kv_heads=1, dtype=jnp.float32)
  check(q, k, v, causal=True)
  check(q, k, v, window=(100, 37))


def test_kv_shorter_than_q_masks_leading_rows():
  q, k, v, arrays = make_case("varlen", seed=6, q_lens=[9, 4], k_lens=[3, 4])
  out, lse = check(q, k, v, causal=True, **arrays)
  # Sequence 0: rows 0..5 see no key (diagonal i + 3 - 9 < 0): 0 output, -inf lse.
  assert np.all(np.asarray(out[:6], np.float32) == 0)
  assert np.all(np.isneginf(np.asarray(lse)[:, :6]))
  assert np.all(np.isfinite(np.asarray(lse)[:, 6:]))


@pytest.mark.parametrize("layout", ["varlen", "paged_tokens", "paged_pages"])
def test_empty_sequences(layout):
  q, k, v, arrays = make_case(layout, seed=7, q_lens=[0, 5, 3, 0], k_lens=[4, 0, 6, 0])
  out, lse = check(q, k, v, **arrays)
  cu = np.asarray(arrays["cu_seqlens_q"])
  assert np.all(np.asarray(out[cu[1]:cu[2]], np.float32) == 0)   # k_len 0 -> fully masked
  assert np.all(np.isneginf(np.asarray(lse)[:, cu[1]:cu[2]]))


def test_rows_past_cu_seqlens_are_zero():
  q, k, v, arrays = make_case("varlen", seed=8, q_lens=[3, 4], k_lens=[5, 6])
  q = jnp.concatenate([q, q[:5]])                  # 5 packed rows that no sequence covers
  out, lse = check(q, k, v, **arrays)
  assert np.all(np.asarray(out[7:], np.float32) == 0)
  assert np.all(np.isneginf(np.asarray(lse)[:, 7:]))


@pytest.mark.parametrize("layout", ["paged_tokens", "paged_pages"])
def test_bad_page_entries_are_masked_not_read(layout):
  q, k, v, arrays = make_case(layout, seed=9, q_lens=[2, 3], k_lens=[9, 12], page_size=4)
  table = np.asarray(arrays["page_table"]).copy()
  num_pages = k.shape[0]
  table[0, 1] = num_pages + 1000                   # past the pool
  table[1, 0] = -5                                 # negative
  arrays["page_table"] = jnp.asarray(table)
  arrays["seqused_k"] = jnp.asarray([9, 10**6], jnp.int32)   # beyond the table: clamped
  check(q, k, v, **arrays)
  want = naive_attention(q, k, v, **{**arrays, "seqused_k": np.array([9, table.shape[1] * (
      1 if layout == "paged_tokens" else 4)])})
  got = jax_sgl.attention(q, k, v, **arrays)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)


def test_inconsistent_cu_seqlens_never_read_out_of_bounds():
  q, k, v, arrays = make_case("varlen", seed=10, q_lens=[3, 4], k_lens=[5, 6])
  arrays["cu_seqlens_k"] = jnp.asarray([0, 500, 7], jnp.int32)   # past total_k, then backwards
  arrays["cu_seqlens_q"] = jnp.asarray([0, 3, 99], jnp.int32)
  check(q, k, v, **arrays)


def test_softmax_scale_and_seqused_k_on_dense():
  q, k, v, _ = make_case("dense", seed=12, q_lens=[4, 4], k_lens=[10, 10])
  check(q, k, v, softmax_scale=0.3, seqused_k=jnp.asarray([3, 10], jnp.int32), causal=True)


def test_decode_batch_paged():
  q, k, v, arrays = make_case("paged_pages", seed=13, q_lens=[1] * 6,
                              k_lens=[1, 17, 64, 3, 100, 33], num_heads=8, num_kv_heads=1,
                              head_dim=128, page_size=16)
  check(q, k, v, causal=True, **arrays)


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8(fp8):
  q, k, v, _ = make_case("dense", seed=14, q_lens=[5, 5], k_lens=[9, 9], dtype=jnp.float32)
  rng = np.random.default_rng(0)
  desc = lambda: jnp.asarray(rng.uniform(0.5, 2.0, (2, 2)), jnp.float32)
  qd, kd, vd = desc(), desc(), desc()
  q8, k8, v8 = (x.astype(fp8) for x in (q, k, v))
  out = jax_sgl.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
  assert out.dtype == jnp.bfloat16
  want = reference_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
  assert_close(out, want, jnp.bfloat16)
  # v_dequant: bf16 q/k with an fp8 v and its scale.
  qb, kb = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
  out = jax_sgl.attention(qb, kb, v8, v_descale=vd)
  assert_close(out, reference_attention(qb, kb, v8, v_descale=vd), jnp.bfloat16)


def test_jit():
  q, k, v, arrays = make_case("paged_pages", seed=15)
  f = jax.jit(functools.partial(jax_sgl.attention, causal=True))
  assert_close(f(q, k, v, **arrays), reference_attention(q, k, v, causal=True, **arrays),
               jnp.bfloat16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vmap_over_qkv(layout):
  cases = [make_case(layout, seed=20 + i, q_lens=[3, 5], k_lens=[6, 5]) for i in range(3)]
  q, k, v = (jnp.stack(xs) for xs in zip(*[c[:3] for c in cases]))
  arrays = cases[0][3]
  got = jax.vmap(lambda q, k, v: jax_sgl.attention(q, k, v, causal=True, return_lse=True,
                                                   **arrays))(q, k, v)
  for i in range(3):
    want = reference_attention(q[i], k[i], v[i], causal=True, return_lse=True, **arrays)
    assert_close(got[0][i], want[0], jnp.bfloat16)
    np.testing.assert_allclose(got[1][i], want[1], rtol=1e-4, atol=1e-4)


def test_vmap_q_only_and_batched_index_arrays():
  q, k, v, arrays = make_case("paged_tokens", seed=30, q_lens=[2, 3], k_lens=[7, 4])
  qs = jnp.stack([q, -q])
  got = jax.vmap(lambda q: jax_sgl.attention(q, k, v, **arrays))(qs)
  for i in range(2):
    assert_close(got[i], reference_attention(qs[i], k, v, **arrays), jnp.bfloat16)
  used = jnp.stack([arrays["seqused_k"], jnp.asarray([1, 2], jnp.int32)])
  got = jax.vmap(lambda u: jax_sgl.attention(q, k, v, page_table=arrays["page_table"],
                                             cu_seqlens_q=arrays["cu_seqlens_q"],
                                             seqused_k=u))(used)
  for i in range(2):
    want = reference_attention(q, k, v, page_table=arrays["page_table"],
                               cu_seqlens_q=arrays["cu_seqlens_q"], seqused_k=used[i])
    assert_close(got[i], want, jnp.bfloat16)
