"""Varlen prefill: jax_sgl.attention on packed ragged sequences (cu_seqlens_q / cu_seqlens_k)
against what a JAX user has today, cuDNN on the same sequences padded to the longest one with
query_seq_lengths / key_value_seq_lengths, all timed round-robin in one process.

  sm90      jax_sgl varlen on the Hopper kernel's varlen instantiation (the default)
  portable  jax_sgl varlen on the sm80 mma.sync kernel (JAX_SGL_DISABLE=sm90)
  cudnn     jax.nn.dot_product_attention(implementation="cudnn") on the padded batch

Sequence lengths are drawn uniformly from [S/2, 3S/2] (seeded) until about --tokens tokens.
TFLOP/s counts the useful work of every implementation alike: sum over sequences of 4*H*L^2*D,
halved when causal (as bench_attention.py's dense rows). Prints one 'SUMMARY ' line per config.

Run from outside the source tree (so `import jax_sgl` is the installed package):
  python3 /path/to/benchmarks/bench_attention_varlen.py [--seqlens 1024 4096] [--batches 7]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_sgl
from bench_attention import DTYPES, normal, report_once, sm90_missing, warm_up
from timing import interleaved_medians, jit_with_disable


def ragged_lengths(s, tokens, seed):
  rng = np.random.default_rng(seed)
  lens = []
  while sum(lens) < tokens:
    lens.append(int(rng.integers(s // 2, 3 * s // 2 + 1)))
  return np.asarray(lens)


def pad(x, lens, cu, longest):
  """[total, H, D] -> [B, longest, H, D], zero rows past each sequence's end."""
  rows = np.minimum(np.arange(longest)[None, :], lens[:, None] - 1) + cu[:-1, None]
  valid = np.arange(longest)[None, :] < lens[:, None]
  return jnp.where(jnp.asarray(valid)[..., None, None], x[jnp.asarray(rows)], 0)


def config(s, h, d, dtype_name, causal, tokens, batches):
  lens = ragged_lengths(s, tokens, seed=s + h + d)
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  total, longest = int(cu[-1]), int(lens.max())
  keys = jax.random.split(jax.random.PRNGKey(s + d), 3)
  q, k, v = (normal(key, (total, h, d), DTYPES[dtype_name]) for key in keys)
  cu_j, lens_j = jnp.asarray(cu), jnp.asarray(lens, jnp.int32)
  ours = lambda q, k, v, cu: jax_sgl.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                causal=causal)
  runs = {}
  why = sm90_missing(d, dtype_name)
  if why is None:
    runs["sm90"] = (jit_with_disable(ours, ""), (q, k, v, cu_j), None)
  else:
    report_once("sm90", RuntimeError(why))
  runs["portable"] = (jit_with_disable(ours, "sm90"), (q, k, v, cu_j), None)
  padded = tuple(pad(x, lens, cu, longest) for x in (q, k, v))
  cudnn = jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, query_seq_lengths=n, key_value_seq_lengths=n,
      implementation="cudnn"))
  runs["cudnn"] = (cudnn, (*padded, lens_j), None)
  warm_up_packed(runs, cu, lens, longest)
  flops = float(np.sum(4.0 * h * d * lens.astype(np.float64) ** 2)) * (0.5 if causal else 1.0)
  calls = min(max(3, int(2e13 // flops)), 300)
  seconds = interleaved_medians(runs, calls, batches)
  return {"S": s, "sequences": len(lens), "tokens": total, "longest": longest, "H": h, "D": d,
          "dtype": dtype_name, "causal": causal,
          **{name: flops / t / 1e12 for name, t in seconds.items()}}


def warm_up_packed(runs, cu, lens, longest):
  """warm_up on the packed outputs: cuDNN's padded [B, longest, H, D] result is packed first, so
  every implementation is compared with cuDNN row for row."""
  rows = jnp.asarray(np.concatenate([b * longest + np.arange(n) for b, n in enumerate(lens)]))
  pack = lambda fn: lambda *a: (lambda o: o.reshape(-1, *o.shape[2:])[rows])(fn(*a))
  wrapped = {name: ((pack(fn) if name == "cudnn" else fn), args, prep)
             for name, (fn, args, prep) in runs.items()}
  warm_up(wrapped)
  for name in list(runs):
    if name not in wrapped:
      del runs[name]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
  parser.add_argument("--batches", type=int, default=7)
  parser.add_argument("--tokens", type=int, default=32768)
  parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
  args = parser.parse_args()
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print(f"varlen prefill, ~{args.tokens} tokens, lengths in [S/2, 3S/2], H16 D128 "
        f"{args.dtype}; TFLOP/s of the useful work")
  print(f"{'S':>6} {'seqs':>5} {'longest':>7} {'causal':>6} {'sm90':>8} {'portable':>8} "
        f"{'cudnn':>8} {'vs cudnn':>8}")
  rows = []
  for causal in (False, True):
    for s in args.seqlens:
      r = config(s, 16, 128, args.dtype, causal, args.tokens, args.batches)
      rows.append(r)
      fmt = lambda x: f"{x:8.0f}" if x else f"{'-':>8}"
      ours = r.get("sm90") or r.get("portable")
      ratio = f"{ours / r['cudnn']:7.2f}x" if ours and r.get("cudnn") else f"{'-':>8}"
      print(f"{s:>6} {r['sequences']:>5} {r['longest']:>7} {str(causal):>6} "
            f"{fmt(r.get('sm90'))} {fmt(r.get('portable'))} {fmt(r.get('cudnn'))} {ratio}")
  for r in rows:
    ours = r.get("sm90") or r.get("portable") or 0
    cud = r.get("cudnn")
    print(f"SUMMARY attention varlen S~{r['S']} D{r['D']} {r['dtype']} causal={r['causal']}: "
          f"{'sm90' if r.get('sm90') else 'portable'} {ours:.0f} TFLOP/s, cudnn padded "
          f"{cud or 0:.0f} ({ours / cud if cud else float('nan'):.2f}x), portable "
          f"{r.get('portable') or 0:.0f}")


if __name__ == "__main__":
  main()
