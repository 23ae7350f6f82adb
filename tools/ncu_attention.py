"""Nsight Compute views of jax_sgl's attention kernels beside cuDNN's, for the notes on what
limits each (benchmarks/notes/NOTES_*.md). Four modes:

  python3 tools/ncu_attention.py run CASE      one call of CASE inside cudaProfilerStart/Stop,
                                               after a warm-up call; run it under
                                               `ncu --profile-from-start off` (tools/ncu_attention.sh)
  python3 tools/ncu_attention.py summary CSV.. one line per kernel of each `ncu --csv --page
                                               details` file: time, SM / tensor / DRAM throughput,
                                               issue activity, registers, occupancy
  python3 tools/ncu_attention.py hot CSV [N]   from a source page (NCU_SOURCE=1 in
                                               tools/ncu_attention.sh): the warp-stall samples by
                                               reason and by opcode, and the N hottest SASS lines
                                               with their top reasons
  python3 tools/ncu_attention.py roles CSV US [CSV US]
                                               source pages of warp-specialized kernels, each with
                                               its kernel's duration in us: samples and
                                               instructions of the producer and consumer code, and
                                               the consumers' time by stall reason and by opcode,
                                               two kernels side by side

CASE is <what>-<impl>: what in fwd4k, fwd4kc, fwd8k, fwdbwd4k, fwdbwd4kc (causal), decode32k,
decode32kc; impl in jax_sgl, cudnn, and for the fwd / fwdbwd cases fa3 (FlashAttention-3
through flash-attn3-jax, benchmarks/fa3.py). Shapes are the benchmarks' (bench_attention.py,
bench_attention_bwd.py): B*S = 32k, H=16, D=128, bf16; decode B=64, 32/8 heads, KV 32k in
16-key pages (decode32kc: jax_sgl on the contiguous K/V, as cuDNN reads them in both decode
cases). Chunked prefill over the paged pool (bench_attention_paged.py's B=8 x 1024 new tokens
after 4k of history, shuffled pages): what in paged1, paged16, paged64 (the page size; 1 is the
token pool, which the sm90 kernel's cp.async gather loads); impl jax_sgl (paged), contig (jax_sgl
on the same keys made contiguous) or fa3 (FlashAttention-3 on the pool). Speculative verify
(bench_attention_paged.py's B=32 x 32 draft tokens after 8k of history, dense q, shuffled pages):
what in verify1, verify16, verify64 (the page size), impl jax_sgl or fa3.
"""

from __future__ import annotations

import csv
import pathlib
import re
import sys

# fwdbwdv*: jax_sgl over the same batch packed (cu_seqlens; the anchors stay dense).
CASES = ("fwd4k", "fwd4kc", "fwd8k", "fwdbwd4k", "fwdbwd4kc", "fwdbwdv4k", "fwdbwdv4kc",
         "decode32k", "decode32kc", "paged1", "paged16", "paged64", "verify1", "verify16",
         "verify64", "fp8fwd4k", "fp8fwd4kc")
# The implementations each kind of case runs (by the case's prefix); any other pairing would
# fall through to another implementation's branch of case_fn and profile that one instead.
IMPLS = {"paged": ("jax_sgl", "contig", "fa3"), "verify": ("jax_sgl", "fa3"),
         "decode": ("jax_sgl", "cudnn"),
         "fwd": ("jax_sgl", "cudnn", "fa3"), "fp8": ("jax_sgl", "cudnn")}

# (column, ncu metric name): the columns of the summary, from the sections that
# tools/ncu_attention.sh asks for.
COLUMNS = (
    ("us", "Duration"),
    ("SM%", "Compute (SM) Throughput"),
    ("DRAM%", "DRAM Throughput"),
    ("L2%", "L2 Cache Throughput"),
    ("L2hit%", "L2 Hit Rate"),
    ("issue%", "Issue Slots Busy"),
    ("regs", "Registers Per Thread"),
    ("occ%", "Achieved Occupancy"),
)


def profiler(start):
  """cudaProfilerStart / Stop through torch's cudart (the device image has torch), else nothing:
  ncu then profiles the warm-up call too."""
  try:
    import torch
    (torch.cuda.profiler.start if start else torch.cuda.profiler.stop)()
  except Exception as e:  # no torch: the whole process is profiled
    print(f"(no profiler range: {e})", file=sys.stderr)


