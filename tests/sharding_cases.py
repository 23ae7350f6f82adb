"""Sharded-jit cases for test_sharding.py, run in a subprocess with 8 virtual CPU devices.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_cases.py [--gspmd]

Each case jits one function over a ('data', 'model') = (2, 4) mesh and checks that the sharded
result equals the unsharded one exactly (every device runs the same kernel on whole heads and
sequences), and, for the supported shardings, that the compiled HLO moves no q/k/v/pool data
(no all-gather / all-to-all / collective-permute) and that donated pools are written in place.
Prints one line per case, `PASS name` or `FAIL name: why`; exits 1 if any failed, 2 if fewer
than 8 devices.
"""

from __future__ import annotations

import re
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_sgl

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce")
CASES = {}


def case(fn):
  CASES[fn.__name__] = fn
  return fn


def mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def rand(rng, *shape, dtype=jnp.float32):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


def run_sharded(fn, args, specs, *, supported=True, donate=(), want_specs=None, tol=0.0):
  """Runs fn unsharded and sharded; checks equality, collectives, donation, output shardings.
  tol > 0: outputs that include XLA's own reductions (their order may change with the sharding)
  need only agree that closely."""
  m = mesh()
  want = jax.jit(fn)(*args)
  placed = [jax.device_put(a, NamedSharding(m, s)) for a, s in zip(args, specs)]
  jf = jax.jit(fn, donate_argnums=donate)
  hlo = jf.lower(*placed).compile().as_text()
  got = jf(*placed)
  for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
    np.testing.assert_allclose(np.asarray(g.astype(jnp.float32)),
                               np.asarray(w.astype(jnp.float32)), rtol=tol, atol=tol,
                               err_msg=f"output {i}")
  found = [c for c in COLLECTIVES if c in hlo]
  if supported:
    assert not found, f"collectives in the compiled HLO: {found}"
  else:     # the explicit reshard to a supported sharding
    assert found, "an unsupported sharding compiled without any resharding collective"
  for i in donate:
    assert placed[i].is_deleted(), f"donated argument {i} was not consumed"
  if donate:
    copies = [l for l in hlo.splitlines() if re.search(r"\bcopy\(", l)]
    assert not copies, f"donated pools are copied: {copies[:2]}"
  if want_specs is not None:
    for i, (g, s) in enumerate(zip(jax.tree.leaves(got), want_specs)):
      assert g.sharding.is_equivalent_to(NamedSharding(m, s), g.ndim), \
          f"output {i} sharding {g.sharding.spec}, expected {s}"
  return hlo


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------

BSHD = P("data", None, "model", None)


@case
def attention_dense_batch_and_heads():
  rng = np.random.default_rng(1)
  q, k, v = rand(rng, 4, 19, 8, 16), rand(rng, 4, 23, 4, 16), rand(rng, 4, 23, 4, 16)
  fn = lambda q, k, v: jax_sgl.attention(q, k, v, causal=True, return_lse=True)
  run_sharded(fn, (q, k, v), (BSHD,) * 3, want_specs=(BSHD, P("data", "model", None)))


@case
def attention_dense_heads_over_both_axes_softcap_window():
  rng = np.random.default_rng(2)
  q, k, v = rand(rng, 3, 7, 16, 8), rand(rng, 3, 9, 8, 8), rand(rng, 3, 9, 8, 8)
  spec = P(None, None, ("data", "model"), None)
  fn = lambda q, k, v: jax_sgl.attention(q, k, v, window=(3, 1), softcap=5.0, return_lse=True)
  run_sharded(fn, (q, k, v), (spec,) * 3, want_specs=(spec,))


@case
def attention_dense_fp8_descale():
  rng = np.random.default_rng(3)
  f8 = jnp.float8_e4m3fn
  q, k, v = (rand(rng, 2, 5, 8, 16, dtype=f8), rand(rng, 2, 6, 4, 16, dtype=f8),
             rand(rng, 2, 6, 4, 16, dtype=f8))
  sq, sk, sv = (jnp.asarray(rng.uniform(0.5, 2, (2, 4)), jnp.float32) for _ in range(3))
  fn = lambda q, k, v, sq, sk, sv: jax_sgl.attention(q, k, v, causal=True, q_descale=sq,
                                                    k_descale=sk, v_descale=sv)
  run_sharded(fn, (q, k, v, sq, sk, sv), (BSHD,) * 3 + (P("data", "model"),) * 3)


