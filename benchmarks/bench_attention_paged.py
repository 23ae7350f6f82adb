"""Attention over a paged KV pool (issue 23 item 6): jax_sgl.attention reading K/V through a page
table, against FlashAttention-3 on the same pool and jax_sgl on the same keys made contiguous,
all in one process and timed round-robin (timing.interleaved_medians).

Workloads (bf16, 32 q / 8 kv heads, D=128, causal with the last query on the last key):
  prefill  chunked prefill: B=8 sequences of 1024 new tokens after 4k / 16k of history
           (seqused_k = history + 1024), pages of 16 / 64 / 128;
  mixed    one packed batch (q [total_q, H, D] with cu_seqlens_q): 4 chunks of 512 new tokens,
           then 64 decode tokens, all after 8k of history; pages of 16 / 64;
  verify   speculative decoding's verify step: B=32 (--verify-batches), 8 / 32 draft tokens
           each after 8k of history, q dense [B, n, H, D]; pages of 16.
--only verify mixed runs just those rows (the verify and mixed rows of issue 23's key split).
Each page table is a random permutation of a pool 25% larger than the sequences need, so no page
follows its predecessor and some pages are never read (as in a server's pool).

Implementations:
  paged       jax_sgl.attention(q, k_pool, v_pool, page_table=, seqused_k=, causal=True);
  contiguous  jax_sgl.attention on the same keys gathered once, outside the timings, into dense
              [B, S, Hkv, D] (prefill, verify) or packed [total_k, Hkv, D] + cu_seqlens_k (mixed);
  fa3         flash_attn3_jax.flash_mha_with_kvcache on the same pool, page table and seqused_k.
              Its JAX API has no cu_seqlens_q beside a page table, so the mixed batch runs as its
              two parts (4 x 512 chunks, 64 x 1 decodes: two FA3 calls in one jitted function);
  fa3_varlen  mixed only: flash_attn3_jax.flash_mha_varlen on the contiguous packed batch, FA3's
              one-call form of a mixed batch (no page table).
--fp8: q and both pools in e4m3 (per-tensor descales max|x| / 448; issue 24's paged fp8), so
  paged and contiguous run jax_sgl's e4m3 forward with q/k/v_descale; fa3 / fa3_varlen (whose
  wheel has no fp8) and bf16 (jax_sgl paged, bf16) run on the same values dequantized to bf16,
  and GB/s count e4m3's one byte per element.
Before timing, each output is compared with `contiguous`; an FA3 result that differs is dropped.

TFLOP/s count the visible (causal) pairs only: a sequence with n new rows and L keys has
n*(L-n) + n*(n+1)/2, 4*D*H FLOPs each. GB/s count the K/V bytes of L keys per sequence read once
(what bounds decode-like rows). Lines starting with SUMMARY are collected by tools/gpu_check.sh.
--tiny shrinks every workload (token counts / 64, batch counts / 16, at least 2) for a CPU dry run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

import fa3
import jax_sgl
from bench_attention import normal, report_once
from timing import interleaved_medians

H, HKV, D = 32, 8, 128
DTYPE = jnp.bfloat16
# Pool pages over the pages the sequences use: a server's pool always has free pages.
POOL_SLACK = 1.25
IMPLS = ("paged", "contiguous", "fa3", "fa3_varlen")
IMPLS_FP8 = IMPLS + ("bf16",)
E4M3 = jnp.float8_e4m3fn
WORKLOADS = ("prefill", "mixed", "verify")
# Max |difference| of jax_sgl paged from jax_sgl contiguous above which the row is flagged (the
# same keys in the same order: only the kernels' rounding differs).
MAX_DIFF = 5e-2


@dataclasses.dataclass
class Workload:
  """One configuration: per sequence its new tokens (query rows) and its keys (seqused_k)."""
  label: str
  new: np.ndarray     # [B] query rows per sequence
  kv: np.ndarray      # [B] keys per sequence: history + new
  page: int
  packed: bool        # q packed with cu_seqlens_q; else dense [B, n, H, D] (all n equal)
  fp8: bool = False   # e4m3 q and pools (--fp8)

  @property
  def pairs(self):
    """Visible (query, key) pairs under the bottom-right causal mask."""
    n, kv = self.new.astype(np.int64), self.kv.astype(np.int64)
    return int(np.sum(n * (kv - n) + n * (n + 1) // 2))

  @property
  def flops(self):
    return 4 * D * H * self.pairs

  @property
  def kv_bytes(self):
    itemsize = jnp.dtype(E4M3 if self.fp8 else DTYPE).itemsize
    return int(np.sum(self.kv.astype(np.int64))) * HKV * D * 2 * itemsize


def workloads(args):
  """The configurations asked for, sizes shrunk by --tiny."""
  tok = (lambda n: max(1, n // 64)) if args.tiny else (lambda n: n)
  bat = (lambda b: max(2, b // 16)) if args.tiny else (lambda b: b)
  full = lambda b, n: np.full(b, n, np.int64)
  Workload_ = lambda *a, **k: Workload(*a, **k, fp8=args.fp8)
  out = []
  if "prefill" in args.only:
    b, n = bat(8), tok(1024)
    for hist in args.history:
      for page in args.pages:
        out.append(Workload_(f"prefill B{b} new {n} hist {tok(hist)} page {page}", full(b, n),
                            full(b, tok(hist) + n), page, packed=False))
  if "mixed" in args.only:
    chunks, chunk, decodes, hist = bat(4), tok(512), bat(64), tok(8192)
    new = np.concatenate([full(chunks, chunk), full(decodes, 1)])
    for page in args.mixed_pages:
      out.append(Workload_(f"mixed {chunks}x{chunk} + {decodes}x1 hist {hist} page {page}", new,
                          new + hist, page, packed=True))
  if "verify" in args.only:
    hist = tok(8192)
    for b in map(bat, args.verify_batches):
      for drafts in args.drafts:
        for page in args.verify_pages:
          out.append(Workload_(f"verify B{b} draft {drafts} hist {hist} page {page}",
                              full(b, drafts), full(b, hist + drafts), page, packed=False))
  return out


def paged_pool(w, rng, key, runs=0):
  """k/v page pools [num_pages, page, Hkv, D] and the page table [B, max_pages] int32: each
  sequence's pages are distinct entries of a random permutation of the pool, or with runs > 0 of
  the pool cut into runs of 1-runs consecutive pages in shuffled order (an allocator handing out
  a sorted free list)."""
  width = -(-int(w.kv.max()) // w.page)
  num_pages = int(np.ceil(POOL_SLACK * len(w.kv) * width))
  if runs > 0:
    cuts = np.cumsum(rng.integers(1, runs + 1, size=num_pages))
    pieces = np.split(np.arange(num_pages), cuts[cuts < num_pages])
    order = np.concatenate([pieces[i] for i in rng.permutation(len(pieces))])
  else:
    order = rng.permutation(num_pages)
  table = order[:len(w.kv) * width].reshape(len(w.kv), width)
  kk, kv = jax.random.split(key)
  pool = lambda k: normal(k, (num_pages, w.page, HKV, D), DTYPE)
  return pool(kk), pool(kv), jnp.asarray(table, jnp.int32)


def gather(pool, table, w):
  """The keys of every sequence in order, from the pool: dense [B, L, Hkv, D] when all sequences
  have L keys and q is dense, else packed [sum L, Hkv, D]."""
  table = np.asarray(table)
  if not w.packed:
    b, width = table.shape
    return pool[jnp.asarray(table)].reshape(b, width * w.page, HKV, D)[:, :int(w.kv[0])]
  slots = np.concatenate([table[i, np.arange(n) // w.page] * w.page + np.arange(n) % w.page
                          for i, n in enumerate(w.kv)])
  return pool.reshape(-1, HKV, D)[jnp.asarray(slots)]


def cumulative(lengths):
  return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def quantize(x):
  """(e4m3(x / descale), descale) with the per-tensor descale max|x| / 448, and the dequantized
  values in bf16 (what the bf16 anchors run on)."""
  descale = (jnp.max(jnp.abs(x.astype(jnp.float32))) / 448.0).astype(jnp.float32)
  x8 = (x.astype(jnp.float32) / descale).astype(E4M3)
  return x8, descale, (x8.astype(jnp.float32) * descale).astype(DTYPE)


def jax_sgl_runs(w, q, k_pool, v_pool, table, seqused, k, v, **descales):
  """jax_sgl paged and contiguous on one workload's operands ({impl: (jitted fn, args, None)})."""
  att = lambda *a, **kw: jax_sgl.attention(*a, causal=True, **kw, **descales)
  if w.packed:
    cu_q, cu_k = cumulative(w.new), cumulative(w.kv)
    return {"paged": (jax.jit(lambda q, kp, vp, t, u, cq: att(
                q, kp, vp, cu_seqlens_q=cq, page_table=t, seqused_k=u)),
                (q, k_pool, v_pool, table, seqused, cu_q), None),
            "contiguous": (jax.jit(lambda q, k, v, cq, ck: att(
                q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)), (q, k, v, cu_q, cu_k), None)}
  return {"paged": (jax.jit(lambda q, kp, vp, t, u: att(q, kp, vp, page_table=t, seqused_k=u)),
                    (q, k_pool, v_pool, table, seqused), None),
          "contiguous": (jax.jit(lambda q, k, v: att(q, k, v)), (q, k, v), None)}