def case_fn(case):
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jax_sgl

  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
  what, impl = case.rsplit("-", 1)
  kind = next(k for k in IMPLS if what.startswith(k)) if what in CASES else None
  assert kind is not None and impl in IMPLS[kind], f"{case}: no such case"
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16)
  if kind in ("paged", "verify"):
    import bench_attention_paged as bench
    b, new, hist = (8, 1024, 4096) if kind == "paged" else (32, 32, 8192)
    w = bench.Workload(what, np.full(b, new), np.full(b, hist + new), int(what[len(kind):]),
                       False)
    k_pool, v_pool, table = bench.paged_pool(w, np.random.default_rng(0), keys[1])
    q = normal(keys[0], (b, new, bench.H, bench.D))
    runs, _ = bench.candidates(w, q, k_pool, v_pool, table, jnp.asarray(w.kv, jnp.int32),
                               bench.gather(k_pool, table, w), bench.gather(v_pool, table, w))
    fn, args, _ = runs[{"jax_sgl": "paged", "contig": "contiguous"}.get(impl, impl)]
    return fn, args
  if what.startswith("fp8"):  # e4m3 q / k / v with per-tensor descales, bench_attention_fp8's
    import bench_attention_fp8 as bench
    causal = what.endswith("c")
    b, s = 32768 // 4096, 4096
    (q8, dq), (k8, dk), (v8, dv) = (bench.quantize(keys[i], (b, s, bench.H, bench.D))
                                    for i in range(3))
    if impl == "cudnn":
      return bench.cudnn_fp8(causal, (dq, dk, dv)), (q8, k8, v8)
    return jax.jit(lambda q, k, v, a, c, e: jax_sgl.attention(
        q, k, v, causal=causal, q_descale=a, k_descale=c, v_descale=e)), (q8, k8, v8, dq, dk, dv)
  if what.startswith("decode32k"):
    b, s, h, hkv, d, page = 64, 32768, 32, 8, 128, 16
    q = normal(keys[0], (b, 1, h, d))
    k, v = normal(keys[1], (b, s, hkv, d)), normal(keys[2], (b, s, hkv, d))
    if impl == "cudnn":
      fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
      return fn, (q, k, v)
    if what == "decode32kc":
      return jax.jit(jax_sgl.attention), (q, k, v)
    pages = s // page
    perm = jnp.asarray(np.random.default_rng(0).permutation(b * pages), jnp.int32)
    inv = jnp.argsort(perm)
    to_pool = lambda x: x.reshape(b * pages, page, hkv, d)[inv]
    fn = jax.jit(lambda q, kp, vp, t, u: jax_sgl.attention(q, kp, vp, page_table=t, seqused_k=u))
    return fn, (q, to_pool(k), to_pool(v), perm.reshape(b, pages), jnp.full((b,), s, jnp.int32))
  s = 8192 if what == "fwd8k" else 4096
  causal = what in ("fwd4kc", "fwdbwd4kc", "fwdbwdv4kc")
  b, h, d = 32768 // s, 16, 128
  q, k, v = (normal(keys[i], (b, s, h, d)) for i in range(3))
  if impl == "fa3":
    import fa3
    assert fa3.load() is not None, "flash-attn3-jax is not importable"
  if what.startswith("fwdbwd"):
    import bench_attention_bwd
    _, grad = bench_attention_bwd.attention_fns(impl, causal, varlen=what.startswith("fwdbwdv"))
    return grad, (q, k, v)
  if impl == "jax_sgl":
    attn = lambda q, k, v: jax_sgl.attention(q, k, v, causal=causal)
  elif impl == "fa3":
    attn = fa3.dense_attention(causal)
  else:
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation="cudnn")
  return jax.jit(attn), (q, k, v)


def run(case):
  import jax
  fn, args = case_fn(case)
  jax.block_until_ready(fn(*args))  # compile + warm-up, outside the profiled range
  jax.block_until_ready(fn(*args))
  profiler(True)
  jax.block_until_ready(fn(*args))
  profiler(False)