@case
def attention_dense_fp8_descale_shapes():
  """Descales per (batch, kv head), per kv head and per tensor in one call, reaching the kernels
  unbroadcast: [B, Hkv] split with batch and heads, [Hkv] with the heads, [] replicated."""
  rng = np.random.default_rng(30)
  f8 = jnp.float8_e4m3fn
  q, k, v = (rand(rng, 2, 5, 8, 16, dtype=f8), rand(rng, 2, 6, 4, 16, dtype=f8),
             rand(rng, 2, 6, 4, 16, dtype=f8))
  sq = jnp.asarray(rng.uniform(0.5, 2, (2, 4)), jnp.float32)
  sk = jnp.asarray(rng.uniform(0.5, 2, (4,)), jnp.float32)
  sv = jnp.asarray(rng.uniform(0.5, 2), jnp.float32)
  fn = lambda q, k, v, sq, sk, sv: jax_sgl.attention(q, k, v, causal=True, q_descale=sq,
                                                    k_descale=sk, v_descale=sv)
  run_sharded(fn, (q, k, v, sq, sk, sv),
              (BSHD,) * 3 + (P("data", "model"), P("model"), P()))


@case
def attention_dense_blockscaled_batch_and_heads():
  """Block scales (qk_blockscaled) split as q and k: e8m0 [B, S, H, D/32] beside e4m3 q/k."""
  rng = np.random.default_rng(4)
  f8, e8m0 = jnp.float8_e4m3fn, jnp.float8_e8m0fnu
  q, k = rand(rng, 2, 5, 8, 64, dtype=f8), rand(rng, 2, 6, 4, 64, dtype=f8)
  v = rand(rng, 2, 6, 4, 64, dtype=jnp.bfloat16)
  sq, sk = (jnp.asarray(rng.integers(123, 132, s).astype(np.uint8)).view(e8m0)
            for s in ((2, 5, 8, 2), (2, 6, 4, 2)))
  fn = lambda q, k, v, sq, sk: jax_sgl.attention(q, k, v, causal=True, q_descale=sq,
                                                 k_descale=sk, return_lse=True)
  run_sharded(fn, (q, k, v, sq, sk), (BSHD,) * 5, want_specs=(BSHD, P("data", "model", None)))


@case
def attention_dense_grad_batch_and_heads():
  rng = np.random.default_rng(11)
  q, k, v = rand(rng, 4, 19, 8, 16), rand(rng, 4, 23, 4, 16), rand(rng, 4, 23, 4, 16)
  w = rand(rng, 4, 19, 8, 16)
  loss = lambda q, k, v, w: jnp.sum(jax_sgl.attention(q, k, v, causal=True, softcap=4.0) * w)
  fn = jax.grad(loss, argnums=(0, 1, 2))
  run_sharded(fn, (q, k, v, w), (BSHD,) * 4, want_specs=(BSHD,) * 3)


@case
def attention_dense_sinks_batch_and_heads():
  rng = np.random.default_rng(13)
  q, k, v = rand(rng, 4, 19, 8, 16), rand(rng, 4, 11, 4, 16), rand(rng, 4, 11, 4, 16)
  sinks = jnp.asarray(rng.uniform(-1, 3, 8), jnp.float32)
  fn = lambda q, k, v, s: jax_sgl.attention(q, k, v, causal=True, sinks=s, return_lse=True)
  run_sharded(fn, (q, k, v, sinks), (BSHD,) * 3 + (P("model"),),
              want_specs=(BSHD, P("data", "model", None)))


