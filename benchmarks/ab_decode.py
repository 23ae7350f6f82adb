"""A/B of jax_sgl's CUDA decode paths, in one process, against cuDNN and XLA.

Variants are run-time switches the host dispatch reads at every call (decode/launch.h):
JAX_SGL_DECODE=old|new|warp|warpmma|warpmma2|warptma, JAX_SGL_DECODE_SPLITS=N (0: heuristic),
JAX_SGL_DECODE_STAGES=N, JAX_SGL_DECODE_WAVES=N (warp variants' split heuristic; 0: the count
that fills the last wave best), JAX_SGL_DECODE_TMA_L2=N; so one jitted function serves them all.
Configs: the issue's decode (batch 64, KV 4k and 32k, 32 q / 8 kv heads, D=128, bf16, one query
per sequence; jax_sgl reads a shuffled pool of 16-token pages, the anchors the same keys
contiguously) plus batch 8 at KV 32k (few sequences: the split count
matters most). GB/s counts the K/V bytes read once. Timings: every variant and anchor runs one
batch of back-to-back calls in turn, `--batches` times (interleaved, so drift hits all alike);
the median batch is reported. K/V are far larger than the 60 MB L2.

One 'SUMMARY ' line per config: the default (JAX_SGL_DECODE unset: warptma where it serves, else
warpmma2) vs cuDNN and XLA, the
block-wide decode kernel (new), the old path, and the best variant. `--only PREFIX...` keeps the
variants whose names start with one of the prefixes (plus the default and the anchors): e.g.
`--only warpmma` runs the warpmma and warpmma2 rows alone.
"""

from __future__ import annotations

import argparse
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import jax_sgl
from timing import batch_seconds, median_seconds

PAGE = 16
H, HKV, D = 32, 8, 128
ENV = ("JAX_SGL_DECODE", "JAX_SGL_DECODE_SPLITS", "JAX_SGL_DECODE_STAGES", "JAX_SGL_DECODE_WAVES",
       "JAX_SGL_DECODE_TMA_L2")


