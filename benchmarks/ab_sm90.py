"""A/B of the sm_90a flash forward's variants (ffi/cuda/attention/sm90/fwd/tile_size.h) against cuDNN,
all in one process on one H200: bf16, S = 8k (--seqlens), B*S = 32k tokens, hd64 / hd128 / hd256
with 16/16 heads and hd128 with GQA 32/8, causal and not.

Each variant runs through the same jitted jax_sgl.attention call; JAX_SGL_SM90_VARIANT (read by
the CUDA handler at every call) picks it; the 'default' row runs with it unset (the build's
default variant of the (head dim, causal): CMake JAX_SGL_SM90_DEFAULT_VARIANTS). The
implementations are interleaved: every round times one batch of back-to-back calls of each, in
turn (after an untimed batch of the same: timing.batch_seconds' settle), so drifting clocks hit
all alike; a result is the median over the rounds. TFLOP/s counts 4*B*H*S^2*D, halved when
causal (as bench_attention.py).
Prints one line per (config, implementation) and one 'SUMMARY ' line per config with the best
variant and its ratio to cuDNN (tools/gpu_check.sh collects those).

Run from outside the source tree (so `import jax_sgl` is the installed package):
  python3 /path/to/benchmarks/ab_sm90.py [--rounds 7] [--variants 0 1 4 5] [--dynamic]
      [--tail-split]
(--dynamic adds a '<row> dyn' row per jax_sgl row: JAX_SGL_SM90_DYNAMIC_TILES=1, persistent
CTAs then take non-causal tiles from the counter as well; --tail-split a '<row> notail' row:
JAX_SGL_SM90_TAIL_SPLIT=0, without the default tail split; both together also a
'<row> dyn+notail' row.)
"""

from __future__ import annotations

import argparse
import os
import statistics

import jax
import jax.numpy as jnp

import jax_sgl
from timing import batch_seconds

TOKENS = 32768
SEQLEN = 8192
# (head_dim, num_heads, num_kv_heads)
CONFIGS = ((128, 16, 16), (128, 32, 8), (64, 16, 16), (256, 16, 16))


# The jax_sgl switches the rows set (each row clears the others first).
KNOBS = ("JAX_SGL_SM90_VARIANT", "JAX_SGL_SM90_DYNAMIC_TILES", "JAX_SGL_SM90_TAIL_SPLIT")


def built_variants(head_dim):
  """The variants this build compiled for (head_dim, bf16)."""
  prefix = f"hdim{head_dim}_bf16_variant"
  kernels = jax_sgl.attention_backend_info()["sm90_kernels"]
  return sorted(int(k[len(prefix):]) for k in kernels if k.startswith(prefix))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=7, help="batches per implementation (median)")
  parser.add_argument("--variants", type=int, nargs="+",
                      help="default: every variant built for the head dim")
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
  parser.add_argument("--seqlens", type=int, nargs="+", default=[SEQLEN],
                      help="B*S stays --tokens")
  parser.add_argument("--tokens", type=int, default=TOKENS,
                      help="B*S (default 32k); e.g. --tokens 512 --seqlens 512: one short "
                           "prefill, where the tail split is split-KV")
  parser.add_argument("--dynamic", action="store_true",
                      help="also time every row with JAX_SGL_SM90_DYNAMIC_TILES=1")
  parser.add_argument("--tail-split", action="store_true",
                      help="also time every row with JAX_SGL_SM90_TAIL_SPLIT=0 (no tail split)")
  args = parser.parse_args()
  os.environ["JAX_SGL_SM90"] = "1"
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print(f"jax_sgl attention backend: {jax_sgl.attention_backend_info()}")
  print(f"rounds: {args.rounds}")
  for (d, h, hkv), s in ((c, s) for s in args.seqlens for c in CONFIGS):
    if d not in args.head_dims:
      continue
    b = max(1, args.tokens // s)
    keys = jax.random.split(jax.random.PRNGKey(d + h), 3)
    rand = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
    q = rand(keys[0], (b, s, h, d))
    k, v = rand(keys[1], (b, s, hkv, d)), rand(keys[2], (b, s, hkv, d))
    for causal in (False, True):
      flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
      calls = max(3, int(1e13 // flops))
      ours = jax.jit(lambda q, k, v, c=causal: jax_sgl.attention(q, k, v, causal=c))
      cudnn = jax.jit(lambda q, k, v, c=causal: jax.nn.dot_product_attention(
          q, k, v, is_causal=c, implementation="cudnn"))
      variants = [x for x in built_variants(d) if args.variants is None or x in args.variants]
      # (name, fn, environment of the jax_sgl knobs; None: an anchor)
      impls = ([("cudnn", cudnn, None), ("default", ours, {})] +
               [(f"variant{x}", ours, {"JAX_SGL_SM90_VARIANT": str(x)}) for x in variants])
      # The same kernels with the scheduler knobs: non-causal tiles from the counter too (dyn),
      # the last partial wave not split into key shares (notail; the split is the default), both.
      knobs = []
      if args.dynamic:
        knobs.append(("dyn", {"JAX_SGL_SM90_DYNAMIC_TILES": "1"}))
      if args.tail_split:
        knobs.append(("notail", {"JAX_SGL_SM90_TAIL_SPLIT": "0"}))
      if len(knobs) == 2:
        knobs.append(("dyn+notail", {**knobs[0][1], **knobs[1][1]}))
      impls += [(f"{name} {tag}", fn, {**env, **extra}) for tag, extra in knobs
                for name, fn, env in impls if env is not None]
      label = f"D{d} H{h}/{hkv} S={s} causal={causal}"
      times = {name: [] for name, _, _ in impls}
      for _ in range(args.rounds):
        for name, fn, env in impls:
          if env is not None:
            for knob in KNOBS:
              os.environ.pop(knob, None)
            os.environ.update(env)
          try:
            times[name].append(batch_seconds(fn, (q, k, v), calls, settle=calls,
                                             trace=f"{label} | {name}"))
          except Exception as e:  # cuDNN may not take the case; report and go on
            print(f"  ({name}: {type(e).__name__}: {str(e).splitlines()[0][:100]})")
            times[name].append(float("nan"))
      tflops = {name: flops / statistics.median(t) / 1e12 for name, t in times.items()}
      base = tflops["cudnn"]
      for name, value in tflops.items():
        spread = (max(times[name]) - min(times[name])) / statistics.median(times[name])
        # Per round, this implementation against the cuDNN batch timed just before it: drift
        # between rounds cancels in each ratio, so their range says how firm the ratio is.
        paired = sorted(c / t for c, t in zip(times["cudnn"], times[name]))
        print(f"{label:<32} {name:<18} {value:7.1f} TFLOP/s  {value / base:5.3f}x cudnn  "
              f"(spread {100 * spread:4.1f}%; per round {statistics.median(paired):5.3f}x, "
              f"{paired[0]:5.3f}-{paired[-1]:5.3f})")
      # The best named variant, or the default when only it ran (e.g. --variants 0 on a build
      # without variant 0's extra instantiation).
      best = max((n for n in tflops if n not in ("cudnn", "default")), key=lambda n: tflops[n],
                 default="default")
      print(f"SUMMARY sm90 A/B {label}: best {best} {tflops[best]:.0f} TFLOP/s = "
            f"{tflops[best] / base:.3f}x cudnn {base:.0f}; "
            + ", ".join(f"{n} {tflops[n] / base:.3f}x" for n in tflops if n != "cudnn"))
  for knob in KNOBS:
    os.environ.pop(knob, None)


if __name__ == "__main__":
  main()
