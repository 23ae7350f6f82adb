"""Times jax_sgl's default kernel paths alone, one SUMMARY line each, for regression checks of one
build against another (tools/bench_vs_baseline.py runs it under both). Not a benchmark: it has
no anchors (benchmarks/bench_attention*.py compare against cuDNN and XLA); it touches only the
public API that every build since the first has, so any two builds can be compared.

Paths: the Hopper forward at head dims 64 / 128 / 256 (B*S = 32k, S = 4k, 16 heads, bf16,
causal and not); paged decode (B = 64, 32 / 8 heads, D = 128, pages of 16, KV 4k and 32k);
forward + backward at hd128 (S = 4k and 8k, causal and not).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from timing import median_seconds  # noqa: E402

import jax_sgl  # noqa: E402


def normal(key, shape, dtype=jnp.bfloat16):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def prefill(batches):
  for d in (64, 128, 256):
    b, s, h = 32768 // 4096, 4096, 16
    q, k, v = (normal(jax.random.PRNGKey(i), (b, s, h, d)) for i in range(3))
    for causal in (False, True):
      fn = jax.jit(lambda q, k, v, c=causal: jax_sgl.attention(q, k, v, causal=c))
      t = median_seconds(fn, (q, k, v), 10, batches)
      flops = 4 * b * h * s * s * d / (2 if causal else 1)
      print(f"SUMMARY prefill D{d} S{s} causal={causal}: {flops / t / 1e12:.1f} TFLOP/s")


def decode(batches):
  b, h, hkv, d, page = 64, 32, 8, 128, 16
  for kv in (4096, 32768):
    pages = b * kv // page
    k_pool, v_pool = (normal(jax.random.PRNGKey(i), (pages, page, hkv, d)) for i in (3, 4))
    perm = np.random.default_rng(0).permutation(pages).astype(np.int32)
    page_table = jnp.asarray(perm.reshape(b, kv // page))
    seqused_k = jnp.full((b,), kv, jnp.int32)
    q = normal(jax.random.PRNGKey(5), (b, 1, h, d))
    fn = jax.jit(lambda q, k, v, pt, sk: jax_sgl.attention(q, k, v, page_table=pt, seqused_k=sk,
                                                           causal=True))
    t = median_seconds(fn, (q, k_pool, v_pool, page_table, seqused_k), 20, batches)
    print(f"SUMMARY decode KV{kv}: {2 * b * kv * hkv * d * 2 / t / 1e9:.0f} GB/s")


def forward_backward(batches):
  h, d = 16, 128
  for s in (4096, 8192):
    b = 32768 // s
    q, k, v = (normal(jax.random.PRNGKey(i), (b, s, h, d)) for i in range(3))
    for causal in (False, True):
      loss = lambda q, k, v, c=causal: jnp.sum(
          jax_sgl.attention(q, k, v, causal=c).astype(jnp.float32))
      fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      t = median_seconds(fn, (q, k, v), 5, batches)
      flops = 3.5 * 4 * b * h * s * s * d / (2 if causal else 1)
      print(f"SUMMARY fwd+bwd D{d} S{s} causal={causal}: {flops / t / 1e12:.1f} TFLOP/s")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, default=3)
  parser.add_argument("--paths", nargs="+", default=["prefill", "decode", "fwdbwd"],
                      choices=["prefill", "decode", "fwdbwd"])
  args = parser.parse_args()
  print(f"jax_sgl from {os.path.realpath(os.path.dirname(jax_sgl.__file__))}, "
        f"{jax.devices()[0].device_kind}")
  runs = {"prefill": prefill, "decode": decode, "fwdbwd": forward_backward}
  for path in args.paths:
    runs[path](args.batches)


if __name__ == "__main__":
  main()