def summary(paths):
  head = f"{'case':<18} {'kernel':<58}" + "".join(f"{c:>8}" for c, _ in COLUMNS)
  print(head)
  for path in paths:
    case = path.rsplit("/", 1)[-1].removesuffix(".csv")
    kernels = {}  # ID -> (name, {metric: value})
    with open(path, newline="") as f:
      lines = [l for l in f if l.startswith('"')]  # ncu's own log lines are not CSV
    for rec in csv.DictReader(lines):
      entry = kernels.setdefault(rec["ID"], (rec["Kernel Name"], {}))
      entry[1][rec["Metric Name"]] = (rec["Metric Unit"], rec["Metric Value"])
    for name, metrics in kernels.values():
      cells = []
      for _, metric in COLUMNS:
        unit, value = metrics.get(metric, ("", "-"))
        value = value.replace(",", "")
        try:
          x = float(value)
          if metric == "Duration":  # ncu picks the unit per kernel
            x *= {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3,
                  "ms": 1e3, "second": 1e6, "s": 1e6}.get(unit, 1.0)
          cells.append(f"{x:8.1f}")
        except ValueError:
          cells.append(f"{value:>8}")
      print(f"{case:<18} {name[:58]:<58}" + "".join(cells))
      # Cycles a warp spends stalled per issued instruction, by reason (largest first), and the
      # tensor pipes' active share (tools/ncu_attention.sh asks for both by regex).
      stalls = {}
      for metric, (_, value) in metrics.items():
        m = re.fullmatch(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio", metric)
        if m:
          stalls[m.group(1)] = float(value.replace(",", "") or 0)
      if stalls:
        top = sorted(stalls.items(), key=lambda kv: -kv[1])[:7]
        print(f"{'':<18}   stalls/issue: " + ", ".join(f"{k} {v:.2f}" for k, v in top))
      pipes = [(metric.split("__")[1].split(".")[0], value) for metric, (_, value) in
               metrics.items() if metric.startswith("sm__pipe_tensor")]
      if pipes:
        print(f"{'':<18}   tensor pipes % of peak (active cycles): " +
              ", ".join(f"{k} {v}" for k, v in pipes))
      # L2 read work per DRAM sector (session 7: ours hit 53% in L2 at 87.6% DRAM throughput,
      # cuDNN's decode 0.8% at 95.9%, both at 96.5% L2 throughput).
      l2 = {metric.removesuffix(".sum"): float(value.replace(",", "") or 0)
            for metric, (_, value) in metrics.items()
            if metric.startswith(("lts__t_", "dram__sectors_read"))}
      dram = l2.pop("dram__sectors_read", 0.0)
      if l2:
        print(f"{'':<18}   L2 reads per DRAM sector read ({dram:.3g}): " +
              ", ".join(f"{k.removeprefix('lts__t_')} {v / dram if dram else float('nan'):.2f}"
                        for k, v in sorted(l2.items())))


SAMPLES = "Warp Stall Sampling (All Samples)"


class SourcePage:
  """One kernel's SASS source page (`ncu --page source --csv --print-source sass`): its lines in
  address order, the stall-reason columns, and value(line, column) as a number (0 if blank)."""

  def __init__(self, path):
    with open(path, newline="") as f:
      rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    self.col = {name: i for i, name in enumerate(rows[head])}
    self.lines = [r for r in rows[head + 1:] if len(r) == len(rows[head])]
    self.reasons = [n for n in rows[head] if n.startswith("stall_") and "(" not in n]

  def value(self, row, name):
    try:
      return float(row[self.col[name]].replace(",", ""))
    except ValueError:
      return 0.0

  def opcode(self, row):
    words = [w for w in row[self.col["Source"]].split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def hot(path, top=30):
  page = SourcePage(path)
  lines, reasons, value, samples = page.lines, page.reasons, page.value, SAMPLES
  col = page.col
  total = sum(value(r, samples) for r in lines) or 1.0
  print(f"{path}: {total:.0f} warp samples")
  by_reason = {n: sum(value(r, n) for r in lines) for n in reasons}
  for n, v in sorted(by_reason.items(), key=lambda kv: -kv[1])[:10]:
    print(f"  {n.removeprefix('stall_'):20s} {100 * v / total:5.1f}%")
  by_op = {}
  for r in lines:
    op = page.opcode(r)
    by_op[op] = by_op.get(op, 0.0) + value(r, samples)
  print("  by opcode: " + ", ".join(f"{op} {100 * v / total:.1f}%" for op, v in
                                   sorted(by_op.items(), key=lambda kv: -kv[1])[:12]))
  for r in sorted(lines, key=lambda r: -value(r, samples))[:top]:
    why = sorted(((value(r, n), n.removeprefix("stall_")) for n in reasons), reverse=True)[:2]
    print(f"  {r[col['Address']][-5:]} {100 * value(r, samples) / total:5.2f}%  "
          f"{r[col['Source']].strip()[:64]:64s} " +
          " ".join(f"{n} {100 * v / total:.2f}" for v, n in why if v))


def roles(pairs):
  """The warp roles of warp-specialized kernels (the sm90 forward: a producer warpgroup that
  gives its registers back with USETMAXREG.DEALLOC, and the consumers' code before it), side by
  side; printed, and returned per kernel as {stall reason: consumer us}. The sampler takes one
  warp per scheduler at a time, so a role's share of the samples is not its share of the time
  when the kernels run different numbers of warps; the consumers' states are given as time
  instead: their fraction of the consumer samples times the kernel's duration (every consumer
  warp lives for the whole kernel)."""
  pages, times, parts = [], [], []
  for path, us in pairs:
    page = SourcePage(path)
    split = next((i for i, r in enumerate(page.lines)
                  if "USETMAXREG.DEALLOC" in r[page.col["Source"]]), len(page.lines))
    pages.append(page)
    times.append(float(us))
    parts.append({"consumer": page.lines[:split], "producer": page.lines[split:]})
  names = [p.rsplit("/", 1)[-1].removesuffix(".sass.csv") for p, _ in pairs]
  print("kernel:   " + " | ".join(f"{n} ({t:.0f} us)" for n, t in zip(names, times)))
  for role in ("consumer", "producer"):
    print(f"{role + ':':10s}" + " | ".join(
        f"{sum(pg.value(r, SAMPLES) for r in part[role]):8.0f} samples, "
        f"{sum(pg.value(r, 'Instructions Executed') for r in part[role]) / 1e6:7.1f}M instructions"
        for pg, part in zip(pages, parts)))

  def consumer_us(i, keep):  # {keep(page, line, reason): us} over the consumer lines
    page, lines = pages[i], parts[i]["consumer"]
    total = sum(page.value(r, SAMPLES) for r in lines) or 1.0
    out = {}
    for r in lines:
      for reason in page.reasons:
        v = page.value(r, reason)
        if v:
          key = keep(page, r, reason)
          out[key] = out.get(key, 0.0) + v / total * times[i]
    return out

  by_reason = [consumer_us(i, lambda pg, r, reason: reason.removeprefix("stall_"))
               for i in range(len(pages))]
  print("consumer time by state (us): " + " | ".join(names))
  keys = sorted(set().union(*by_reason), key=lambda k: -max(d.get(k, 0.0) for d in by_reason))
  for k in keys[:10]:
    print(f"  {k:20s}" + "".join(f"{d.get(k, 0.0):9.1f}" for d in by_reason))
  by_op = [consumer_us(i, lambda pg, r, reason: (pg.opcode(r), reason.removeprefix("stall_")))
           for i in range(len(pages))]
  print("consumer time by (opcode, state), largest differences (us):")
  keys = set().union(*by_op)
  diff = lambda k: max(d.get(k, 0.0) for d in by_op) - min(d.get(k, 0.0) for d in by_op)
  for k in sorted(keys, key=lambda k: -diff(k))[:15]:
    print(f"  {k[0] + ' ' + k[1]:28s}" + "".join(f"{d.get(k, 0.0):9.1f}" for d in by_op))
  return by_reason


if __name__ == "__main__":
  if len(sys.argv) >= 3 and sys.argv[1] == "run":
    run(sys.argv[2])
  elif len(sys.argv) >= 3 and sys.argv[1] == "summary":
    summary(sys.argv[2:])
  elif len(sys.argv) >= 4 and sys.argv[1] == "roles" and len(sys.argv) % 2 == 0:
    roles(list(zip(sys.argv[2::2], sys.argv[3::2])))
  elif len(sys.argv) >= 3 and sys.argv[1] == "hot":
    hot(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 30)
  else:
    sys.exit(__doc__)