def candidates(w, q, k_pool, v_pool, table, seqused, k, v):
  """{impl: (jitted fn, args, None)} for one workload, and a function per impl that turns its
  output into the packed (or dense) layout of `contiguous` for the comparison. --fp8: jax_sgl
  runs on e4m3 q and pools, the bf16 anchors on their dequantized values."""
  layout = {}
  if w.fp8:
    (q8, dq, q), (kp8, dk, k_pool), (vp8, dv, v_pool) = map(quantize, (q, k_pool, v_pool))
    k8, v8 = gather(kp8, table, w), gather(vp8, table, w)
    k, v = gather(k_pool, table, w), gather(v_pool, table, w)
    runs = jax_sgl_runs(w, q8, kp8, vp8, table, seqused, k8, v8, q_descale=dq, k_descale=dk,
                        v_descale=dv)
    runs["bf16"] = jax_sgl_runs(w, q, k_pool, v_pool, table, seqused, k, v)["paged"]
  else:
    runs = jax_sgl_runs(w, q, k_pool, v_pool, table, seqused, k, v)
  if fa3.load() is None or not fa3.serves("fwd", D):
    return runs, layout
  paged_fa3 = fa3.paged(causal=True)
  if not w.packed:
    runs["fa3"] = (paged_fa3, (q, k_pool, v_pool, table, seqused), None)
    return runs, layout
  # The mixed batch as FA3's API must take it: one call per part of equal query length (the
  # chunks, then the decodes), each over its own rows of the page table.
  parts = [(int(s), int(e), int(w.new[s])) for s, e in part_bounds(w.new)]
  rows = [int(r) for r in np.concatenate([[0], np.cumsum(w.new)])]
  print(f"  (fa3: flash_mha_with_kvcache takes no cu_seqlens_q, so this packed batch runs as "
        f"{len(parts)} calls ({', '.join(f'{e - s}x{n}' for s, e, n in parts)}); fa3_varlen is "
        f"one flash_mha_varlen call on the contiguous K/V)")

  def two_calls(q, kp, vp, t, u):
    return tuple(paged_fa3(q[rows[s]:rows[e]].reshape(e - s, n, H, D), kp, vp, t[s:e], u[s:e])
                 for s, e, n in parts)
  runs["fa3"] = (jax.jit(two_calls), (q, k_pool, v_pool, table, seqused), None)
  layout["fa3"] = lambda outs: jnp.concatenate([o.reshape(-1, H, D) for o in outs])
  runs["fa3_varlen"] = (fa3.varlen(True, int(w.new.max()), int(w.kv.max())),
                        (q, k, v, cumulative(w.new), cumulative(w.kv)), None)
  return runs, layout


