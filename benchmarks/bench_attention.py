"""Benchmark of jax_sgl.attention (CUDA) against its anchors, all measured in the same process.

Prefill (issue 3 section 5, issue 8 item 5): B*S = 32768 tokens, S in {1k, 4k, 16k}, heads 16/16
and GQA 32/8, D in {64, 128, 256} (256: heads 16/16 only), causal and not, bf16 and/or fp16;
TFLOP/s counted as 4*B*H*S^2*D (halved when causal). Implementations, per configuration:

  sm90         jax_sgl.attention (default): the Hopper wgmma + TMA kernel ('-' where this build
               lacks the instantiation or the device is not compute capability 9.0);
  portable     jax_sgl.attention with JAX_SGL_DISABLE=sm90: the sm80 mma.sync kernel;
  cudnn        jax.nn.dot_product_attention(implementation="cudnn");
  fa3          FlashAttention-3, flash_attn3_jax.flash_mha (benchmarks/fa3.py: optional, GPU only;
               'n/a' where its output disagrees, e.g. a head dim its wheel was not built for);
  pallas_mgpu  jax.experimental.pallas.ops.gpu.attention_mgpu.attention (fp16 runs only: the dtype
               its authors tune it for), block_q 64, block_kv 128 (64 where 128 does not fit);
  xla          jax.nn.dot_product_attention(implementation="xla"), skipped where its float32 score
               matrix would pass 8 GiB.

JAX_SGL_DISABLE is read when a call is lowered, so sm90 and portable are two compiled functions
(timing.jit_with_disable). The implementations of a
configuration are timed round-robin (timing.interleaved_medians: batch i of each before batch i+1
of any) and each reports its median, so drift lands on all alike. A bf16/fp16 GEMM (8192^3, f32
accumulate, half output) measured in the same run gives the '% GEMM' column, a practical ceiling.

Decode: batch 64, KV 4k and 32k, 32 q / 8 kv heads, D=128, bf16, one query per sequence;
jax_sgl reads a page pool (page size 16, shuffled pages) through the page table, as does FA3
(flash_mha_with_kvcache on the same pool); cuDNN and XLA read the same keys laid out
contiguously. GB/s counts the K/V bytes read; the copy bandwidth (jitted bitwise not of 1 GiB:
one read, one write) is the ceiling. Each timing is the median over batches of back-to-back calls
(wall clock around block_until_ready, after warm-up); decode K/V is far larger than the 60 MB L2.
Lines starting with SUMMARY are collected by tools/gpu_check.sh.
--plot FILE writes TFLOP/s vs S per implementation (needs matplotlib).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np

import fa3
import jax_sgl
from timing import interleaved_medians, jit_with_disable, median_seconds, try_time

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
PAGE = 16
# (head dim, query heads, kv heads) of the prefill configurations.
PREFILL_SHAPES = ((64, 16, 16), (128, 16, 16), (128, 32, 8), (256, 16, 16))
# "default": jax_sgl's own dispatch, timed where this build has no sm90 forward at the head dim (the
# plan may still zero-pad the head dim onto an sm90 kernel, or run the portable kernel).
IMPLS = ("sm90", "default", "portable", "cudnn", "fa3", "pallas_mgpu", "xla")
LABELS = {"pallas_mgpu": "pallas"}  # table and summary headings
# Max |difference| from the cudnn (else xla) output above which a result is flagged: a wrong
# kernel is off by O(1); half-precision rounding of outputs of magnitude ~1 is ~1e-2.
MAX_DIFF = 5e-2
_reported = set()


def report_once(impl, error):
  """Prints why `impl` cannot run, once per distinct message (a missing API repeats per config)."""
  msg = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
  if (impl, msg) not in _reported:
    _reported.add((impl, msg))
    print(f"  ({impl} unavailable: {msg})")


def copy_bandwidth(batches):
  x = jnp.arange(1 << 28, dtype=jnp.uint32)
  f = jax.jit(lambda a: ~a)
  return 2 * x.nbytes / median_seconds(f, (x,), 20, batches)


def gemm_rate(dtype, n, batches):
  """FLOP/s of an n x n x n GEMM in `dtype` with float32 accumulation and a `dtype` output."""
  a, b = (normal(k, (n, n), dtype) for k in jax.random.split(jax.random.PRNGKey(n), 2))
  f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype))
  return 2 * n**3 / median_seconds(f, (a, b), 10, batches)


def normal(key, shape, dtype=jnp.bfloat16):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def anchor(impl, causal):
  return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                              implementation=impl))


def sm90_missing(d, dtype_name):
  """Why the sm90 kernel cannot serve (D, dtype) here, or None when it can."""
  built = jax_sgl.attention_backend_info()["kernels"].get("sm90_fwd", {})
  dtype = jnp.dtype(DTYPES[dtype_name]).name
  if d not in built.get("head_dims", ()) or dtype not in built["dtypes"]:
    return f"hdim{d}_{dtype_name} not in this build's sm90 kernels {built}"
  cc = getattr(jax.devices()[0], "compute_capability", None)
  if cc != "9.0":
    return f"device compute capability {cc}, sm_90a needs 9.0"
  return None


def pallas_mgpu(q, k, v, causal):
  """Pallas Mosaic GPU attention compiled for these inputs ([B, S, H, D], as ours), or raises.
  It applies no softmax scale: the caller passes q already scaled by 1/sqrt(D).

  block_kv 128 first, 64 when 128 overflows shared memory (head dim 256)."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  error = None
  for block_kv in (128, 64):
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2,
                                         causal=causal)
    f = jax.jit(functools.partial(attention_mgpu.attention, config=config))
    try:
      return f.lower(q, k, v).compile()
    except Exception as e:  # shared memory overflow: try the smaller tile; else report
      error = e
  raise error