def variants(batch):
  """name -> environment of each jax_sgl variant."""
  v = {"default": {}, "new": {"JAX_SGL_DECODE": "new"}, "old": {"JAX_SGL_DECODE": "old"}}
  v["new splits=3" if batch >= 32 else "new splits=16"] = {
      "JAX_SGL_DECODE": "new", "JAX_SGL_DECODE_SPLITS": "3" if batch >= 32 else "16"}
  for mode in ("warp", "warpmma", "warpmma2"):
    v[mode] = {"JAX_SGL_DECODE": mode}
    for s in ((1, 2, 3, 4) if batch >= 32 else (8, 16, 32)):
      v[f"{mode} splits={s}"] = {"JAX_SGL_DECODE": mode, "JAX_SGL_DECODE_SPLITS": str(s)}
    for st in ((2, 3, 6) if mode == "warp" else (2, 4)):
      v[f"{mode} stages={st}"] = {"JAX_SGL_DECODE": mode, "JAX_SGL_DECODE_STAGES": str(st)}
    v[f"{mode} waves=1"] = {"JAX_SGL_DECODE": mode, "JAX_SGL_DECODE_WAVES": "1"}
    v[f"{mode} waves=4"] = {"JAX_SGL_DECODE": mode, "JAX_SGL_DECODE_WAVES": "4"}
  # warpmma2 at 2 stages fits 3 CTAs per SM (168 registers, ~74 KiB): its split heuristic then
  # sizes one wave of 3 x 132 slots; two waves as the other point.
  # waves=fit (JAX_SGL_DECODE_WAVES=0): the split count that fills its last wave best.
  for mode in ("warpmma", "warpmma2"):
    v[f"{mode} waves=fit"] = {"JAX_SGL_DECODE": mode, "JAX_SGL_DECODE_WAVES": "0"}
  for waves in ("2", "0"):
    v[f"warpmma2 stages=2 waves={'fit' if waves == '0' else waves}"] = {
        "JAX_SGL_DECODE": "warpmma2", "JAX_SGL_DECODE_STAGES": "2", "JAX_SGL_DECODE_WAVES": waves}
  # Deep rings, one CTA per SM: bytes in flight per SM (stages - 1 per warp) against CTAs. At
  # B=64 (session 5) stages=2 (3 CTAs/SM) and 4 (1/SM), both ~96 KiB in flight per SM, ran at
  # 0.81-0.85x against 0.94-0.96x for 3 (2/SM, 128 KiB): 5 and 6 hold 128 and 160 KiB with one.
  for st in ("5", "6"):
    for waves in ("1", "0"):
      v[f"warpmma2 stages={st} waves={'fit' if waves == '0' else waves}"] = {
          "JAX_SGL_DECODE": "warpmma2", "JAX_SGL_DECODE_STAGES": st, "JAX_SGL_DECODE_WAVES": waves}
  # TMA-fed stages (decode/tma_kernel.cuh): 8 KiB unpadded stages, so 3 stages still fit 2 CTAs
  # per SM; 4 stages is one CTA per SM, 2 stages three.
  v["warptma"] = {"JAX_SGL_DECODE": "warptma"}
  for st in ("2", "4"):
    v[f"warptma stages={st}"] = {"JAX_SGL_DECODE": "warptma", "JAX_SGL_DECODE_STAGES": st}
  v["warptma waves=fit"] = {"JAX_SGL_DECODE": "warptma", "JAX_SGL_DECODE_WAVES": "0"}
  v["warptma waves=1"] = {"JAX_SGL_DECODE": "warptma", "JAX_SGL_DECODE_WAVES": "1"}
  # Its L2 promotion (JAX_SGL_DECODE_TMA_L2; default 128 B). 256 B, warpmma2's hint, made half
  # the L2 reads hits (ncu, session 7) and ran 3-6% slower (session 8).
  for size in ("0", "256"):
    v[f"warptma l2={size}"] = {"JAX_SGL_DECODE": "warptma", "JAX_SGL_DECODE_TMA_L2": size}
  return v


def set_env(env):
  for name in ENV:
    os.environ.pop(name, None)
  os.environ.update(env)


def normal(key, shape):
  return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)


def paged_copy(k, v, rng):
  """The same keys in a shuffled page pool: [num_pages, PAGE, Hkv, D] + page table [B, pages]."""
  b, s, hkv, d = k.shape
  pages = s // PAGE
  perm = jnp.asarray(rng.permutation(b * pages), jnp.int32)
  inv = jnp.argsort(perm)
  to_pool = lambda x: x.reshape(b * pages, PAGE, hkv, d)[inv]
  return to_pool(k), to_pool(v), perm.reshape(b, pages)


