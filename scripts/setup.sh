#!/usr/bin/env bash
# Create .venv and install jupyter_ring with everything its demo and tests need.
# Idempotent: re-running after a change to pyproject.toml re-installs; otherwise it is quick.
#   scripts/setup.sh          core + MPICH + test tools + JupyterLab + torch (CPU) + TensorFlow (CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=.venv/.jupyter_ring-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] .venv is up to date"
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch pulls the CUDA build (GBs). GPU users install
# 'jupyter_ring[torch]' with their own torch instead.
echo "[setup] installing torch==2.13.0 (CPU)"
.venv/bin/python -m pip install -q "torch==2.13.0"
echo "[setup] installing jupyter_ring[dev,torch,cupy] (editable)"
.venv/bin/python -m pip install -q -e ".[dev,torch,cupy]"
echo "$want" > "$stamp"
echo "[setup] done: $(.venv/bin/python -c 'import mpi4py, ipyparallel, torch; print("mpi4py", mpi4py.__version__, "ipyparallel", ipyparallel.__version__, "torch", torch.__version__)')"