def candidates(q, k, v, causal, d, dtype_name):
  """{impl: (jitted fn, its args, prepare hook)} for one prefill configuration; unusable ones
  are left out (the reason printed once)."""
  b, s, h, _ = q.shape
  args = (q, k, v)
  ours = lambda q, k, v: jax_sgl.attention(q, k, v, causal=causal)
  runs = {}
  why = sm90_missing(d, dtype_name)
  if why is None:
    runs["sm90"] = (jit_with_disable(ours, ""), args, None)
  else:
    report_once("sm90", RuntimeError(why))
    runs["default"] = (jit_with_disable(ours, ""), args, None)
  runs["portable"] = (jit_with_disable(ours, "sm90"), args, None)
  runs["cudnn"] = (anchor("cudnn", causal), args, None)
  if fa3.load() is not None and fa3.serves("fwd", d):
    runs["fa3"] = (fa3.dense(causal), args, None)
  if dtype_name == "fp16":
    scaled = ((q * (1 / np.sqrt(d))).astype(q.dtype), k, v)  # outside the timed calls
    try:
      runs["pallas_mgpu"] = (pallas_mgpu(*scaled, causal), scaled, None)
    except Exception as e:  # not on this jax or device, or an API change: report, keep going
      report_once("pallas_mgpu", e)
  if b * h * s * s * 4 <= 8 << 30:  # XLA's float32 scores [B, H, S, S]
    runs["xla"] = (anchor("xla", causal), args, None)
  return runs


