#!/usr/bin/env bash
# The GPU check of jax_sgl, run from the repository root on a machine with an NVIDIA GPU (the
# device machine: no network, so nothing is downloaded). Steps, each logged under $OUT:
#   1. build and install the package with the CUDA kernels (build.log);
#   2. pytest -m gpu over tests/ (pytest.log): every test marked `gpu` is picked up; those also
#      marked `bigmem` run afterwards on their own, without -n (pytest_bigmem.log);
#   3. every benchmarks/bench_*.py, or those in GPU_CHECK_BENCH (bench_<name>.log);
#   4. optionally compute-sanitizer memcheck over the test files in GPU_CHECK_SANITIZE
#      (sanitizer.log);
# then prints a short summary table last (also summary.txt): versions, build time, test and
# sanitizer results, and every line a benchmark printed starting with "SUMMARY ".
#
# Environment:
#   OUT                 log folder (default /tmp/gpu_check)
#   PYTHON              interpreter with jax + the CUDA plugin (default python3)
#   JAX_SGL_CUDA_ARCHS  archs to build (default 90a: one arch keeps the build quick)
#   GPU_CHECK_PIP_ARGS  extra pip args, e.g. -Ccmake.define.JAX_SGL_ATTN_HEAD_DIMS=128
#   GPU_CHECK_PREBUILT  an archive of tools/prebuild.sh (e.g. .prebuilt/hd128.tar.xz): step 1
#                       installs this tree's Python package with that extension instead of
#                       building (into a folder under /tmp, first on PYTHONPATH)
#   GPU_CHECK_TESTS     pytest paths / args (default: tests/); "none" skips the tests
#   GPU_CHECK_TESTS_TIMEOUT  seconds after which the tests stop and the rest of the check goes on;
#                       the summary then counts what ran (default 0: no limit)
#   JAX_SGL_TEST_SHARD  i/n: only the i-th of n fixed shards of the tests (tests/conftest.py); the
#                       whole suite (tests/ -n 16) runs as 1/2, 0/4 and 2/4 in three device calls
#                       (262, 200 and 92 s of tests on an H100, 2026-12-05; 0/2 alone took > 400)
#   GPU_CHECK_SANITIZE  test files to run under compute-sanitizer memcheck (default: none)
#   GPU_CHECK_SANITIZE_K  pytest -k expression for the sanitizer run (default: all)
#   GPU_CHECK_SANITIZE_TIMEOUT  seconds before the sanitizer run is stopped (default 900)
#   GPU_CHECK_BENCH     benchmark scripts to run (default: benchmarks/bench_*.py); "none" skips
#   GPU_CHECK_AB        ';'-separated benchmark commands with arguments, run after those, e.g.
#                       "benchmarks/bench_attention.py --help"
#                       (their SUMMARY lines join the table; logs ab1.log, ab2.log, ...)
#   GPU_CHECK_AB_TIMEOUT  seconds per GPU_CHECK_AB command (default 300)
#   GPU_CHECK_CLOCKS    1: sample SM clock and power every 50 ms during steps 3 and 3b
#                       (nvidia-smi queries only, no setting touched) into clocks.csv, with a
#                       "# <step> start" marker line before each benchmark; the interleaved
#                       harnesses then log each batch's start, end and implementation
#                       (batches.csv, benchmarks/timing.py JAX_SGL_BENCH_TRACE); the summary
#                       gets each implementation's clock during its timed batches
#                       (tools/clock_trace.py)
#   PYTHONPATH          e.g. /tmp/site with flash-attn3-jax installed: the benchmarks' FA3
#                       anchor (benchmarks/fa3.py; install line in benchmarks/RESULTS.md)
#   JAX_SGL_BENCH_SETTLE_S  least seconds of untimed calls before each timed batch (default 0.5
#                       here; 0: one untimed batch)
#
# The CUDA attention backward alone (benchmarks/notes/NOTES_bwd.md):
#   GPU_CHECK_TESTS=tests/test_attention_grad_gpu.py GPU_CHECK_BENCH=benchmarks/bench_attention_bwd.py \
#     bash tools/gpu_check.sh
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-/tmp/gpu_check}"
PY="${PYTHON:-python3}"
export JAX_SGL_CUDA_ARCHS="${JAX_SGL_CUDA_ARCHS:-90a}"
export PYTHONUNBUFFERED=1
# Steady-state timing: each timed benchmark batch follows at least this many seconds of the same
# implementation (benchmarks/timing.py). Sustained, the H200 runs attention at its power cap;
# short batches after a lighter phase get boost clocks first (benchmarks/notes/NOTES_sm90.md, session 7).
export JAX_SGL_BENCH_SETTLE_S="${JAX_SGL_BENCH_SETTLE_S:-0.5}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
row() { printf '%-12s %s\n' "$1" "$2" >> "$SUMMARY"; }

