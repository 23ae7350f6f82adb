"""Benchmark of jax_sgl.attention (CUDA) against its anchors, all measured in the same process:

  cudnn    jax.nn.dot_product_attention(implementation="cudnn") on contiguous data;
  xla      jax.nn.dot_product_attention(implementation="xla") (skipped where its score matrix
           would not fit comfortably);
  jax_sgl  jax_sgl.attention.

Prefill (issue 3 section 5): B*S = 32768 tokens, S in {1k, 4k, 16k}, heads 16/16 and GQA 32/8,
D in {64, 128}, causal and not, bf16; TFLOP/s counted as 4*B*H*S^2*D (halved when causal).
Decode: batch 64, KV 4k and 32k, 32 q / 8 kv heads, D=128, bf16, one query per sequence;
jax_sgl reads a page pool (page size 16, shuffled pages) through the page table, the anchors
read the same keys laid out contiguously. GB/s counts the K/V bytes read; the copy bandwidth
(jitted bitwise not of 1 GiB: one read, one write) is the ceiling. Each timing is the median over
batches of back-to-back calls (wall clock around block_until_ready, after warm-up); decode K/V is
far larger than the 60 MB L2. Lines starting with SUMMARY are collected by tools/gpu_check.sh.
--plot FILE writes TFLOP/s vs S per implementation (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jax_sgl
from timing import median_seconds, try_time

DTYPE = jnp.bfloat16
PAGE = 16


def copy_bandwidth(batches):
  x = jnp.arange(1 << 28, dtype=jnp.uint32)
  f = jax.jit(lambda a: ~a)
  return 2 * x.nbytes / median_seconds(f, (x,), 20, batches)


def normal(key, shape):
  return jax.random.normal(key, shape, jnp.float32).astype(DTYPE)


def anchor(impl, causal):
  return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                              implementation=impl))


def prefill(seqlens, batches, results, head_dims=(64, 128)):
  print(f"\nprefill, B*S = 32768 tokens, bf16; TFLOP/s (ratio jax_sgl / anchor)")
  print(f"{'S':>6} {'H/Hkv':>6} {'D':>4} {'causal':>6} {'jax_sgl':>8} {'cudnn':>8} {'xla':>8} "
        f"{'vs cudnn':>8} {'vs xla':>7}")
  for d, h, hkv in ((64, 16, 16), (128, 16, 16), (128, 32, 8)):
    if d not in head_dims:
      continue
    for causal in (False, True):
      for s in seqlens:
        b = 32768 // s
        keys = jax.random.split(jax.random.PRNGKey(s + d + h), 3)
        q, k, v = normal(keys[0], (b, s, h, d)), normal(keys[1], (b, s, hkv, d)), \
            normal(keys[2], (b, s, hkv, d))
        flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
        calls = max(3, int(2e13 // flops))
        ours = jax.jit(lambda q, k, v, c=causal: jax_sgl.attention(q, k, v, causal=c))
        row = {"S": s, "H": h, "Hkv": hkv, "D": d, "causal": causal}
        row["jax_sgl"] = flops / median_seconds(ours, (q, k, v), calls, batches) / 1e12
        t = try_time(anchor("cudnn", causal), (q, k, v), calls, batches)
        row["cudnn"] = flops / t / 1e12 if t else None
        # XLA materializes the float32 scores [B, H, S, S]: keep them under 8 GiB.
        t = try_time(anchor("xla", causal), (q, k, v), calls, batches) \
            if b * h * s * s * 4 <= 8 << 30 else None
        row["xla"] = flops / t / 1e12 if t else None
        results["prefill"].append(row)
        fmt = lambda x: f"{x:8.0f}" if x else f"{'-':>8}"
        ratio = lambda x: f"{row['jax_sgl'] / x:7.2f}x" if x else f"{'-':>8}"
        print(f"{s:>6} {h:>3}/{hkv:<2} {d:>4} {str(causal):>6} {fmt(row['jax_sgl'])} "
              f"{fmt(row['cudnn'])} {fmt(row['xla'])} {ratio(row['cudnn'])} {ratio(row['xla'])}")
        if s == 4096 and d == 128 and h == 16:
          print(f"SUMMARY attention prefill S=4k H16 D128 causal={causal}: "
                f"{row['jax_sgl']:.0f} TFLOP/s, cudnn {row['cudnn'] or 0:.0f}")
        del q, k, v


def paged_copy(k, v, rng):
  """The same keys in a shuffled page pool: [num_pages, PAGE, Hkv, D] + page table [B, pages]."""
  b, s, hkv, d = k.shape
  pages = s // PAGE
  perm = jnp.asarray(rng.permutation(b * pages), jnp.int32)
  table = perm.reshape(b, pages)
  inv = jnp.argsort(perm)
  to_pool = lambda x: x.reshape(b * pages, PAGE, hkv, d)[inv]
  return to_pool(k), to_pool(v), table


def decode(kv_lens, batches, copy_bw, results):
  b, h, hkv, d = 64, 32, 8, 128
  print(f"\ndecode, batch {b}, q 1, {h}/{hkv} heads, D={d}, bf16; GB/s of K/V read")
  print(f"{'KV':>6} {'impl':<22} {'us':>9} {'GB/s':>7} {'% copy':>7} {'jax_sgl vs':>10}")
  rng = np.random.default_rng(0)
  for s in kv_lens:
    keys = jax.random.split(jax.random.PRNGKey(s), 3)
    q = normal(keys[0], (b, 1, h, d))
    k, v = normal(keys[1], (b, s, hkv, d)), normal(keys[2], (b, s, hkv, d))
    k_pool, v_pool, table = paged_copy(k, v, rng)
    seqused = jnp.full((b,), s, jnp.int32)
    nbytes = 2 * b * s * hkv * d * 2
    calls = 20
    paged = jax.jit(lambda q, kp, vp, t, u: jax_sgl.attention(q, kp, vp, page_table=t,
                                                              seqused_k=u))
    got = paged(q, k_pool, v_pool, table, seqused)
    want = jax.nn.dot_product_attention(q, k, v, implementation="xla")
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    assert err < 3e-2, f"paged decode differs from XLA by {err}"
    times = {
        "jax_sgl paged": median_seconds(paged, (q, k_pool, v_pool, table, seqused), calls,
                                        batches),
        "jax_sgl contiguous": median_seconds(jax.jit(jax_sgl.attention), (q, k, v), calls,
                                             batches),
        "cudnn contiguous": try_time(anchor("cudnn", False), (q, k, v), calls, batches),
        "xla contiguous": try_time(anchor("xla", False), (q, k, v), calls, batches),
    }
    ours = times["jax_sgl paged"]
    row = {"KV": s}
    for name, t in times.items():
      if t is None:
        print(f"{s:>6} {name:<22} {'-':>9}")
        continue
      row[name] = nbytes / t / 1e9
      print(f"{s:>6} {name:<22} {t * 1e6:9.1f} {nbytes / t / 1e9:7.0f} "
            f"{100 * nbytes / t / copy_bw:6.1f}% {t / ours:9.2f}x")
    results["decode"].append(row)
    cud, xla = times["cudnn contiguous"], times["xla contiguous"]
    print(f"SUMMARY attention decode KV={s}: paged {nbytes / ours / 1e9:.0f} GB/s = "
          f"{(cud / ours) if cud else float('nan'):.2f}x cudnn contiguous, "
          f"{(xla / ours) if xla else float('nan'):.2f}x xla")
    del q, k, v, k_pool, v_pool


def plot(results, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for ax, causal in zip(axes, (False, True)):
    for impl, style in (("jax_sgl", "-o"), ("cudnn", "--s"), ("xla", ":^")):
      for d, h in ((64, 16), (128, 16), (128, 32)):
        rows = [r for r in results["prefill"] if r["causal"] == causal and r["D"] == d and
                r["H"] == h and r[impl]]
        if rows:
          ax.plot([r["S"] for r in rows], [r[impl] for r in rows], style,
                  label=f"{impl} D{d} H{h}/{rows[0]['Hkv']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("S (B*S = 32768)")
    ax.set_title(f"prefill bf16, causal={causal}")
    ax.grid(True, alpha=0.3)
  axes[0].set_ylabel("TFLOP/s")
  axes[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
  parser.add_argument("--kv", type=int, nargs="+", default=[4096, 32768])
  parser.add_argument("--batches", type=int, default=5)
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--skip-prefill", action="store_true")
  parser.add_argument("--skip-decode", action="store_true")
  parser.add_argument("--json", help="write the results here")
  parser.add_argument("--plot", help="write the prefill plot (PNG) here")
  args = parser.parse_args()
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  # JAX_SGL_SM90=1 routes the dense prefill cases to the Hopper kernel: name what runs.
  print(f"jax_sgl attention backend: {jax_sgl.attention_backend_info()}")
  copy_bw = copy_bandwidth(args.batches)
  print(f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s")
  results = {"prefill": [], "decode": [], "copy_GBps": copy_bw / 1e9}
  if not args.skip_decode:
    decode(args.kv, args.batches, copy_bw, results)
  if not args.skip_prefill:
    prefill(args.seqlens, args.batches, results, args.head_dims)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  if args.plot and results["prefill"]:
    plot(results, args.plot)


if __name__ == "__main__":
  main()
