"""Benchmark of rope_pool_fused against its anchors, all measured in the same process:

  copy        a device-to-device copy (jitted bitwise not of a 1 GiB buffer: one read, one write),
              the bandwidth ceiling the kernel is held to;
  jax plain   the same work in jitted JAX: the reference rotary in jnp, then
              pool.at[slots].set(...) with the pools donated;
  jax tuned   as plain, with .at[slots].set(..., unique_indices=True, mode='promise_in_bounds');
  jax_sgl     jax_sgl.rope_pool_fused, pools donated;
  kv_buffer   jax_sgl.rope_pool_fused into one fused K/V buffer as sglang-jax keeps it
              ([num_slots, 1, Hkv, 2, D]: K and V interleaved on the head axis), donated. Same
              bytes moved; its pool rows are the K/V halves of one buffer row.
  fp8 pool    jax_sgl.rope_pool_fused into e4m3 pools with per-kv-head k_scale / v_scale
              (quantize on write, issue 24), donated; against 'jax fp8', the same quantizing
              write in jitted JAX (tuned scatter). Pool rows are one byte per element here.

Problem (issue 9): 8192 and 65536 tokens, 32 q heads / 8 kv heads, head_dim 128, bf16, pools of
1M slots, distinct random slots, random positions below 32768. Bytes counted per call: q, k, v
read + q_rot, k_rot and the two pool rows written (26 KiB per token). Inputs rotate over enough
sets to exceed the 60 MB L2. Every implementation is timed as CHAIN calls in one jitted program,
each call's pools the previous call's (a model's layer loop: one dispatch for many calls); each
timing is the median over batches of back-to-back programs (wall clock around
block_until_ready, after warm-up), divided by CHAIN. Lines starting with SUMMARY are collected by
tools/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sgl
from jax_sgl import reference

HQ, HKV, D = 32, 8, 128
DTYPE = jnp.bfloat16
L2_BYTES = 60 << 20
# Calls per jitted program. Timed one call per dispatch (H100, session 30), a call below T 8k took
# the host's 50-100 us whatever the implementation, and at T 8k its ~75 us of device work only
# just covered the dispatch: the figure measured the host as much as the kernel.
CHAIN = 8


def median_seconds(step, state, calls, batches):
  """Runs state = step(i, state) calls * batches times; returns the median per-call time."""
  state = jax.block_until_ready(step(0, state))  # warm-up (compile) outside the timings
  for i in range(calls):
    state = step(i, state)
  jax.block_until_ready(state)
  times = []
  for _ in range(batches):
    t0 = time.perf_counter()
    for i in range(calls):
      state = step(i, state)
    jax.block_until_ready(state)
    times.append((time.perf_counter() - t0) / calls)
  return statistics.median(times), state


def chained(fn):
  """fn(*inputs, *pools, *extra) -> (q_rot, k_rot, *pools) as CHAIN calls in one jitted program:
  call j on input set j % len(sets), with the pools the call before returned (donated). Returns
  (pools, every call's q_rot / k_rot): all outputs are live, so XLA computes each call whole."""
  def run(sets, pools, *extra):
    rots = []
    for j in range(CHAIN):
      out = fn(*sets[j % len(sets)], *pools, *extra)
      rots.append(out[:2])
      pools = tuple(out[2:])
    return pools, rots
  return jax.jit(run, donate_argnums=1)


def chain_calls(num_tokens):
  """Programs per timed batch: about 4M tokens' calls, at least 3 programs."""
  return max(3, min(500, 4_000_000 // num_tokens) // CHAIN)


def chain_seconds(fn, sets, pools, calls, batches, extra=()):
  """Median seconds per call of fn chained (see `chained`), over `calls` programs a batch; returns
  it and the pools after the last call."""
  # Compiled once, checked, and that executable timed (calling the jitted function would
  # compile it a second time).
  run = chained(fn).lower(sets, pools, *extra).compile()
  # A pool copied inside the program would time a second pool write, not the call.
  hlo = run.as_text()
  for dims in {"[" + ",".join(map(str, p.shape)) + "]" for p in pools}:
    copies = [l for l in hlo.splitlines() if re.search(r"\bcopy\(", l) and dims in l]
    assert not copies, f"the chained program copies a pool: {copies[0][:200]}"
  t, pools = median_seconds(lambda i, s: run(sets, s, *extra)[0], pools, calls, batches)
  return t / CHAIN, pools


def copy_bandwidth(batches, words):
  x = jnp.arange(words, dtype=jnp.uint32)
  f = jax.jit(lambda a: ~a)
  t, _ = median_seconds(lambda i, s: f(x), None, 20, batches)
  return 2 * x.nbytes / t


def jax_rope_pool(q, k, v, positions, slots, k_pool, v_pool, tuned):
  cos, sin = reference.rope_cos_sin(positions, reference.rope_inv_freq(D, 10000.0))
  q_rot = reference.apply_rope(q, cos, sin, rotary_dim=D, is_neox=True)
  k_rot = reference.apply_rope(k, cos, sin, rotary_dim=D, is_neox=True)
  kw = dict(unique_indices=True, mode="promise_in_bounds") if tuned else {}
  return q_rot, k_rot, k_pool.at[slots].set(k_rot, **kw), v_pool.at[slots].set(v, **kw)


def normal(rng, *shape):
  """Fresh standard-normal bf16 drawn on the device (a 2 GiB pool from the host would be slow)."""
  key = jax.random.key(int(rng.integers(1 << 31)))
  return jax.random.normal(key, shape, jnp.float32).astype(DTYPE)


def make_sets(rng, num_tokens, num_slots):
  per_set = num_tokens * (HQ + 2 * HKV) * D * 2
  count = min(16, max(2, -(-4 * L2_BYTES // per_set)))
  sets = []
  for _ in range(count):
    positions = jnp.asarray(rng.integers(0, 32768, num_tokens), jnp.int32)
    slots = jnp.asarray(rng.choice(num_slots, num_tokens, replace=False), jnp.int32)
    sets.append((normal(rng, num_tokens, HQ, D), normal(rng, num_tokens, HKV, D),
                 normal(rng, num_tokens, HKV, D), positions, slots))
  return sets


def check_once(fn, inputs, k_pool, v_pool):
  """The timed jax_sgl call computes what the reference computes (q_rot and the written rows)."""
  q_rot, k_rot, k_out, v_out = fn(*inputs, jnp.copy(k_pool), jnp.copy(v_pool))
  want = reference.rope_pool_fused(*inputs, k_pool, v_pool)
  slots = inputs[4]
  for got, ref in ((q_rot, want[0]), (k_rot, want[1]), (k_out[slots], want[2][slots]),
                   (v_out[slots], want[3][slots])):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               rtol=1.6e-2, atol=1.6e-2)


def check_kv_buffer_once(fn, inputs, kv_buffer):
  """As check_once, for the fused buffer: its K and V heads at the written slots."""
  q_rot, k_rot, out = fn(*inputs, jnp.copy(kv_buffer))
  want = reference.rope_pool_fused(*inputs, kv_buffer=kv_buffer)
  slots = inputs[4]
  rows = lambda b: b.reshape(b.shape[0], 2 * HKV, D)[slots]
  for got, ref in ((q_rot, want[0]), (k_rot, want[1]), (rows(out), rows(want[2]))):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               rtol=1.6e-2, atol=1.6e-2)


def jax_rope_pool_fp8(q, k, v, positions, slots, k_pool, v_pool, k_scale, v_scale):
  cos, sin = reference.rope_cos_sin(positions, reference.rope_inv_freq(D, 10000.0))
  q_rot = reference.apply_rope(q, cos, sin, rotary_dim=D, is_neox=True)
  k_rot = reference.apply_rope(k, cos, sin, rotary_dim=D, is_neox=True)
  quant = lambda x, s: jnp.clip(x.astype(jnp.float32) / s[:, None], -448, 448).astype(
      jnp.float8_e4m3fn)
  kw = dict(unique_indices=True, mode="promise_in_bounds")
  return (q_rot, k_rot, k_pool.at[slots].set(quant(k_rot, k_scale), **kw),
          v_pool.at[slots].set(quant(v, v_scale), **kw))


def run_fp8(num_tokens, num_slots, copy_bw, batches, rng, sets):
  """The fp8 (e4m3) pool: the rows written are half the bytes of the bf16 pool's."""
  scales = (jnp.asarray(rng.uniform(0.01, 0.05, HKV), jnp.float32),
            jnp.asarray(rng.uniform(0.01, 0.05, HKV), jnp.float32))
  zeros = lambda: jnp.zeros((num_slots, HKV, D), jnp.float8_e4m3fn)
  impls = {
      "jax fp8": jax_rope_pool_fp8,
      "fp8 pool": lambda *a: jax_sgl.rope_pool_fused(*a[:7], k_scale=a[7], v_scale=a[8]),
  }
  inputs = sets[0]
  got = jax.jit(impls["fp8 pool"])(*inputs, zeros(), zeros(), *scales)
  want = reference.rope_pool_fused(*inputs, zeros(), zeros(), k_scale=scales[0],
                                   v_scale=scales[1])
  slots = inputs[4]
  for g, w in zip(got, want):
    if g.dtype == jnp.float8_e4m3fn:  # the CPU kernel's bits, up to one e4m3 step on ties
      g, w = g[slots], w[slots]
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=1.6e-2 if g.dtype != jnp.float8_e4m3fn else 0.13, atol=1.6e-2)
  del got, want
  nbytes = num_tokens * (HQ + 2 * HKV + HQ + HKV) * D * 2 + num_tokens * 2 * HKV * D
  calls = chain_calls(num_tokens)
  pools, rows = (zeros(), zeros()), {}
  for name, fn in impls.items():
    rows[name], pools = chain_seconds(fn, sets, pools, calls, batches, scales)
  del pools
  print(f"rope_pool_fused into e4m3 pools, {num_tokens} tokens, {nbytes / 1e6:.1f} MB per call")
  for name, t in rows.items():
    print(f"{name:<10} {t * 1e6:9.1f} {nbytes / t / 1e9:8.0f} {100 * nbytes / t / copy_bw:6.1f}% "
          f"{t / rows['fp8 pool']:9.2f}x")
  t = rows["fp8 pool"]
  print(f"SUMMARY rope_pool fp8 pool T={num_tokens}: {t * 1e6:.1f} us, {nbytes / t / 1e9:.0f} "
        f"GB/s = {100 * nbytes / t / copy_bw:.1f}% of copy; {rows['jax fp8'] / t:.2f}x jax fp8")


def run(num_tokens, num_slots, copy_bw, batches, rng):
  sets = make_sets(rng, num_tokens, num_slots)
  pools = (normal(rng, num_slots, HKV, D), normal(rng, num_slots, HKV, D))
  impls = {
      "jax plain": lambda *a: jax_rope_pool(*a, tuned=False),
      "jax tuned": lambda *a: jax_rope_pool(*a, tuned=True),
      "jax_sgl": jax_sgl.rope_pool_fused,
  }
  check_once(jax.jit(impls["jax_sgl"]), sets[0], *pools)
  # q, k, v read; q_rot, k_rot, k_pool rows, v_pool rows written.
  nbytes = num_tokens * (HQ + 2 * HKV + HQ + HKV + 2 * HKV) * D * 2
  calls = chain_calls(num_tokens)
  rows = {}
  for name, fn in impls.items():
    rows[name], pools = chain_seconds(fn, sets, pools, calls, batches)
  del pools
  # sglang-jax's 5-D form at its default page size 1: [pages, page_size, 2 * Hkv // 2, 2, D].
  kv_buffer = normal(rng, num_slots, 1, HKV, 2, D)
  fused = lambda q, k, v, p, s, b: jax_sgl.rope_pool_fused(q, k, v, p, s, kv_buffer=b)
  check_kv_buffer_once(jax.jit(fused), sets[0], kv_buffer)
  rows["kv_buffer"], _ = chain_seconds(fused, sets, (kv_buffer,), calls, batches)
  print(f"\nrope_pool_fused, {num_tokens} tokens, Hq={HQ} Hkv={HKV} D={D} bf16, "
        f"{num_slots} slots, {nbytes / 1e6:.1f} MB per call, {len(sets)} input sets")
  print(f"{'impl':<10} {'us':>9} {'GB/s':>8} {'% copy':>7} {'vs jax_sgl':>10}")
  for name, t in rows.items():
    gbs = nbytes / t / 1e9
    print(f"{name:<10} {t * 1e6:9.1f} {gbs:8.0f} {100 * nbytes / t / copy_bw:6.1f}% "
          f"{t / rows['jax_sgl']:9.2f}x")
  t = rows["jax_sgl"]
  print(f"SUMMARY rope_pool T={num_tokens}: {t * 1e6:.1f} us, {nbytes / t / 1e9:.0f} GB/s = "
        f"{100 * nbytes / t / copy_bw:.1f}% of copy; {rows['jax plain'] / t:.2f}x jax plain, "
        f"{rows['jax tuned'] / t:.2f}x jax tuned")
  t = rows["kv_buffer"]
  print(f"SUMMARY rope_pool kv_buffer T={num_tokens}: {t * 1e6:.1f} us, "
        f"{nbytes / t / 1e9:.0f} GB/s = {100 * nbytes / t / copy_bw:.1f}% of copy")
  del kv_buffer
  run_fp8(num_tokens, num_slots, copy_bw, batches, rng, sets)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 65536])
  parser.add_argument("--num-slots", type=int, default=1 << 20)
  parser.add_argument("--copy-mib", type=int, default=1024, help="copy buffer size")
  parser.add_argument("--batches", type=int, default=7)
  args = parser.parse_args()
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  copy_bw = copy_bandwidth(args.batches, args.copy_mib << 18)
  print(f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s")
  print(f"SUMMARY copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
  rng = np.random.default_rng(0)
  for num_tokens in args.tokens:
    run(num_tokens, args.num_slots, copy_bw, args.batches, rng)


if __name__ == "__main__":
  main()