@case
def attention_dense_sinks_grad_heads():
  """d sinks sums over batch and rows: local when only the heads are sharded."""
  rng = np.random.default_rng(14)
  q, k, v = rand(rng, 2, 19, 8, 16), rand(rng, 2, 11, 4, 16), rand(rng, 2, 11, 4, 16)
  w = rand(rng, 2, 19, 8, 16)
  sinks = jnp.asarray(rng.uniform(-1, 3, 8), jnp.float32)
  loss = lambda q, k, v, s, w: jnp.sum(jax_sgl.attention(q, k, v, causal=True, sinks=s) * w)
  fn = jax.grad(loss, argnums=(0, 1, 2, 3))
  shd = P(None, None, "model", None)
  run_sharded(fn, (q, k, v, sinks, w), (shd,) * 3 + (P("model"), shd),
              want_specs=(shd,) * 3 + (P("model"),), tol=1e-5)


@case
def attention_varlen_grad_heads():
  rng = np.random.default_rng(12)
  cu_q = jnp.asarray(np.cumsum([0, 5, 1, 13]), jnp.int32)
  cu_k = jnp.asarray(np.cumsum([0, 9, 4, 13]), jnp.int32)
  q, k, v, w = rand(rng, 19, 8, 16), rand(rng, 26, 4, 16), rand(rng, 26, 4, 16), \
      rand(rng, 19, 8, 16)
  loss = lambda q, k, v, w, cq, ck: jnp.sum(jax_sgl.attention(
      q, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck) * w)
  fn = jax.grad(loss, argnums=(0, 1, 2))
  thd = P(None, "model", None)
  run_sharded(fn, (q, k, v, w, cu_q, cu_k), (thd,) * 4 + (P(),) * 2, want_specs=(thd,) * 3)


@case
def attention_varlen_heads():
  rng = np.random.default_rng(4)
  lens_q, lens_k = [5, 1, 13], [9, 4, 13]
  cu_q = jnp.asarray(np.cumsum([0] + lens_q), jnp.int32)
  cu_k = jnp.asarray(np.cumsum([0] + lens_k), jnp.int32)
  q, k, v = rand(rng, 19, 8, 16), rand(rng, 26, 4, 16), rand(rng, 26, 4, 16)
  fn = lambda q, k, v, cq, ck: jax_sgl.attention(q, k, v, causal=True, cu_seqlens_q=cq,
                                                cu_seqlens_k=ck, return_lse=True)
  thd = P(None, "model", None)
  run_sharded(fn, (q, k, v, cu_q, cu_k), (thd,) * 3 + (P(),) * 2,
              want_specs=(thd, P("model", None)))


def _paged_inputs(rng, batch, page_size, num_pages, hkv, d):
  pool = (num_pages * page_size, hkv, d) if page_size == 1 else (num_pages, page_size, hkv, d)
  k, v = rand(rng, *pool), rand(rng, *pool)
  max_pages = num_pages // batch
  table = jnp.asarray(rng.permutation(num_pages)[: batch * max_pages].reshape(batch, -1),
                      jnp.int32)
  used = jnp.asarray(rng.integers(1, max_pages * page_size + 1, batch), jnp.int32)
  return k, v, table, used


@case
def attention_paged_decode_batch_and_heads():
  rng = np.random.default_rng(5)
  k, v, table, used = _paged_inputs(rng, 4, 8, 16, 4, 16)
  q = rand(rng, 4, 1, 8, 16)
  fn = lambda q, k, v, t, u: jax_sgl.attention(q, k, v, causal=True, page_table=t,
                                              seqused_k=u, return_lse=True)
  pool = P(None, None, "model", None)
  run_sharded(fn, (q, k, v, table, used), (BSHD, pool, pool, P("data", None), P("data")),
              want_specs=(BSHD, P("data", "model", None)))


