"""Timing shared by the attention benchmarks: the median over batches of back-to-back calls,
wall clock around block_until_ready, after a warm-up call that compiles."""

from __future__ import annotations

import statistics
import time

import jax


def median_seconds(fn, args, calls, batches):
  out = jax.block_until_ready(fn(*args))  # warm-up (compile) outside the timings
  times = []
  for _ in range(batches):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / calls)
  return statistics.median(times)


def try_time(fn, args, calls, batches):
  """median_seconds, or None (with the reason printed) for an anchor that cannot run the case."""
  try:
    return median_seconds(fn, args, calls, batches)
  except Exception as e:  # an anchor that does not support the case (or runs out of memory)
    print(f"  ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
    return None