cd "$REPO"
row device "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
row software "$("$PY" -c 'import sys, jax, jaxlib; print(f"python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}")' 2>&1 | tail -1), nvcc $(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')"

# 1. Build + install (incremental in build/gpu when the machine is still warm), or a prebuilt
# extension (GPU_CHECK_PREBUILT). The CMake cache goes first: a -Ccmake.define of an earlier call
# (e.g. JAX_SGL_ATTN_HEAD_DIMS=128) would otherwise stay in force for this one; the object files
# stay, so unchanged sources still skip.
t0=$(date +%s)
build_failed() {
  row build "FAILED $1: see build.log"
  tail -40 "$OUT/build.log"
  cat "$SUMMARY"
  exit 1
}
if [[ -n "${GPU_CHECK_PREBUILT:-}" ]]; then
  # Outside $OUT: the device tool returns a limited number of files from $OUT, and the package's
  # files took the places of the logs (pytest.log came back missing).
  site="$(mktemp -d /tmp/gpu_check_site.XXXXXX)"
  PYTHON="$PY" bash tools/install_prebuilt.sh "$GPU_CHECK_PREBUILT" "$site" > "$OUT/build.log" 2>&1 \
    || build_failed "unpacking $GPU_CHECK_PREBUILT"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  row build "prebuilt $GPU_CHECK_PREBUILT: $(paste -sd';' "$site/jax_sgl/PREBUILT")"
else
  rm -f build/gpu/CMakeCache.txt
  # shellcheck disable=SC2086
  "$PY" -m pip install --no-build-isolation --no-deps -v -Cbuild-dir=build/gpu \
    ${GPU_CHECK_PIP_ARGS:-} . > "$OUT/build.log" 2>&1 \
    || build_failed "after $(( $(date +%s) - t0 )) s"
  row build "ok in $(( $(date +%s) - t0 )) s (archs $JAX_SGL_CUDA_ARCHS)"
fi

# Run Python from outside the source tree so `import jax_sgl` is the installed package.
cd /tmp
"$PY" -c 'import jax_sgl; print("CUDA targets:", sorted(jax_sgl.CUDA_TARGETS))' >> "$OUT/build.log" 2>&1
row targets "$(tail -1 "$OUT/build.log")"