@case
def attention_paged_blockscaled_decode_batch_and_heads():
  """K's block scales are a pool beside K's [P, page, Hkv, D/32], split on its head axis as K."""
  rng = np.random.default_rng(12)
  k, v, table, used = _paged_inputs(rng, 4, 8, 16, 4, 64)
  q = rand(rng, 4, 1, 8, 64, dtype=jnp.float8_e4m3fn)
  k = k.astype(jnp.float8_e4m3fn)
  sq, sk = (jnp.asarray(rng.uniform(0.5, 4, s), jnp.float32) for s in ((4, 1, 8, 2), (16, 8, 4, 2)))
  fn = lambda q, k, v, t, u, sq, sk: jax_sgl.attention(q, k, v, causal=True, page_table=t,
                                                      seqused_k=u, q_descale=sq, k_descale=sk,
                                                      return_lse=True)
  pool = P(None, None, "model", None)
  run_sharded(fn, (q, k, v, table, used, sq, sk),
              (BSHD, pool, pool, P("data", None), P("data"), BSHD, pool),
              want_specs=(BSHD, P("data", "model", None)))


@case
def attention_token_pool_varlen_q_heads():
  rng = np.random.default_rng(6)
  k, v, table, used = _paged_inputs(rng, 2, 1, 40, 4, 16)
  cu_q = jnp.asarray([0, 3, 7], jnp.int32)
  used = jnp.maximum(used, 4)
  q = rand(rng, 7, 8, 16)
  fn = lambda q, k, v, cq, t, u: jax_sgl.attention(q, k, v, causal=True, cu_seqlens_q=cq,
                                                  page_table=t, seqused_k=u)
  heads = P(None, "model", None)
  run_sharded(fn, (q, k, v, cu_q, table, used), (heads,) * 3 + (P(), P(), P()),
              want_specs=(heads,))


@case
def attention_kv_buffer_decode_batch_and_heads():
  """sglang-jax's fused 5-D pool [P, page, 2 * Hkv // packing, packing, D_pad] split on its head
  axis: each device holds whole K/V pairs of its kv heads and reads them in place."""
  rng = np.random.default_rng(8)
  k, _, table, used = _paged_inputs(rng, 4, 8, 16, 8, 32)      # [16, 8, 2 * Hkv = 8, 32]
  buf = k.reshape(16, 8, 4, 2, 32)                              # packing 2
  q = rand(rng, 4, 1, 8, 16)                                    # D = 16 of D_pad = 32
  fn = lambda q, b, t, u: jax_sgl.attention(q, None, None, kv_buffer=b, causal=True,
                                            page_table=t, seqused_k=u, return_lse=True)
  run_sharded(fn, (q, buf, table, used),
              (BSHD, P(None, None, "model", None, None), P("data", None), P("data")),
              want_specs=(BSHD, P("data", "model", None)))


@case
def attention_kv_buffer_token_pool_varlen_q_heads():
  rng = np.random.default_rng(9)
  k, _, table, used = _paged_inputs(rng, 2, 1, 40, 8, 16)       # token pool [40, 8, 16]
  cu_q = jnp.asarray([0, 3, 7], jnp.int32)
  used = jnp.maximum(used, 4)
  q = rand(rng, 7, 8, 16)
  fn = lambda q, b, cq, t, u: jax_sgl.attention(q, None, None, kv_buffer=b, causal=True,
                                                cu_seqlens_q=cq, page_table=t, seqused_k=u)
  heads = P(None, "model", None)
  run_sharded(fn, (q, k, cu_q, table, used), (heads, heads, P(), P(), P()), want_specs=(heads,))


@case
def attention_unsupported_shardings_are_resharded():
  """Sequence and head_dim splits, and a head split not dividing num_kv_heads: still exact."""
  rng = np.random.default_rng(7)
  q, k, v = rand(rng, 2, 8, 8, 16), rand(rng, 2, 12, 2, 16), rand(rng, 2, 12, 2, 16)
  fn = lambda q, k, v: jax_sgl.attention(q, k, v, causal=True, return_lse=True)
  run_sharded(fn, (q, k, v), (P(None, "model", None, "data"),) * 3, supported=False)
  run_sharded(fn, (q, k, v), (P(None, None, "model", None), P(), P()), supported=False)


# --------------------------------------------------------------------------------------------
# rope_pool_fused
# --------------------------------------------------------------------------------------------