def warm_up(runs):
  """Compiles and runs each candidate once; drops those that fail and flags wrong outputs."""
  outputs = {}
  for name, (fn, args, prepare) in list(runs.items()):
    try:
      if prepare is not None:
        prepare()
      outputs[name] = jax.block_until_ready(fn(*args)).astype(jnp.float32)
    except Exception as e:  # an anchor that does not support the case (or runs out of memory)
      report_once(name, e)
      del runs[name]
  # The reference: cuDNN, else XLA, else jax_sgl (so FA3 is never timed unchecked).
  ref_name = next((n for n in ("cudnn", "xla", "sm90", "portable") if n in outputs), None)
  for name, out in outputs.items():
    if ref_name is not None and name != ref_name:
      if name == "fa3":  # an FA3 case its wheel does not serve: n/a, not a timed wrong result
        if not fa3.agrees(out, outputs[ref_name], f"this case (vs {ref_name})"):
          del runs[name]
        continue
      diff = float(jnp.max(jnp.abs(out - outputs[ref_name])))
      if not diff <= MAX_DIFF:
        print(f"  WARNING {name} differs from {ref_name} by {diff:.3g}")


def time_config(runs, flops, batches):
  """TFLOP/s per implementation, timed round-robin."""
  # ~20 TFLOP per batch: tens of ms on an H200 (143 calls at the smallest default config); the
  # cap keeps a tiny CPU dry run (--tokens 256) short.
  calls = min(max(3, int(2e13 // flops)), 300)
  seconds = interleaved_medians(runs, calls, batches)
  return {name: flops / t / 1e12 for name, t in seconds.items()}


def ours_of(row):
  """The jax_sgl result a row is judged by: sm90 where it ran, else the default dispatch, else
  portable."""
  name = next((n for n in ("sm90", "default") if row.get(n)), "portable")
  return name, row.get(name)


def print_row(row, gemm):
  fmt = lambda x: f"{x:8.0f}" if x else f"{'-':>8}"
  name, ours = ours_of(row)
  ratio = lambda impl: f"{ours / row[impl]:7.2f}x" if ours and row.get(impl) else f"{'-':>8}"
  pct = f"{100 * ours / gemm:6.0f}%" if ours else f"{'-':>7}"
  print(f"{row['S']:>6} {row['H']:>3}/{row['Hkv']:<2} {row['D']:>4} {row['dtype']:>5} "
        f"{str(row['causal']):>6} " + " ".join(fmt(row.get(i)) for i in IMPLS) +
        f" {pct} {ratio('cudnn')} {ratio('fa3')}  {ratio('pallas_mgpu')} {ratio('xla')}")


def print_summary(row, gemm):
  """One line per configuration; the ratios in parentheses are jax_sgl's rate over each."""
  name, ours = ours_of(row)
  part = lambda impl: (f"{row[impl]:.0f} ({ours / row[impl]:.2f}x)"
                       if ours and row.get(impl) else "-")
  portable = f", portable {part('portable')}" if name != "portable" else ""
  print(f"SUMMARY attention prefill S={row['S']} H{row['H']}/{row['Hkv']} D{row['D']} "
        f"{row['dtype']} causal={row['causal']}: {name} {ours or 0:.0f} TFLOP/s "
        f"({100 * (ours or 0) / gemm:.0f}% GEMM), cudnn {part('cudnn')}, "
        f"fa3 {part('fa3') if row.get('fa3') else 'n/a'}, "
        f"pallas {part('pallas_mgpu')}{portable}")


def prefill_config(s, shape, dtype_name, causal, tokens, batches):
  d, h, hkv = shape
  dtype = DTYPES[dtype_name]
  b = max(1, tokens // s)
  keys = jax.random.split(jax.random.PRNGKey(s + d + h), 3)
  args = (normal(keys[0], (b, s, h, d), dtype), normal(keys[1], (b, s, hkv, d), dtype),
          normal(keys[2], (b, s, hkv, d), dtype))
  flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
  runs = candidates(*args, causal, d, dtype_name)
  warm_up(runs)
  row = {"S": s, "B": b, "H": h, "Hkv": hkv, "D": d, "dtype": dtype_name, "causal": causal}
  row.update(time_config(runs, flops, batches))
  return row


def prefill(seqlens, batches, results, head_dims, dtype_names, gemm, tokens):
  print(f"\nprefill, B*S = {tokens} tokens; TFLOP/s; % GEMM and ratios are jax_sgl's (sm90, "
        f"else portable) over each")
  print(f"{'S':>6} {'H/Hkv':>6} {'D':>4} {'dtype':>5} {'causal':>6} " +
        " ".join(f"{LABELS.get(i, i):>8}" for i in IMPLS) +
        f" {'% GEMM':>7} {'vs cudnn':>8} {'vs fa3':>8} {'vs pallas':>9} {'vs xla':>8}")
  for dtype_name in dtype_names:
    extra = tuple((d, 16, 16) for d in head_dims if d not in {s[0] for s in PREFILL_SHAPES})
    for shape in PREFILL_SHAPES + extra:
      if shape[0] not in head_dims:
        continue
      for causal in (False, True):
        for s in seqlens:
          row = prefill_config(s, shape, dtype_name, causal, tokens, batches)
          row["gemm_pct"] = 100 * (ours_of(row)[1] or 0) / gemm[dtype_name]
          results["prefill"].append(row)
          print_row(row, gemm[dtype_name])
  for row in results["prefill"]:
    print_summary(row, gemm[row["dtype"]])


def paged_copy(k, v, rng):
  """The same keys in a shuffled page pool: [num_pages, PAGE, Hkv, D] + page table [B, pages]."""
  b, s, hkv, d = k.shape
  pages = s // PAGE
  perm = jnp.asarray(rng.permutation(b * pages), jnp.int32)
  table = perm.reshape(b, pages)
  inv = jnp.argsort(perm)
  to_pool = lambda x: x.reshape(b * pages, PAGE, hkv, d)[inv]
  return to_pool(k), to_pool(v), table


def fa3_decode(s, args, want):
  """FA3's paged decode (flash_mha_with_kvcache on jax_sgl's pool and page table), or None where
  FA3 is missing, fails or disagrees with `want` (the reason printed)."""
  if fa3.load() is None or not fa3.serves("fwd", args[0].shape[-1]):
    return None
  fn = fa3.paged(causal=False)  # one query per sequence: no mask, as jax_sgl's call
  try:
    return fn if fa3.agrees(fn(*args), want, f"decode KV={s}") else None
  except Exception as e:  # a case FA3 cannot take: report, keep the other anchors
    report_once("fa3", e)
    return None


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
    fa3_paged = fa3_decode(s, (q, k_pool, v_pool, table, seqused), want)
    times = {
        "jax_sgl paged": median_seconds(paged, (q, k_pool, v_pool, table, seqused), calls,
                                        batches),
        "jax_sgl contiguous": median_seconds(jax.jit(jax_sgl.attention), (q, k, v), calls,
                                             batches),
        "cudnn contiguous": try_time(anchor("cudnn", False), (q, k, v), calls, batches),
        "fa3 paged": (try_time(fa3_paged, (q, k_pool, v_pool, table, seqused), calls, batches)
                      if fa3_paged else None),
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
    cud, xla, fa = times["cudnn contiguous"], times["xla contiguous"], times["fa3 paged"]
    print(f"SUMMARY attention decode KV={s}: paged {nbytes / ours / 1e9:.0f} GB/s = "
          f"{(cud / ours) if cud else float('nan'):.2f}x cudnn contiguous, "
          f"{f'{fa / ours:.2f}x' if fa else 'n/a'} fa3 paged, "
          f"{(xla / ours) if xla else float('nan'):.2f}x xla")
    del q, k, v, k_pool, v_pool


def plot(results, path, gemm):
  """TFLOP/s vs S per implementation: a row of panels per (dtype, causal), a column per shape;
  the dotted line is the GEMM rate of that dtype."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = results["prefill"]
  shapes = sorted({(r["D"], r["H"], r["Hkv"]) for r in rows})
  panels = sorted({(r["dtype"], r["causal"]) for r in rows})
  width, height = max(3.6 * len(shapes), 7.5), 3 * len(panels)
  fig, axes = plt.subplots(len(panels), len(shapes), figsize=(width, height), sharey=True,
                           squeeze=False)
  for (dtype_name, causal), axes_row in zip(panels, axes):
    for (d, h, hkv), ax in zip(shapes, axes_row):
      for impl in IMPLS:
        pts = [(r["S"], r[impl]) for r in rows if r.get(impl) and r["dtype"] == dtype_name and
               r["causal"] == causal and (r["D"], r["H"], r["Hkv"]) == (d, h, hkv)]
        if pts:
          ax.plot(*zip(*pts), "-o", color=f"C{IMPLS.index(impl)}", label=impl, markersize=4)
      ax.axhline(gemm[dtype_name], linestyle=":", color="gray", label="GEMM")
      ax.set_xscale("log", base=2)
      ax.set_title(f"D{d} H{h}/{hkv} {dtype_name} causal={causal}", fontsize=9)
      ax.grid(True, alpha=0.3)
  for ax in axes[-1]:
    ax.set_xlabel("S (B*S constant)")
  for ax in axes[:, 0]:
    ax.set_ylabel("TFLOP/s")
  # One legend for the figure: the union of the panels' lines (pallas runs in fp16 only).
  labeled = {}
  for ax in axes.flat:
    labeled.update(zip(*reversed(ax.get_legend_handles_labels())))
  order = [n for n in (*IMPLS, "GEMM") if n in labeled]
  fig.legend([labeled[n] for n in order], order, loc="upper center", ncol=len(order), fontsize=8)
  fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / height))  # 0.4 inch for the legend
  fig.savefig(path, dpi=110)
  print(f"plot written to {path}")


def have_matplotlib():
  if importlib.util.find_spec("matplotlib") is not None:
    return True
  print("note: matplotlib is not installed; --plot is ignored (--json keeps the numbers)")
  return False


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
  parser.add_argument("--kv", type=int, nargs="+", default=[4096, 32768])
  parser.add_argument("--batches", type=int, default=7, help="timed batches per implementation")
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256],
                      help="a head dim outside PREFILL_SHAPES runs at 16 q / 16 kv heads")
  parser.add_argument("--dtype", choices=("bf16", "fp16", "both"), default="bf16",
                      help="prefill dtype(s); pallas_mgpu runs in fp16 only")
  parser.add_argument("--tokens", type=int, default=32768, help="prefill B*S")
  parser.add_argument("--gemm-n", type=int, default=8192, help="size of the reference GEMM")
  parser.add_argument("--skip-prefill", action="store_true")
  parser.add_argument("--skip-decode", action="store_true")
  parser.add_argument("--json", help="write the results here")
  parser.add_argument("--plot", help="write the prefill plot (PNG) here")
  args = parser.parse_args()
  dtype_names = ("bf16", "fp16") if args.dtype == "both" else (args.dtype,)
  plot_path = args.plot if args.plot and have_matplotlib() else None
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  # The build's sm90 instantiations and the mode the default (decode) calls run under.
  print(f"jax_sgl attention backend: {jax_sgl.attention_backend_info()}")
  copy_bw = copy_bandwidth(args.batches)
  print(f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s")
  results = {"prefill": [], "decode": [], "copy_GBps": copy_bw / 1e9}
  if not args.skip_decode:
    decode(args.kv, args.batches, copy_bw, results)
  if not args.skip_prefill:
    gemm = {name: gemm_rate(DTYPES[name], args.gemm_n, args.batches) / 1e12
            for name in dtype_names}
    for name, rate in gemm.items():
      print(f"{name} GEMM {args.gemm_n}^3 (f32 accumulate, {name} out): {rate:.0f} TFLOP/s")
    results["gemm_TFLOPs"] = gemm
    prefill(args.seqlens, args.batches, results, args.head_dims, dtype_names, gemm, args.tokens)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  if plot_path and results["prefill"]:
    plot(results, plot_path, results["gemm_TFLOPs"])


if __name__ == "__main__":
  main()
