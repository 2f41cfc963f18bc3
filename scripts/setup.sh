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
# ---- JupyterLab extension (labextension/, owner: lab extension) -----------------------------
# The browser test drives Debian's chromium (Playwright's own download is not reachable in CI).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing chromium (apt) for the lab extension's browser test"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
      || echo "[setup] apt-get install chromium failed: the lab extension's browser test will be skipped"
  else
    echo "[setup] no chromium and not root: the lab extension's browser test will be skipped"
  fi
fi
# The multi-host tests (tests/multihost) run Debian's sshd in two network namespaces, as root.
if [ ! -x /usr/sbin/sshd ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing openssh-server (apt) for the multi-host tests"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssh-server openssh-client iproute2 >/dev/null; } \
      || echo "[setup] apt-get install openssh-server failed: the multi-host tests will be skipped"
  else
    echo "[setup] no sshd and not root: the multi-host tests will be skipped"
  fi
fi
# ... and Debian's Slurm (slurmctld, slurmd, munge) for tests/multihost/test_slurm.py.
if [ ! -x /usr/sbin/slurmctld ] || [ ! -x /usr/sbin/slurmd ] || [ ! -x /usr/sbin/munged ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing slurmctld, slurmd, munge (apt) for the Slurm multi-host test"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; } \
      || echo "[setup] apt-get install slurm failed: the Slurm multi-host test will be skipped"
  else
    echo "[setup] no Slurm and not root: the Slurm multi-host test will be skipped"
  fi
fi
# pip install builds the extension (hatch-jupyter-builder: jlpm install + build); when the venv is
# already there but the build or labextension/node_modules (jest) is missing, build it here.
# A build older than its sources (a pulled change to labextension/) is rebuilt too, and copied
# where the editable install put it (hatch copies shared-data once, at install time).
stale=""
if [ -f labextension/prebuilt/package.json ]; then
  stale=$(find labextension/src labextension/style labextension/package.json -newer labextension/prebuilt/package.json 2>/dev/null | head -1)
fi
if [ -x .venv/bin/jlpm ] && { [ ! -f labextension/prebuilt/static/style.js ] || [ ! -d labextension/node_modules ] || [ -n "$stale" ]; }; then
  echo "[setup] building the lab extension"
  (cd labextension && PATH="$PWD/../.venv/bin:$PATH" jlpm install >/dev/null && PATH="$PWD/../.venv/bin:$PATH" jlpm build:prod >/dev/null)
  installed=.venv/share/jupyter/labextensions/jupyter-ring
  if [ -d "$installed" ]; then
    rm -rf "$installed.new" && cp -r labextension/prebuilt "$installed.new" && cp labextension/install.json "$installed.new/" \
      && rm -rf "$installed" && mv "$installed.new" "$installed"
  fi
fi
# ---- end JupyterLab extension ----------------------------------------------------------------
# jupyter_ring's own modules compiled to bytecode (quick when they are): where Python does not
# write __pycache__ (PYTHONDONTWRITEBYTECODE=1, as on these hosts) every rank, engine and kernel
# compiled the package again at each import. A source changed later is compiled anew in memory.
.venv/bin/python -m compileall -q jupyter_ring >/dev/null || true
stamp=.venv/.jupyter_ring-installed
want=$(cat pyproject.toml scripts/setup.sh scripts/installer.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] .venv is up to date"
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
source scripts/installer.sh  # install(): uv where it can be had, else pip
installer_init .venv/bin/python
# torch first and pinned: an unpinned torch pulls the CUDA build (GBs). GPU users install
# 'jupyter_ring[torch]' with their own torch instead.
echo "[setup] installing torch==2.13.0 (CPU) with $installer"
install "torch==2.13.0"
echo "[setup] installing jupyter_ring[dev,torch,cupy] (editable)"
install -e ".[dev,torch,cupy]"
# Keras 2 (tf_keras, for TF_USE_LEGACY_KERAS=1: tests/mpi/keras2.py) at TensorFlow's own version,
# without its dependencies: it requires the package "tensorflow", which would install a second
# TensorFlow over tensorflow-cpu's files
tf_version=$(.venv/bin/python -c 'from importlib.metadata import version; print(version("tensorflow-cpu"))')
echo "[setup] installing tf_keras~=$tf_version (Keras 2, no dependencies)"
install --no-deps "tf_keras~=$tf_version"
echo "$want" > "$stamp"
echo "[setup] done: $(.venv/bin/python -c 'import mpi4py, ipyparallel, torch; print("mpi4py", mpi4py.__version__, "ipyparallel", ipyparallel.__version__, "torch", torch.__version__)')"
