#!/usr/bin/env bash
# Builds the jax_sgl extension on this machine (nvcc and CuTe, no GPU) and packs it for the GPU
# check (tools/gpu_check.sh with GPU_CHECK_PREBUILT=.prebuilt/NAME.tar.xz), so that the device's
# minutes go to tests and benchmarks, not to nvcc: the device's builds took 2-7 minutes of its 30
# a session, and a build of main and of a branch (or of two tile constants) for a same-run
# comparison twice that. Carry the archive with the call (carry [".prebuilt"]; ignored by git).
# tools/ab_archives.sh runs tests and a benchmark against several archives in one device call.
#
#   tools/prebuild.sh NAME [pip args...]
#   e.g. tools/prebuild.sh hd128 -Ccmake.define.JAX_SGL_ATTN_HEAD_DIMS=128 \
#          -Ccmake.define.JAX_SGL_SM90_HEAD_DIMS=128 '-Ccmake.define.JAX_SGL_SM90_DTYPES=bf16;e4m3'
#
# Environment: PYTHON (its version must be the device's: 3.12), JAX_SGL_CUDA_ARCHS (default 90a),
# JAX_SGL_CUTLASS_INCLUDE_DIR, PREBUILD_DIR (the CMake build folder, kept for incremental
# rebuilds; default build/prebuild-NAME). The archive holds the extension modules and PREBUILT
# (the commit, dirty or not, the Python version and the build arguments), which gpu_check.sh
# prints in its summary.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  sed -n '2,17p' "$0"
  exit 2
fi
name="$1"
shift
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
export JAX_SGL_CUDA_ARCHS="${JAX_SGL_CUDA_ARCHS:-90a}"
cd "$REPO"
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
"$PY" -m pip install -q --no-deps --no-build-isolation --target "$site" \
  -Cbuild-dir="${PREBUILD_DIR:-build/prebuild-$name}" "$@" .
dirty=""
git diff --quiet HEAD -- ffi metal jax_sgl cmake CMakeLists.txt pyproject.toml || dirty=" (uncommitted changes)"
{
  echo "commit $(git rev-parse --short HEAD)$dirty"
  echo "python $("$PY" -c 'import sys; print(*sys.version_info[:2], sep=".")')"
  echo "JAX_SGL_CUDA ${JAX_SGL_CUDA:-auto}, archs $JAX_SGL_CUDA_ARCHS; pip args: $*"
} > "$site/jax_sgl/PREBUILT"
mkdir -p .prebuilt
(cd "$site/jax_sgl" && tar -cJf "$REPO/.prebuilt/$name.tar.xz" PREBUILT ./*.so)
echo "$REPO/.prebuilt/$name.tar.xz ($(du -h ".prebuilt/$name.tar.xz" | cut -f1)):"
cat "$site/jax_sgl/PREBUILT"
