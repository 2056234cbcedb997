#!/usr/bin/env bash
# Download the wheels of benchmarks/requirements-gpu.txt (Python 3.12, linux x86_64) into DIR, for a
# CUDA machine without internet, and build the three sdist-only ones when a python3.12 is here.
# Usage: bash benchmarks/gpu_wheels.sh DIR
# Then, on the CUDA machine: python3 -m pip install --no-index --no-deps --no-compile --target SITE DIR/*.whl
#                            export PYTHONPATH=SITE:src
set -euo pipefail
dir=${1:?usage: gpu_wheels.sh DIR}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dir"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -r "$here/requirements-gpu.txt" -d "$dir"
# a python3.12 that runs: PYTHON312, else the one on the PATH, else one that pyenv installed (whose shim
# on the PATH refuses to run while another version is selected)
py312=""
for candidate in ${PYTHON312:-} $(command -v python3.12 || true) "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
  if [ -x "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    py312=$candidate && break
  fi
done
if [ -n "$py312" ]; then
  "$py312" -m pip wheel --no-deps cellpylib==2.4.0 zss==1.2.0 pycosat==0.6.6 -w "$dir"
else
  echo "no python3.12 here (set PYTHON312=...): build cellpylib==2.4.0 zss==1.2.0 pycosat==0.6.6 wheels with one" >&2
fi
ls -l "$dir"