def _rope_inputs(rng, tokens, h, hkv, d, slots_total):
  q, k, v = rand(rng, tokens, h, d), rand(rng, tokens, hkv, d), rand(rng, tokens, hkv, d)
  positions = jnp.asarray(rng.integers(0, 1000, tokens), jnp.int32)
  slots = rng.permutation(slots_total)[:tokens].astype(np.int32)
  slots[1] = -1                                  # a padding token
  kp, vp = rand(rng, slots_total, hkv, d), rand(rng, slots_total, hkv, d)
  return q, k, v, positions, jnp.asarray(slots), kp, vp


ROPE = lambda *a: jax_sgl.rope_pool_fused(*a)
HEADS = P(None, "model", None)


@case
def rope_pool_kv_heads_donated():
  rng = np.random.default_rng(8)
  args = _rope_inputs(rng, 19, 8, 4, 16, 99)
  run_sharded(ROPE, args, (HEADS,) * 3 + (P(), P()) + (HEADS,) * 2, donate=(5, 6),
              want_specs=(HEADS,) * 4)


@case
def rope_pool_gqa_partial_rotary_interleaved_heads_over_both_axes():
  rng = np.random.default_rng(9)
  args = _rope_inputs(rng, 5, 16, 8, 32, 23)
  heads = P(None, ("data", "model"), None)
  fn = lambda *a: jax_sgl.rope_pool_fused(*a, rotary_dim=16, is_neox=False)
  run_sharded(fn, args, (heads,) * 3 + (P(), P()) + (heads,) * 2, donate=(5, 6))


@case
def rope_pool_token_sharding_is_resharded():
  """Tokens split over 'data': every pool replica must still get every token's write."""
  rng = np.random.default_rng(10)
  args = _rope_inputs(rng, 16, 8, 4, 16, 64)
  tok = P("data", "model", None)
  run_sharded(ROPE, args, (tok,) * 3 + (P("data"), P("data")) + (HEADS,) * 2, supported=False)
  run_sharded(ROPE, args, (P(),) * 5 + (P("data", None, None),) * 2, supported=False)


ROPE_KV = lambda q, k, v, p, s, buf: jax_sgl.rope_pool_fused(q, k, v, p, s, kv_buffer=buf)


@case
def rope_pool_kv_buffer_heads_donated():
  """The fused buffer split on its (K, V interleaved) head axis: each device holds whole KV heads
  (K and V of each), in every form; the write stays local and in place."""
  rng = np.random.default_rng(12)
  q, k, v, positions, slots, _, _ = _rope_inputs(rng, 19, 8, 4, 16, 96)
  for shape, head_dim in (((96, 8, 32), 1), ((24, 4, 8, 32), 2), ((24, 4, 4, 2, 32), 2),
                          ((24, 4, 8, 1, 32), 2)):
    buf = rand(rng, *shape)
    spec = P(*[("model" if i == head_dim else None) for i in range(len(shape))])
    run_sharded(ROPE_KV, (q, k, v, positions, slots, buf), (HEADS,) * 3 + (P(), P(), spec),
                donate=(5,), want_specs=(HEADS, HEADS, spec))


@case
def rope_pool_kv_buffer_replicated_donated():
  """Replicated operands stay replicated, also for a 5-D packing (4) whose head axis the op keeps
  whole; heads split over such a buffer are gathered first (correct, not free)."""
  rng = np.random.default_rng(13)
  q, k, v, positions, slots, _, _ = _rope_inputs(rng, 7, 8, 2, 16, 40)
  for shape in ((10, 4, 2, 2, 128), (10, 4, 1, 4, 128)):
    run_sharded(ROPE_KV, (q, k, v, positions, slots, rand(rng, *shape)), (P(),) * 6,
                donate=(5,))
  run_sharded(ROPE_KV, (q, k, v, positions, slots, rand(rng, 10, 4, 1, 4, 128)),
              (P(None, "data", None),) * 3 + (P(),) * 3, supported=False)


# --------------------------------------------------------------------------------------------
# a decoder layer: rope_pool_fused then paged attention over the pools, heads sharded
# --------------------------------------------------------------------------------------------


