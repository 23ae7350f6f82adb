#!/usr/bin/env bash
# Builds jax_sgl's native modules with Bazel and runs Python tests against them: the package's
# Python sources and the two Bazel-built modules are staged into one folder, which goes first on
# PYTHONPATH (the tests import jax_sgl, never the source tree). Arguments go to pytest (default:
# the whole suite, tests/). The build's Python is PYTHON (default python3); it needs jax, pytest,
# hypothesis and nanobind, and is Python 3.11 or newer (-P).
#
#   bash bazel/run_tests.sh                       # every test
#   bash bazel/run_tests.sh tests/test_attention.py -k causal
set -euo pipefail
cd "$(dirname "$0")"
PY="$(command -v "${PYTHON:-python3}")"

bazel build --repo_env=PYTHON_BIN_PATH="$PY" //:jax_sgl/_native.so //:jax_sgl/_metal_emu.so
bin="$(bazel info --repo_env=PYTHON_BIN_PATH="$PY" bazel-bin 2>/dev/null)"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
cp -r ../jax_sgl "$stage/"
cp "$bin/jax_sgl/_native.so" "$bin/jax_sgl/_metal_emu.so" "$stage/jax_sgl/"
cd ..
PYTHONPATH="$stage${PYTHONPATH:+:$PYTHONPATH}" "$PY" -P -c \
  "import jax_sgl, os; assert jax_sgl.__file__.startswith('$stage'), jax_sgl.__file__; print('bazel: jax_sgl from', os.path.dirname(jax_sgl.__file__), '| cpu targets', sorted(jax_sgl.CPU_TARGETS), '| cuda targets', sorted(jax_sgl.CUDA_TARGETS))"
# -P: the source tree (the working directory) must not shadow the staged package.
PYTHONPATH="$stage${PYTHONPATH:+:$PYTHONPATH}" "$PY" -P -m pytest -q -p no:cacheprovider "${@:-tests}"
