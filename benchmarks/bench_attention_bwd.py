"""Benchmark of the jax_sgl.attention backward (CUDA) against its anchors, in the same process:

  cudnn    jax.grad of jax.nn.dot_product_attention(implementation="cudnn");
  fa3      jax.grad of FlashAttention-3's flash_attn3_jax.flash_mha (benchmarks/fa3.py: optional,
           GPU only), 'n/a' where it fails or its gradients disagree with cuDNN's (else XLA's,
           else jax_sgl's): the PyPI wheel 0.2.3 has head dim 128 kernels only;
  xla      jax.grad of jax.nn.dot_product_attention(implementation="xla") (skipped where its
           score matrices would not fit comfortably);
  jax_sgl  jax.grad of jax_sgl.attention, with the CUDA backward kernel (the default; --reference-bwd
           sets JAX_SGL_DISABLE=cuda_bwd, the reference lowering), once per
           backward named in --bwd, each row labelled with the kernel that served it:
             sm80      the portable mma.sync kernels (JAX_SGL_DISABLE=sm90_bwd);
             sm90      the Hopper wgmma + TMA kernel, dQ by float32 atomics (the default);
             sm90det   the same with deterministic=True (dQ by the sm90 dQ kernel, no
                       atomics: bitwise reproducible).
           The sm90 variants run only where the build has the kernel and the device is 9.0;
           these dense calls are all in its coverage. JAX_SGL_DISABLE is read when a call is
           lowered, and every variant's functions are jitted afresh after it is set.

Issue 4's cases: bf16, D=128, H=16 (MHA), B*S = 32768 tokens, S in {4k, 8k}, causal and not;
--head-dims 64 128 256 adds issue 27's (FA3 beside cuDNN and XLA at each head dim). --varlen
passes jax_sgl the same sequences packed (cu_seqlens_q / cu_seqlens_k, the layout of a
training batch of documents; the anchors keep the dense batch, the same work): e.g.
`--varlen --bwd sm80 sm90` times the varlen backward's two kernels in one process.
TFLOP/s count the forward's 4*B*H*S^2*D (halved when causal) times 3.5 for forward+backward
(jax.grad of the loss runs both) and times 2.5 for the backward alone, whose time is taken as the
forward+backward time minus the forward's. Each timing is the median over batches of
back-to-back calls (wall clock around block_until_ready, after warm-up). Lines starting with
SUMMARY are collected by tools/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

import fa3
import jax_sgl
from timing import try_time

DTYPE = jnp.bfloat16
# jax_sgl's portable (sm80) CUDA backward serves head dims up to this; above it only the sm90
# backward's wide kernel (192, 256, Hopper) is native, else the reference's vjp.
MAX_CUDA_BWD_HEAD_DIM = 128
# FA3's gradients further than this (relative to the anchor's max) from the anchor's are taken as
# a head dim its wheel does not serve: a wrong or absent kernel is off by O(1), bf16 rounding of
# these gradients by ~1e-2.
FA3_MAX_ERR = 0.1


# --bwd variant -> (JAX_SGL_DISABLE, the `deterministic` argument) while it is timed.
BWD_VARIANTS = {"sm80": ("sm90_bwd", False), "sm90": ("", False), "sm90det": ("", True)}


def set_bwd_variant(name, reference_bwd=False):
  """Sets JAX_SGL_DISABLE for variant `name` (plus cuda_bwd with --reference-bwd) and returns its
  `deterministic` argument."""
  disable, deterministic = BWD_VARIANTS[name]
  os.environ["JAX_SGL_DISABLE"] = ",".join(n for n in (disable, "cuda_bwd" if reference_bwd else "") if n)
  return deterministic


def sm90_bwd_available(head_dim, name="sm90"):
  """The sm90 backward for bf16 at head_dim is built and the device is compute capability 9.0."""
  del name
  built = jax_sgl.attention_backend_info()["kernels"].get("sm90_bwd", {})
  device = jax.devices()[0]
  return (head_dim in built.get("head_dims", ()) and "bfloat16" in built["dtypes"]
          and getattr(device, "compute_capability", "") == "9.0")


def attention_fns(impl, causal, deterministic=False, varlen=False):
  """(forward, forward+backward) jitted for one implementation; `varlen`: jax_sgl gets the batch
  packed, [B * S, H, D] with cu_seqlens of equal lengths S."""
  if impl.startswith("jax_sgl") and varlen:
    def attn(q, k, v):
      b, s = q.shape[:2]
      cu = jnp.arange(b + 1, dtype=jnp.int32) * s
      pack = lambda x: x.reshape((b * s,) + x.shape[2:])
      out = jax_sgl.attention(pack(q), pack(k), pack(v), causal=causal, cu_seqlens_q=cu,
                              cu_seqlens_k=cu, deterministic=deterministic)
      return out.reshape(q.shape[:3] + out.shape[-1:])
  elif impl.startswith("jax_sgl"):
    attn = lambda q, k, v: jax_sgl.attention(q, k, v, causal=causal, deterministic=deterministic)
  elif impl == "fa3":
    attn = fa3.dense_attention(causal)
  else:
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation=impl)
  # A loss whose cotangent dO is a fixed random-looking tensor (cos of out), so nothing folds.
  loss = lambda q, k, v: jnp.sum(jnp.cos(attn(q, k, v).astype(jnp.float32)))
  return jax.jit(attn), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def check_close(q, k, v, causal, deterministic, impl="jax_sgl", refs=("cudnn", "xla"),
                varlen=False):
  """max |grad - anchor| / max |anchor| over dq, dk, dv of `impl` against the first of `refs`
  that runs, on the benchmark's own inputs; None when none runs."""
  _, ours = attention_fns(impl, causal, deterministic, varlen)
  for ref in refs:
    try:
      _, anchor = attention_fns(ref, causal)
      want = anchor(q, k, v)
      break
    except Exception:
      continue
  else:
    return None
  got = ours(q, k, v)
  err = 0.0
  for g, w in zip(got, want):
    w = w.astype(jnp.float32)
    err = max(err, float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / jnp.max(jnp.abs(w))))
  return err


