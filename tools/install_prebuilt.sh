#!/usr/bin/env bash
# Installs an archive of tools/prebuild.sh beside this tree's Python package: SITE/jax_sgl then
# holds the package's Python files, the archive's extension modules and its PREBUILT note, and
# PYTHONPATH=SITE imports it. The one install step of tools/gpu_check.sh (GPU_CHECK_PREBUILT)
# and tools/ab_archives.sh.
#
#   tools/install_prebuilt.sh ARCHIVE SITE      (PYTHON unpacks it: tarfile reads .tar.xz)
set -euo pipefail
if [[ $# -ne 2 ]]; then
  sed -n '2,7p' "$0"
  exit 2
fi
REPO="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$2"
cp -r "$REPO/jax_sgl" "$2/"
"${PYTHON:-python3}" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
  "$1" "$2/jax_sgl"
