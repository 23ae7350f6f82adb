#!/usr/bin/env bash
# Same-call comparison of several builds on the device machine: each build is an archive of
# tools/prebuild.sh (.prebuilt/NAME.tar.xz, carried with the call as ".prebuilt"), installed
# beside this tree's Python package into /tmp/site-NAME; the GPU tests then run against the
# builds named in AB_TESTS, and one benchmark command against each build in AB_ORDER, in that
# order (e.g. "main branch branch main": interleaved, as the benchmarks' anchors are). Run from
# the repository root; the FA3 anchor's wheels, if carried in .whl/, are installed into /tmp/site.
#
#   AB_TESTS    ';'-separated "NAME|pytest args" (paths under tests/ are taken from this tree),
#               e.g. "branch|tests/test_attention_sm90.py -n 8"
#   AB_ORDER    archive names, e.g. "main branch branch main"
#   AB_CMD      benchmark script and arguments, run once per name in AB_ORDER
#   AB_GREP     extended regex of the benchmark lines to print (default: SUMMARY lines and errors)
#   AB_TEST_TIMEOUT / AB_TIMEOUT  seconds per pytest / benchmark run (default 400 each)
#   AB_TAIL     lines of each pytest run's output to print (default 6)
#
# Tests run with XLA_PYTHON_CLIENT_PREALLOCATE=false: pytest -n workers each preallocating 75% of
# the GPU fail their first large call. Benchmarks keep JAX's preallocated pool, as
# tools/gpu_check.sh runs them.
set -uo pipefail
REPO="$(pwd)"
PY="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export JAX_SGL_BENCH_SETTLE_S="${JAX_SGL_BENCH_SETTLE_S:-0.5}" PYTHONUNBUFFERED=1

site_of() {  # the install of archive $1, made on first use
  local site=/tmp/site-$1
  if [[ ! -d $site ]]; then
    PYTHON="$PY" bash "$REPO/tools/install_prebuilt.sh" "$REPO/.prebuilt/$1.tar.xz" "$site" \
      || return 1
  fi
  echo "$site"
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
IFS=';' read -ra tests <<< "${AB_TESTS:-}"
for t in "${tests[@]}"; do
  name="${t%%|*}"
  read -ra args <<< "${t#*|}"
  for i in "${!args[@]}"; do
    [[ ${args[i]} == tests/* ]] && args[i]="$REPO/${args[i]}"
  done
  site=$(site_of "$name") || { echo "no archive .prebuilt/$name.tar.xz"; continue; }
  echo "== tests $name (PREBUILT: $(paste -sd';' "$site/jax_sgl/PREBUILT")): ${t#*|}"
  (cd /tmp && XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$site:/tmp/site" \
     timeout "${AB_TEST_TIMEOUT:-400}" "$PY" -m pytest -q -p no:cacheprovider --rootdir "$REPO" \
     "${args[@]}" 2>&1 | tail -"${AB_TAIL:-6}")
done
if [[ -n "${AB_CMD:-}" ]]; then
  read -ra cmd <<< "$AB_CMD"
  for name in ${AB_ORDER:-}; do
    site=$(site_of "$name") || { echo "no archive .prebuilt/$name.tar.xz"; continue; }
    echo "== $name: $AB_CMD"
    (cd /tmp && PYTHONPATH="$site:/tmp/site" timeout "${AB_TIMEOUT:-400}" \
       "$PY" "$REPO/${cmd[0]}" "${cmd[@]:1}" 2>&1 | grep -E "${AB_GREP:-SUMMARY|Error|rror}")
  done
fi