def part_bounds(new):
  """[(first, end)) ranges of consecutive sequences with the same number of new tokens."""
  edges = [0] + [i for i in range(1, len(new)) if new[i] != new[i - 1]] + [len(new)]
  return list(zip(edges[:-1], edges[1:]))


def check(runs, layout, label):
  """Runs each implementation once (compiling it) and compares it with `contiguous`: a failing
  or disagreeing FA3 is dropped (n/a), a disagreeing jax_sgl paged is flagged."""
  outputs = {}
  for name, (fn, args, _) in list(runs.items()):
    try:
      outputs[name] = layout.get(name, lambda o: o)(jax.block_until_ready(fn(*args)))
    except Exception as e:  # an anchor that cannot take the case (page size, memory)
      report_once(name, e)
      del runs[name]
  want = outputs.get("contiguous")
  for name, out in outputs.items():
    if want is None or name == "contiguous":
      continue
    if name.startswith("fa3"):
      if not fa3.agrees(out, want, label):
        del runs[name]
    elif not fa3.max_diff(out, want) <= MAX_DIFF:
      print(f"  WARNING {name} differs from contiguous by {fa3.max_diff(out, want):.3g}")


def run_workload(w, batches, rng, seed, runs=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 2)
  k_pool, v_pool, table = paged_pool(w, rng, keys[0], runs)
  total_q = int(w.new.sum())
  q_shape = (total_q, H, D) if w.packed else (len(w.new), int(w.new[0]), H, D)
  q = normal(keys[1], q_shape, DTYPE)
  k, v = gather(k_pool, table, w), gather(v_pool, table, w)
  seqused = jnp.asarray(w.kv, jnp.int32)
  runs, layout = candidates(w, q, k_pool, v_pool, table, seqused, k, v)
  check(runs, layout, w.label)
  # ~20 TFLOP or ~50 GB of K/V per batch, whichever comes first (10-40 ms on an H200: launch
  # gaps stay small beside it), at least 3 and at most 300 calls (the cap keeps --tiny short).
  calls = int(min(max(3, min(2e13 // w.flops, 5e10 // w.kv_bytes)), 300))
  seconds = interleaved_medians(runs, calls, batches)
  row = {"config": w.label, "pairs": w.pairs, "kv_bytes": w.kv_bytes}
  for name, t in seconds.items():
    row[name] = {"TFLOPs": w.flops / t / 1e12, "GBps": w.kv_bytes / t / 1e9, "us": t * 1e6}
  return row


def tflops(row, impl):
  return row[impl]["TFLOPs"] if impl in row else None


def ratio(row, a, b):
  return tflops(row, a) / tflops(row, b) if a in row and b in row else None


def fmt(x, spec):
  return format(x, spec) if x is not None else "n/a".rjust(int(spec.split(".")[0]))


def print_header(impls):
  print(f"{'config':<44} " + " ".join(f"{i:>10}" for i in impls) +
        f" {'GB/s pgd':>8} {'pgd/fa3':>8} {'pgd/cont':>8}")


def print_row(row, impls):
  gbps = row["paged"]["GBps"] if "paged" in row else None
  print(f"{row['config']:<44} " + " ".join(fmt(tflops(row, i), "10.1f") for i in impls) +
        f" {fmt(gbps, '8.0f')} {fmt(ratio(row, 'paged', 'fa3'), '8.2f')}"
        f" {fmt(ratio(row, 'paged', 'contiguous'), '8.2f')}")


def print_summary(row):
  if "paged" not in row:
    print(f"SUMMARY attention paged {row['config']}: jax_sgl paged FAILED")
    return
  part = lambda impl: (f"{tflops(row, impl):.1f} ({ratio(row, 'paged', impl):.2f}x)"
                       if impl in row else "n/a")
  print(f"SUMMARY attention paged {row['config']}: jax_sgl paged {tflops(row, 'paged'):.1f} "
        f"TFLOP/s ({row['paged']['GBps']:.0f} GB/s K/V), contiguous {part('contiguous')}, "
        f"fa3 {part('fa3')}" + (f", fa3_varlen {part('fa3_varlen')}" if "fa3_varlen" in row
                                else "") + (f", bf16 {part('bf16')}" if "bf16" in row else ""))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, default=7, help="timed batches per implementation")
  parser.add_argument("--history", type=int, nargs="+", default=[4096, 16384],
                      help="prefill: keys before the 1024 new tokens")
  parser.add_argument("--pages", type=int, nargs="+", default=[16, 64, 128],
                      help="prefill page sizes")
  parser.add_argument("--mixed-pages", type=int, nargs="+", default=[16, 64])
  parser.add_argument("--drafts", type=int, nargs="+", default=[8, 32],
                      help="verify: draft tokens per sequence")
  parser.add_argument("--verify-pages", type=int, nargs="+", default=[16])
  parser.add_argument("--verify-batches", type=int, nargs="+", default=[32],
                      help="verify: sequences per call")
  parser.add_argument("--only", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                      help="run only these workloads")
  parser.add_argument("--page-runs", type=int, default=0,
                      help="page tables of runs of 1-N consecutive pages (default 0: shuffled)")
  parser.add_argument("--tiny", action="store_true",
                      help="token counts / 64, batch counts / 16: a CPU dry run")
  parser.add_argument("--fp8", action="store_true",
                      help="e4m3 q and pools with descales (fa3 and bf16 on their bf16 values)")
  parser.add_argument("--json", help="write the results here")
  args = parser.parse_args()
  impls = IMPLS_FP8 if args.fp8 else IMPLS
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print(f"jax_sgl attention backend: {jax_sgl.attention_backend_info()}")
  fa3.load()
  print(f"\npaged attention, H{H}/{HKV} D{D} {'e4m3' if args.fp8 else 'bf16'} causal; TFLOP/s "
        f"of the visible pairs; GB/s of jax_sgl paged's K/V; ratios are jax_sgl paged over each")
  print_header(impls)
  rng = np.random.default_rng(0)
  rows = []
  for i, w in enumerate(workloads(args)):
    row = run_workload(w, args.batches, rng, seed=i, runs=args.page_runs)
    rows.append(row)
    print_row(row, impls)
  for row in rows:
    print_summary(row)
  print("\nsummary (TFLOP/s; the mixed batch's fa3 is two calls, fa3_varlen one call on "
        "contiguous K/V)")
  print_header(impls)
  for row in rows:
    print_row(row, impls)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