# 2. GPU tests ("none" skips them).
if [[ "${GPU_CHECK_TESTS:-}" != none ]]; then
  read -r -a tests <<< "${GPU_CHECK_TESTS:-tests/}"
  tests=("${tests[@]/#tests/$REPO/tests}")
  # Failures are written as they happen (tests/conftest.py), so a run cut short still names them.
  export JAX_SGL_FAILED_LOG="$OUT/failed.txt"
  : > "$JAX_SGL_FAILED_LOG"
  # A test running over 90 s prints every thread's stack (faulthandler_timeout; it goes on), so a
  # run cut by the timeout names what it was waiting on (session 24: 6 tests of three grad files
  # still running at 220 s and at 265 s, unnamed).
  # Without preallocation: XLA's default (75% of the GPU per process) starves parallel workers
  # (pytest -n), which then fail or see no GPU.
  limit=()
  [[ "${GPU_CHECK_TESTS_TIMEOUT:-0}" != 0 ]] && limit=(timeout "$GPU_CHECK_TESTS_TIMEOUT")
  XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}" "${limit[@]}" \
    "$PY" -m pytest -m "gpu and not bigmem" -q -rfEs --durations=25 -p no:cacheprovider --rootdir "$REPO" \
      -o faulthandler_timeout=90 "${tests[@]}" > "$OUT/pytest.log" 2>&1
  if [[ $? == 124 ]]; then
    # Cut by GPU_CHECK_TESTS_TIMEOUT: what ran, from pytest's progress lines (. s F E x X).
    # The last line, cut mid-way, has no percentage; faulthandler's "Timeout (0:01:30)!" may
    # continue a progress line (session 25: an F before it went uncounted).
    progress="$(sed -E 's/Timeout \([0-9:]+\)!.*//' "$OUT/pytest.log" |
      grep -E '^[.sFExX]+( *\[ *[0-9]+%\])?$' | sed 's/ *\[.*//' | tr -d '\n')"
    row tests "stopped after $GPU_CHECK_TESTS_TIMEOUT s at $(grep -oE '[0-9]+%' "$OUT/pytest.log" | tail -1): $(tr -cd . <<< "$progress" | wc -c) passed, $(tr -cd F <<< "$progress" | wc -c) failed, $(tr -cd E <<< "$progress" | wc -c) errors, $(tr -cd s <<< "$progress" | wc -c) skipped"
  else
    row tests "$(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/pytest.log" | tail -1)"
  fi
  # Tests that need most of the GPU's memory run after the rest, one at a time (no -n): beside
  # parallel workers they make the others run out of memory.
  alone=()
  for ((i = 0; i < ${#tests[@]}; i++)); do
    if [[ "${tests[i]}" == -n ]]; then ((i++)); continue; fi
    alone+=("${tests[i]}")
  done
  "$PY" -m pytest -m "gpu and bigmem" -q -rfEs -p no:cacheprovider --rootdir "$REPO" \
    "${alone[@]}" > "$OUT/pytest_bigmem.log" 2>&1
  row bigmem "$(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/pytest_bigmem.log" | tail -1)"
  if [[ -s "$JAX_SGL_FAILED_LOG" ]]; then
    row failed "$(wc -l < "$JAX_SGL_FAILED_LOG") (failed.txt); first: $(head -1 "$JAX_SGL_FAILED_LOG" | cut -c1-200)"
  fi
fi

# Clock / power trace of the benchmarks (GPU_CHECK_CLOCKS=1): do the benchmark ratios move with
# the clocks each implementation inherits from the one timed before it (RESULTS.md, session 6)?
CLOCKS="$OUT/clocks.csv"
mark() {
  if [[ "${GPU_CHECK_CLOCKS:-0}" == 1 ]]; then
    echo "# $1 start $(date '+%Y/%m/%d %H:%M:%S.%3N')" >> "$CLOCKS"
  fi
}
if [[ "${GPU_CHECK_CLOCKS:-0}" == 1 ]]; then
  # The instantaneous power and the active clock-event reasons (a bit mask: 0x4 software power
  # cap, 0x8 hardware slowdown, ...) where the driver knows them, else the basic fields.
  fields=timestamp,clocks.sm,power.draw,temperature.gpu
  extra=power.draw.instant,clocks_event_reasons.active
  if nvidia-smi --query-gpu="$fields,$extra" --format=csv,noheader > /dev/null 2>&1; then
    fields="$fields,$extra"
  fi
  echo "# fields $fields" >> "$CLOCKS"
  nvidia-smi --query-gpu="$fields" --format=csv,noheader -lms 50 >> "$CLOCKS" 2>&1 &
  clocks_pid=$!
  export JAX_SGL_BENCH_TRACE="$OUT/batches.csv"
  trap 'kill "$clocks_pid" 2>/dev/null' EXIT
fi

# 3. Benchmarks, with XLA's default memory preallocation (the tests may run without it, for
# their parallel workers).
if [[ "${GPU_CHECK_BENCH:-}" != none ]]; then
  if [[ -n "${GPU_CHECK_BENCH:-}" ]]; then
    read -r -a benches <<< "$GPU_CHECK_BENCH"
  else
    mapfile -t benches < <(cd "$REPO" && ls benchmarks/bench_*.py 2>/dev/null)
  fi
  for b in "${benches[@]}"; do
    name="$(basename "$b" .py)"
    mark "$name"
    if env -u XLA_PYTHON_CLIENT_PREALLOCATE "$PY" "$REPO/$b" > "$OUT/$name.log" 2>&1; then
      grep -h '^SUMMARY ' "$OUT/$name.log" | sed 's/^SUMMARY /  /' | while read -r line; do
        row "$name" "$line"; done
    else
      row "$name" "FAILED: $(tail -1 "$OUT/$name.log")"
    fi
  done
fi

# 3b. A/B runs with arguments.
if [[ -n "${GPU_CHECK_AB:-}" ]]; then
  IFS=';' read -r -a abs <<< "$GPU_CHECK_AB"
  i=0
  for cmd in "${abs[@]}"; do
    read -r -a words <<< "$cmd"
    [[ ${#words[@]} -eq 0 ]] && continue
    i=$((i + 1))
    name="$(basename "${words[0]}" .py)"
    mark "ab$i $name"
    if env -u XLA_PYTHON_CLIENT_PREALLOCATE timeout "${GPU_CHECK_AB_TIMEOUT:-300}" \
        "$PY" "$REPO/${words[0]}" "${words[@]:1}" \
        > "$OUT/ab$i.log" 2>&1; then
      grep -h '^SUMMARY ' "$OUT/ab$i.log" | sed 's/^SUMMARY /  /' | while read -r line; do
        row "$name" "$line"; done
    else
      row "$name" "FAILED or timed out: $(tail -1 "$OUT/ab$i.log")"
    fi
  done
fi

# 4. compute-sanitizer memcheck. XLA's preallocated arena would hide out-of-bounds accesses
# inside it: allocate every buffer on its own.
if [[ -n "${GPU_CHECK_SANITIZE:-}" ]]; then
  read -r -a san <<< "$GPU_CHECK_SANITIZE"
  san=("${san[@]/#/$REPO/}")
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
    timeout "${GPU_CHECK_SANITIZE_TIMEOUT:-900}" compute-sanitizer --tool memcheck --error-exitcode 99 \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider --rootdir "$REPO" \
    ${GPU_CHECK_SANITIZE_K:+-k "$GPU_CHECK_SANITIZE_K"} "${san[@]}" > "$OUT/sanitizer.log" 2>&1
  rc=$?
  row sanitizer "exit $rc; $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1); $(grep -E '(passed|failed)' "$OUT/sanitizer.log" | tail -1)"
fi

# The clocks each implementation ran its timed batches at (tools/clock_trace.py).
if [[ "${GPU_CHECK_CLOCKS:-0}" == 1 && -s "$OUT/batches.csv" ]]; then
  "$PY" "$REPO/tools/clock_trace.py" "$OUT" > "$OUT/clock_trace.log" 2>&1
  grep -h '^SUMMARY ' "$OUT/clock_trace.log" | sed 's/^SUMMARY clocks //' | while read -r line; do
    row clocks "$line"; done
fi

echo
echo "== jax_sgl gpu_check summary ($(date -u +%F)) =="
cat "$SUMMARY"