@case
def layer_rope_then_paged_attention_heads():
  rng = np.random.default_rng(11)
  batch, page_size, num_pages, h, hkv, d = 4, 4, 16, 8, 4, 16
  q, k, v = rand(rng, batch, h, d), rand(rng, batch, hkv, d), rand(rng, batch, hkv, d)
  table = jnp.asarray(rng.permutation(num_pages).reshape(batch, -1), jnp.int32)
  lengths = jnp.asarray([0, 5, 11, 15], jnp.int32)
  slots = table[jnp.arange(batch), lengths // page_size] * page_size + lengths % page_size
  kp = rand(rng, num_pages * page_size, hkv, d)
  vp = rand(rng, num_pages * page_size, hkv, d)

  def layer(q, k, v, lengths, slots, kp, vp, table):
    q, k, kp, vp = jax_sgl.rope_pool_fused(q, k, v, lengths, slots, kp, vp)
    paged = (num_pages, page_size, hkv, d)
    out = jax_sgl.attention(q[:, None], kp.reshape(paged), vp.reshape(paged), causal=True,
                            page_table=table, seqused_k=lengths + 1)
    return out, kp, vp

  run_sharded(layer, (q, k, v, lengths, slots, kp, vp, table),
              (HEADS,) * 3 + (P(), P()) + (HEADS,) * 2 + (P(),), donate=(5, 6))


@case
def layer_rope_into_fp8_pool_then_paged_attention_heads():
  """The fp8 KV cache sharded over KV heads: per-head scales split with the heads, the e4m3 pools
  written in place, attention reading them as a token pool (page_table holds slots) with the same
  arrays as descales. (A reshape of an f8 pool into pages is a copy on XLA's CPU backend.)"""
  rng = np.random.default_rng(14)
  batch, page_size, num_pages, h, hkv, d = 4, 4, 16, 8, 4, 16
  q, k, v = rand(rng, batch, h, d), rand(rng, batch, hkv, d), rand(rng, batch, hkv, d)
  pages = rng.permutation(num_pages).reshape(batch, -1)
  j = np.arange(pages.shape[1] * page_size)
  table = jnp.asarray(pages[:, j // page_size] * page_size + j % page_size, jnp.int32)
  lengths = jnp.asarray([0, 5, 11, 15], jnp.int32)
  slots = table[jnp.arange(batch), lengths]
  kp = rand(rng, num_pages * page_size, hkv, d, dtype=jnp.float8_e4m3fn)
  vp = rand(rng, num_pages * page_size, hkv, d, dtype=jnp.float8_e4m3fn)
  ks = jnp.asarray(rng.uniform(0.01, 0.1, hkv), jnp.float32)
  vs = jnp.asarray(rng.uniform(0.01, 0.1, hkv), jnp.float32)

  def layer(q, k, v, lengths, slots, kp, vp, table, ks, vs):
    q, k, kp, vp = jax_sgl.rope_pool_fused(q, k, v, lengths, slots, kp, vp, k_scale=ks,
                                           v_scale=vs)
    out = jax_sgl.attention(q[:, None], kp, vp, causal=True, page_table=table,
                            seqused_k=lengths + 1, k_descale=ks, v_descale=vs)
    return out, kp, vp

  run_sharded(layer, (q, k, v, lengths, slots, kp, vp, table, ks, vs),
              (HEADS,) * 3 + (P(), P()) + (HEADS,) * 2 + (P(), P("model"), P("model")),
              donate=(5, 6))


def main(argv) -> int:
  if "--gspmd" in argv:
    jax.config.update("jax_use_shardy_partitioner", False)
  if len(jax.devices()) < 8:
    print(f"SKIP only {len(jax.devices())} devices")
    return 2
  failed = 0
  for name, fn in CASES.items():
    try:
      fn()
      print(f"PASS {name}", flush=True)
    except Exception as e:    # report every case, not only the first failure
      failed += 1
      msg = "".join(traceback.format_exception_only(e)).strip().replace("\n", " | ")
      print(f"FAIL {name}: {msg[:2000]}", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