def run_config(b, s, batches, copy_bw, only=None):
  keys = jax.random.split(jax.random.PRNGKey(s + b), 3)
  q = normal(keys[0], (b, 1, H, D))
  k, v = normal(keys[1], (b, s, HKV, D)), normal(keys[2], (b, s, HKV, D))
  k_pool, v_pool, table = paged_copy(k, v, np.random.default_rng(b))
  seqused = jnp.full((b,), s, jnp.int32)
  nbytes = 2 * b * s * HKV * D * 2
  calls = min(200, max(3, int(4e10 // nbytes)))  # ~10 ms of K/V reads per batch at 4 TB/s

  paged = jax.jit(lambda q, kp, vp, t, u: jax_sgl.attention(q, kp, vp, page_table=t,
                                                            seqused_k=u))
  anchor = lambda impl: jax.jit(
      lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=impl))
  want = anchor("xla")(q, k, v).astype(jnp.float32)
  # name -> (fn, args, env); None env: an anchor (the jax_sgl switches do not matter).
  runs = {}
  for name, env in variants(b).items():
    if only and name != "default" and not name.startswith(tuple(only)):
      continue
    set_env(env)
    err = float(jnp.max(jnp.abs(paged(q, k_pool, v_pool, table, seqused).astype(jnp.float32)
                                - want)))
    if err > 3e-2:
      print(f"  {name}: differs from XLA by {err}: skipped")
      continue
    runs[name] = (paged, (q, k_pool, v_pool, table, seqused), env)
  set_env({})
  runs["jax_sgl contiguous"] = (jax.jit(jax_sgl.attention), (q, k, v), {})
  if not only or any("warpmma2".startswith(o) or o.startswith("warpmma2") for o in only):
    runs["warpmma2 contiguous"] = (jax.jit(jax_sgl.attention), (q, k, v),
                                   {"JAX_SGL_DECODE": "warpmma2"})
  for impl in ("cudnn", "xla"):
    try:
      jax.block_until_ready(anchor(impl)(q, k, v))
      runs[impl] = (anchor(impl), (q, k, v), None)
    except Exception as e:  # an anchor that cannot run the case
      print(f"  ({impl}: {type(e).__name__}: {str(e).splitlines()[0][:100]})")

  times = {name: [] for name in runs}
  for _ in range(batches):
    for name, (fn, args, env) in runs.items():
      set_env(env or {})
      # The untimed batch first settles this variant's allocations (split count) and clocks.
      times[name].append(batch_seconds(fn, args, calls, settle=calls))
  set_env({})
  med = {name: statistics.median(t) for name, t in times.items()}

  cud, xla = med.get("cudnn"), med.get("xla")
  print(f"\ndecode B={b} KV={s} q 1, {H}/{HKV} heads, D={D}, bf16, page {PAGE} "
        f"(K/V {nbytes / 2**30:.2f} GiB, {calls} calls x {batches} batches)")
  print(f"{'impl':<22} {'us':>9} {'GB/s':>7} {'% copy':>7} {'vs cudnn':>8} {'vs xla':>7}")
  for name, t in med.items():
    ratio = lambda a: f"{a / t:7.2f}x" if a else f"{'-':>8}"
    print(f"{name:<22} {t * 1e6:9.1f} {nbytes / t / 1e9:7.0f} {100 * nbytes / t / copy_bw:6.1f}% "
          f"{ratio(cud)} {ratio(xla)}")
  ours = [n for n in med if "contiguous" not in n and n not in ("cudnn", "xla")]  # paged rows
  best = min(ours, key=med.get)
  for name in ("new", "old"):
    med.setdefault(name, float("nan"))
  fmt = lambda n: (f"{nbytes / med[n] / 1e9:.0f} GB/s = {(cud or np.nan) / med[n]:.2f}x cudnn, "
                   f"{(xla or np.nan) / med[n]:.2f}x xla")
  for mode in ("warp", "warpmma", "warpmma2", "warptma"):
    if mode in med:
      rows = [n for n in med if n == mode or n.startswith(mode + " ")]
      top = min(rows, key=med.get)
      print(f"SUMMARY ab_decode B={b} KV={s}: {mode} {fmt(mode)}; best {mode} row '{top}' "
            f"{fmt(top)}")
  print(f"SUMMARY ab_decode B={b} KV={s}: default {fmt('default')}; new {fmt('new')}; "
        f"old {fmt('old')}; "
        f"best '{best}' {fmt(best)}; cudnn {nbytes / cud / 1e9 if cud else float('nan'):.0f} GB/s")
  del q, k, v, k_pool, v_pool


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, default=7)
  parser.add_argument("--configs", nargs="+", default=["64x4096", "64x32768", "8x32768"],
                      help="BATCHxKV")
  parser.add_argument("--only", nargs="+", default=None,
                      help="variant name prefixes to run (default and anchors always run)")
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
  x = jnp.arange(1 << 28, dtype=jnp.uint32)
  copy_bw = 2 * x.nbytes / median_seconds(jax.jit(lambda a: ~a), (x,), 20, args.batches)
  del x
  print(f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s")
  for c in args.configs:
    b, s = (int(t) for t in c.split("x"))
    run_config(b, s, args.batches, copy_bw, args.only)


if __name__ == "__main__":
  main()