def fa3_missing(q, k, v, causal):
  """Why FA3's forward+backward cannot be timed for these inputs ('n/a'), or None when its
  gradients match an anchor's (cuDNN, else XLA, else jax_sgl's): a wrong result is not timed."""
  try:
    err = check_close(q, k, v, causal, False, impl="fa3", refs=("cudnn", "xla", "jax_sgl"))
  except Exception as e:  # refused by the wheel (head dim, dtype) or out of memory
    return f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
  if err is None:
    return "no anchor ran to check its gradients against"
  if not err <= FA3_MAX_ERR:
    return f"gradients differ from the anchor's by {err:.2g} of their max: not served by this wheel"
  return None


def bench_head_dim(d, args):
  """The forward+backward rows of every S and causal mode at head dim d."""
  variants = [b for b in args.bwd if b == "sm80" or sm90_bwd_available(d, b)]
  if args.reference_bwd or not variants:
    variants = ["sm80"]
  # The SUMMARY line reports the fastest path this build offers by default-able means: sm90 when
  # it ran, else sm80.
  primary = "sm90" if "sm90" in variants else variants[0]
  h = args.heads
  print(f"\nforward+backward, B*S = {args.tokens} tokens, H={h}, D={d}, bf16; TFLOP/s "
        f"(fwd+bwd counts 3.5x the forward's flops, bwd alone 2.5x); backward variants: "
        f"{' '.join(variants)}")
  if d > MAX_CUDA_BWD_HEAD_DIM and not args.reference_bwd:
    print(f"  (above head dim {MAX_CUDA_BWD_HEAD_DIM} jax_sgl's CUDA backward is the sm90 one "
          "alone (sm90 / sm90det), on Hopper at 192 / 256: sm80 rows time the reference backward)")
  print(f"{'S':>6} {'causal':>6} {'impl':<14} {'fwd+bwd ms':>10} {'fwd+bwd':>8} {'bwd':>8} "
        f"{'jax_sgl vs':>10}")
  for s in args.seqlens:
    b = max(1, args.tokens // s)
    for causal in (False, True):
      keys = jax.random.split(jax.random.PRNGKey(s + causal), 3)
      q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(DTYPE) for kk in keys)
      flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
      # ~30 TFLOP per batch; the cap keeps a tiny CPU dry run (--tokens 128 --seqlens 64) short.
      calls = min(max(3, int(3e13 // (3.5 * flops))), 300)
      rows = {}
      for impl in [f"jax_sgl/{name}" for name in variants] + ["cudnn", "fa3", "xla"]:
        # XLA materializes float32 scores and probabilities [B, H, S, S] (and their gradients):
        # keep the pair under 20 GiB of the H200's 141.
        if impl == "xla" and (args.skip_xla or 2 * b * h * s * s * 4 > 20 << 30):
          rows[impl] = None
          continue
        deterministic = False
        if impl.startswith("jax_sgl/"):
          deterministic = set_bwd_variant(impl.split("/")[1], args.reference_bwd)
        if impl == "fa3" and (fa3.load() is None or not (fa3.serves("fwd", d) and
                                                          fa3.serves("bwd", d))):
          rows[impl] = None  # why: said once (missing package, or no kernel for d)
          continue
        if impl == "fa3":
          why = fa3_missing(q, k, v, causal)
          if why is not None:
            print(f"  (fa3 n/a at S={s} D{d} causal={causal}: {why})")
            rows[impl] = None
            continue
        fwd, fwd_bwd = attention_fns(impl, causal, deterministic, args.varlen)
        t_all = try_time(fwd_bwd, (q, k, v), calls, args.batches)
        t_fwd = try_time(fwd, (q, k, v), calls, args.batches) if t_all else None
        rows[impl] = (t_all, t_fwd) if t_all else None
      # A variant that failed (printed above) leaves the ratios to the next one that ran.
      ran = [name for name in variants if rows[f"jax_sgl/{name}"]]
      if not ran:
        print(f"SUMMARY attention fwd+bwd S={s // 1024}k H{h} D{d} causal={causal}: "
              "jax_sgl FAILED")
        continue
      shown = primary if primary in ran else ran[0]
      ours = rows[f"jax_sgl/{shown}"][0]
      for impl, r in rows.items():
        if r is None:
          print(f"{s:>6} {str(causal):>6} {impl:<14} {'n/a':>10}")
          continue
        t_all, t_fwd = r
        bwd = 2.5 * flops / (t_all - t_fwd) / 1e12 if t_fwd and t_all > t_fwd else float("nan")
        print(f"{s:>6} {str(causal):>6} {impl:<14} {t_all * 1e3:10.2f} "
              f"{3.5 * flops / t_all / 1e12:8.0f} {bwd:8.0f} {t_all / ours:9.2f}x")
      errs = {}
      for name in ran:
        deterministic = set_bwd_variant(name, args.reference_bwd)
        try:
          errs[name] = check_close(q, k, v, causal, deterministic, varlen=args.varlen)
        except Exception as e:  # report, keep benchmarking the other cases
          print(f"  ({name} check: {type(e).__name__}: {str(e).splitlines()[0][:100]})")
          errs[name] = None
        print(f"       {name}: max |dq,dk,dv - anchor| / max |anchor| = "
              f"{errs[name] if errs[name] is not None else '-'}")
      err = errs[shown]
      others = "".join(f", {name} {3.5 * flops / rows[f'jax_sgl/{name}'][0] / 1e12:.0f}"
                       for name in ran if name != shown)
      anchor = lambda impl: (f"{3.5 * flops / rows[impl][0] / 1e12:.0f} "
                             f"({rows[impl][0] / ours:.2f}x)" if rows[impl] else "n/a")
      print(f"SUMMARY attention fwd+bwd{' varlen' if args.varlen else ''} S={s // 1024}k H{h} "
            f"D{d} causal={causal}: {3.5 * flops / ours / 1e12:.0f} TFLOP/s ({shown} bwd{others}), "
            f"cudnn {anchor('cudnn')}, fa3 {anchor('fa3')}, xla {anchor('xla')}; "
            f"rel err vs anchor {err if err is not None else float('nan'):.1e}")
      del q, k, v


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192])
  parser.add_argument("--tokens", type=int, default=32768, help="B*S")
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dims", "--head-dim", dest="head_dims", type=int, nargs="+",
                      default=[128], help="issue 27's FA3 comparison: 64 128 256")
  parser.add_argument("--batches", type=int, default=5)
  parser.add_argument("--reference-bwd", action="store_true",
                      help="time jax_sgl with the reference backward lowering instead")
  parser.add_argument("--bwd", nargs="+", choices=sorted(BWD_VARIANTS),
                      default=["sm80", "sm90", "sm90det"],
                      help="CUDA backward variants to time (sm90 ones only where available)")
  parser.add_argument("--skip-xla", action="store_true", help="leave out the XLA anchor")
  parser.add_argument("--varlen", action="store_true",
                      help="jax_sgl over the batch packed with cu_seqlens (anchors stay dense)")
  args = parser.parse_args()
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print(f"jax_sgl attention backend: {jax_sgl.attention_backend_info()}, "
        f"reference backward: {args.reference_bwd}")
  fa3.load()
  for d in args.head_dims:
    bench_head_dim(d, args)


if __name__ == "__main__":
  main()
