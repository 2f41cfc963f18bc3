#!/usr/bin/env bash
# Build the shared teaching-lab environment: one venv that JupyterHub and every student run.
#   sudo scripts/lab-env.sh [PREFIX]      PREFIX defaults to $JUPYTER_RING_LAB or /opt/jupyter_ring-lab
#
# Why not the project's .venv: its Python may live under /root (mode 700), which no other Unix
# user can execute, nor a venv made from it. The lab venv is based on the system Python
# (/usr/bin/python3, or $LAB_PYTHON) and is world-readable, owned by root (students cannot change
# it). It holds jupyter_ring[mpich,lab,hub] (a wheel built from this checkout, not an editable
# install: students cannot read a developer's tree) with jupyterhub, jupyterlab and the MPICH
# wheel; torch (CPU, pinned: an unpinned torch pulls the CUDA build, GBs); configurable-http-proxy
# from npm in PREFIX/node. Re-running is quick: the build is keyed by a hash of the sources and this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX=${1:-${JUPYTER_RING_LAB:-/opt/jupyter_ring-lab}}
PY=${LAB_PYTHON:-/usr/bin/python3}
TORCH=${LAB_TORCH:-torch==2.13.0}
CHP=${LAB_CHP:-configurable-http-proxy@4.6.3}

mkdir -p "$(dirname "$PREFIX")"
exec 9>"$PREFIX.lock"                   # one build at a time (tests may run in parallel)
flock 9
key=$( { cat scripts/lab-env.sh scripts/installer.sh pyproject.toml; echo "$PY $TORCH $CHP";
         find jupyter_ring jupyter-config labextension/prebuilt labextension/install.json -type f \
           ! -name '*.pyc' -print0 2>/dev/null | LC_ALL=C sort -z | xargs -0 cat; } | sha256sum | cut -c1-16)
stamp="$PREFIX/.lab-env-key"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -x "$PREFIX/bin/jupyterhub" ] \
   && [ -x "$PREFIX/node/bin/configurable-http-proxy" ]; then
  echo "[lab-env] $PREFIX is up to date ($key)"
  exit 0
fi
if [ ! -f labextension/prebuilt/static/style.js ]; then
  echo "[lab-env] labextension/prebuilt is missing: run scripts/setup.sh first (it builds the lab extension)" >&2
  exit 1
fi
echo "[lab-env] building $PREFIX with $($PY --version) ($key)"
umask 022                               # everything readable and runnable by every student
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$PREFIX/bin/python" ] || "$PY" -m venv "$PREFIX"
source scripts/installer.sh  # install(): uv (the project's, from scripts/setup.sh) where it can be had, else pip
installer_init "$PREFIX/bin/python" "$PWD/.venv/bin/uv"
echo "[lab-env] installing with $installer"
install "$TORCH"
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
pip_quiet "$PREFIX/bin/python" wheel --no-deps -w "$wheels" .
install --force-reinstall --no-deps "$wheels"/jupyter_ring-*.whl
install "$(ls "$wheels"/jupyter_ring-*.whl)[mpich,lab,hub]"
if [ ! -x "$PREFIX/node/bin/configurable-http-proxy" ]; then
  echo "[lab-env] installing $CHP (npm) into $PREFIX/node"
  npm install -g --silent --prefix "$PREFIX/node" "$CHP" >/dev/null
fi
chmod -R a+rX "$PREFIX"
echo "$key" > "$stamp"
echo "[lab-env] done: $("$PREFIX/bin/python" -c 'import jupyter_ring, jupyterhub, torch, ipyparallel; print("jupyterhub", jupyterhub.__version__, "torch", torch.__version__, "ipyparallel", ipyparallel.__version__)')"
