"""Timing shared by the attention benchmarks: the median over batches of back-to-back calls,
wall clock around block_until_ready, after a warm-up call that compiles."""

from __future__ import annotations

import datetime
import os
import statistics
import time

import jax

# JAX_SGL_BENCH_TRACE=<file>: every batch timed with a `trace` name (the interleaved harnesses)
# appends its wall-clock start (settle included), the start of its timed calls, its end and that
# name there, in nvidia-smi's timestamp format, to line up with tools/gpu_check.sh's clock trace
# (GPU_CHECK_CLOCKS=1). A name "<config> | <implementation>" is summed per implementation by
# tools/clock_trace.py.
TRACE = os.environ.get("JAX_SGL_BENCH_TRACE")
# JAX_SGL_BENCH_SETTLE_S=<seconds>: the least time each settle phase lasts (batch_seconds);
# unset, a settle phase is one untimed batch.
SETTLE_SECONDS = float(os.environ.get("JAX_SGL_BENCH_SETTLE_S", "0"))


def _stamp(t):
  return datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def batch_seconds(fn, args, calls, settle=0, trace=None):
  """Seconds per call over one batch of `calls` back-to-back calls, after `settle` untimed calls
  of the same function. Settling matters when implementations alternate: the H200's clocks
  follow its power draw with a lag, so a batch that starts right after a low-power
  implementation (the portable kernel, XLA) runs its first milliseconds at clocks it would not
  hold on its own. Session 6 saw cuDNN 7-10% faster in bench_attention.py (after the portable
  kernel) than in an A/B harness (after other attention kernels), and ours slower. With
  JAX_SGL_BENCH_SETTLE_S set, the settle calls repeat until that many seconds have passed, so
  each timed batch runs in its own implementation's steady state. `trace`: the batch's name in
  JAX_SGL_BENCH_TRACE."""
  start = time.time()
  if settle:
    out = None
    while True:
      for _ in range(settle):
        out = fn(*args)
      jax.block_until_ready(out)
      if time.time() - start >= SETTLE_SECONDS:
        break
  timed = time.time()
  t0 = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  seconds = (time.perf_counter() - t0) / calls
  if TRACE and trace is not None:
    with open(TRACE, "a") as f:
      f.write(f"{_stamp(start)},{_stamp(timed)},{_stamp(time.time())},{trace}\n")
  return seconds


def median_seconds(fn, args, calls, batches):
  """Median seconds per call over `batches` back-to-back batches, the first after a settle phase
  (so none starts at the clocks of whatever ran before)."""
  jax.block_until_ready(fn(*args))  # warm-up (compile) outside the timings
  return statistics.median(batch_seconds(fn, args, calls, settle=calls if i == 0 else 0)
                           for i in range(batches))


def jit_with_disable(fn, disable):
  """fn jitted so that its first call lowers and compiles it with JAX_SGL_DISABLE=disable (jax_sgl
  reads the switch when a call is lowered), restoring the variable afterwards: one compiled
  function per kernel family, timed side by side in one process. A fresh wrapper per call: jax
  caches a function's lowering by its traced jaxpr, so a second jit of the same `fn` would reuse
  the first one's lowered call (and its disable attribute)."""
  jitted = jax.jit(lambda *args: fn(*args))
  compiled = []

  def call(*args):
    if not compiled:
      saved = os.environ.get("JAX_SGL_DISABLE")
      os.environ["JAX_SGL_DISABLE"] = disable
      try:
        compiled.append(jitted.lower(*args).compile())
      finally:
        if saved is None:
          os.environ.pop("JAX_SGL_DISABLE", None)
        else:
          os.environ["JAX_SGL_DISABLE"] = saved
    return compiled[0](*args)
  return call


def try_time(fn, args, calls, batches):
  """median_seconds, or None (with the reason printed) for an anchor that cannot run the case."""
  try:
    return median_seconds(fn, args, calls, batches)
  except Exception as e:  # an anchor that does not support the case (or runs out of memory)
    print(f"  ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
    return None


def interleaved_medians(runs, calls, batches):
  """Median seconds per call of each run in `runs` ({name: (fn, args, prepare)}), already warmed
  up, timed round-robin: batch i of every run comes before batch i+1 of any, so clock or thermal
  drift over the sweep lands on all runs alike and their ratios stay fair. Each timed batch
  follows an untimed one of the same run (batch_seconds' settle), so no run inherits the clocks
  of the one before it. `prepare` (or None) runs before each of its run's batches, outside the
  timing."""
  times = {name: [] for name in runs}
  for _ in range(batches):
    for name, (fn, args, prepare) in runs.items():
      if prepare is not None:
        prepare()
      times[name].append(batch_seconds(fn, args, calls, settle=calls, trace=name))
  return {name: statistics.median(t) for name, t in times.items()}
