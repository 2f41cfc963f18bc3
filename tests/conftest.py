"""Shared fixtures: an isolated home for Jupyter/IPython, and a runner for real mpiexec jobs."""

import os
import re
import subprocess
import sys
import tempfile

import pytest

from jupyter_ring.launch import find_mpiexec, mpi_env

HERE = os.path.dirname(os.path.abspath(__file__))
MPI_SCRIPTS = os.path.join(HERE, "mpi")

# Tests never write into the home folder: IPython, Jupyter and ipyparallel get temp dirs,
# set before anything imports them.
_ISOLATED = tempfile.mkdtemp(prefix="jupyter_ring_tests_")
for var, sub in (("IPYTHONDIR", "ipython"), ("JUPYTER_CONFIG_DIR", "jupyter_config"),
                 ("JUPYTER_DATA_DIR", "jupyter_data"), ("JUPYTER_RUNTIME_DIR", "jupyter_runtime"),
                 ("MPLCONFIGDIR", "mpl"), ("XDG_CACHE_HOME", "cache")):
    os.environ[var] = os.path.join(_ISOLATED, sub)
    os.makedirs(os.environ[var], exist_ok=True)
os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")


def screenshot_path(name):
    """Where a browser test saves ``name``: a temp dir, or the folder in JUPYTER_RING_SCREENSHOTS.

    The committed pictures in docs/img are refreshed on purpose with
    ``JUPYTER_RING_SCREENSHOTS=docs/img scripts/test.sh tests/browser``, never by a plain run.
    """
    folder = os.environ.get("JUPYTER_RING_SCREENSHOTS") or os.path.join(_ISOLATED, "screenshots")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, name)


class MPIResult:
    def __init__(self, proc, n):
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.n = n

    def lines(self, prefix):
        """Lines starting with ``prefix``; mpiexec may glue two ranks' lines together, so split there."""
        marker = re.escape(prefix) + r" \d"
        text = re.sub(f"(?={marker})", "\n", self.stdout)
        return [line for line in text.splitlines() if re.match(marker, line)]


def run_mpi(script, n, *args, env=None, timeout=120, check=True):
    """Run ``tests/mpi/<script>`` under a real ``mpiexec -n n``; fail with every rank's output."""
    path = script if os.path.isabs(script) else os.path.join(MPI_SCRIPTS, script)
    full_env = mpi_env()
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(env or {})
    cmd = [find_mpiexec(), "-n", str(n), sys.executable, path, *map(str, args)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} on {n} ranks did not finish in {timeout} s (a hang)\n"
                    f"stdout:\n{exc.stdout}\nstderr:\n{exc.stderr}")
    result = MPIResult(proc, n)
    if check and proc.returncode != 0:
        pytest.fail(f"{script} on {n} ranks exited {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\n"
                    f"stderr:\n{proc.stderr[-6000:]}")
    return result


@pytest.fixture
def mpirun():
    """``mpirun(script, n, *args, env=..., timeout=...)`` -> MPIResult (fails on non-zero exit)."""
    return run_mpi
