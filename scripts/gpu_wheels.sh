#!/usr/bin/env bash
# Fetch what scripts/gpu_check.sh needs on a GPU machine that has no network: MPICH and mpi4py
# as wheels for its Python (3.12, x86-64) into .whl/ (ignored by git; ~15 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl "mpich==${MPICH_VERSION:-5.0.2}" "mpi4py==${MPI4PY_VERSION:-4.1.2}"
ls -la .whl
